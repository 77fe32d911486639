"""The learner: computes gradients with PyTorch and trades them for weights with the PS.

Loop (one learner)::

    minibatch of µ samples from the data server (prefetched, so it is usually already here)
    -> forward/backward on the flat model (p.grad are views into one float32 buffer)
    -> PUSHPULL: the gradient, stamped with the timestamp of the weights it was computed on,
       in one round trip with the pull of newer weights
       (hardsync: the PS answers after the update, so every learner starts the next step on
        the same new weights; softsync/async: it answers at once, with newer weights or
        UPTODATE, and the learner goes on with what it has)
    -> until the PS answers STOP.

To a PS on another host (``runtime.gradient_parts``) a large gradient goes as GPART parts
and a final PUSHPULL x{parts}, so that the PS can update each part as it arrives; the reply
is the same WEIGHTS (streamed in parts), assembled by the channel before it is copied in.

The gradient buffer is sent zero-copy; it is written again only by the next backward pass,
which starts after the PS's reply, and the PS replies only after ZeroMQ delivered the push.
Received weights are copied once, into the flat buffer that the model's parameters view.

On a GPU (``runtime.device``, ``devices.py``) the model and its flat buffers live on the GPU:
each minibatch goes there after augmentation, the flat gradient comes back to a pinned host
buffer in one transfer after backward (that buffer is what is pushed), and received weights
go to the GPU in one transfer once the reply is complete.

Rudra-adv* (``architecture.kind: advstar``): push and pull are asynchronous. Weights arrive
by the learners' broadcast on a :class:`~rudra_zmq.roles.broadcast.BroadcastMember` I/O
thread, which forwards every chunk downstream as it comes and keeps the newest complete
version; gradients go to the leaf tree node as PUSH::

    adopt the newest complete version (copy_into the flat weights; between steps only)
    -> forward/backward                 (meanwhile: the previous push travels, on ZeroMQ's
                                         I/O thread; new versions arrive, on the member's)
    -> collect the previous push's reply (ACK, or STOP: leave)
    -> copy the gradient into the send buffer (kernels.copy_into) and PUSH it, zero-copy,
       stamped with the version it was computed on, without waiting for the reply

The send buffer is written only after the previous push was answered, so ZeroMQ is done
with it; the model's own gradient buffer is free for the next backward pass at once.

Shared memory with the leaf (``architecture.leaf_shm``, ``shm.py``): the learner makes two
gradient slots in /dev/shm and offers them in its HELLO; if the leaf's WELCOME accepts, each
push copies the gradient into the next slot (alternating; one pass instead of ZeroMQ's socket
copies) and names it, x{slot}, with no payload, and a WEIGHTS x{board: true} reply is copied
from the leaf's weight board (its seqlock returns no torn version). Otherwise, or if anything
about shared memory fails, payloads as above.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch
import zmq

from .. import kernels, transport, wire
from ..sync import learners_wait
from ..wire import Kind

log = logging.getLogger("rudra_zmq.learner")

_METRIC_EVERY_S = 1.0


def augment(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding ``pad``) and horizontal flip, per sample. Does not block."""
    b, c, h, w = x.shape
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    rows = (oy[:, None] + torch.arange(h))[:, :, None]           # (b, h, 1)
    cols = (ox[:, None] + torch.arange(w))[:, None, :]           # (b, 1, w)
    flip = torch.rand(b, generator=generator) < 0.5
    cols = torch.where(flip[:, None, None], cols.flip(-1), cols)
    out = xp[torch.arange(b)[:, None, None], :, rows, cols]      # (b, h, w, c)
    return out.permute(0, 3, 1, 2).contiguous()


class Learner:
    """One learner; ``run()`` trains in the calling thread until the PS says STOP.

    Owns its sockets (not thread-safe); several learners may share a process, each in its
    own thread, with a shared thread-safe ``zmq.Context``. Under advstar it also owns a
    broadcast member, whose I/O thread runs from construction until ``close()``.
    """

    def __init__(self, cfg, learner_id: int, ps: str, data: str, stats: str | None = None,
                 ctx: zmq.Context | None = None, bcast: tuple[str, str | None] | None = None):
        """``bcast`` (advstar only): (upstream endpoint, endpoint to bind for its broadcast
        children or None)."""
        from ..datasets import dataset_shape
        from ..devices import learner_device
        from ..flat import FlatModel
        from ..models import build_model, input_transform
        from .data_server import DataClient

        self.cfg = cfg
        self.id = learner_id
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        shape = dataset_shape(cfg.data)
        self.device = learner_device(cfg.runtime.device, learner_id)
        self.model = build_model(cfg.model.name, cfg.data.num_classes, shape, seed=cfg.model.seed)
        self.prep = input_transform(cfg.model.name)
        self.flat = FlatModel(self.model, device=self.device)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        from ..update import stream_part_floats
        self._part_floats = self.flat.numel     # floats per pushed part (all: one message)
        if transport.pushes_gradients_in_parts(cfg.runtime.gradient_parts, ps):
            self._part_floats = stream_part_floats(self.flat.numel, self.chunk_bytes,
                                                   cfg.runtime.stream_parts)
        timeout_ms = int(cfg.runtime.timeout_s * 1000)
        self.ps = transport.Channel(self.ctx, ps, learner_id, name="parameter server",
                                    timeout_ms=timeout_ms, hwm=4)
        self.data = DataClient(self.ctx, data, learner_id, prefetch=cfg.data.prefetch,
                               timeout_ms=timeout_ms)
        self.stats = None
        if stats:
            from .stats_client import StatsClient
            self.stats = StatsClient(self.ctx, stats, learner_id)
        self.generator = torch.Generator().manual_seed(cfg.train.seed * 1000 + learner_id)
        self.ts = 0
        self.steps = 0
        self.finished = False     # the PS said STOP
        self.member = None
        self.slots = self.board = None   # leaf_shm: ours, and the leaf's (shm.py)
        self._slot = 0
        if cfg.architecture.leaf_shm:
            self._make_slots()
        if cfg.architecture.kind == "advstar":
            self._start_member(bcast)

    def _start_member(self, bcast) -> None:
        from .. import topology
        from .broadcast import BroadcastMember

        if not bcast or not bcast[0]:
            raise ValueError(f"learner {self.id}: architecture.kind=advstar needs its broadcast "
                             "upstream (rudra-zmq learner --bcast-upstream EP)")
        up = topology.broadcast_upstream(self.cfg, self.id)
        kids = topology.broadcast_children(self.cfg, self.id)
        if kids and not bcast[1]:
            raise ValueError(f"learner {self.id} forwards the broadcast to learners {kids}: "
                             "give it an endpoint to bind (--bcast-bind EP)")
        self.member = BroadcastMember(
            self.ctx, bcast[1] if kids else None, bcast[0], self.flat.numel, member=self.id,
            children=kids, chunk_bytes=self.chunk_bytes, timeout_s=self.cfg.runtime.timeout_s,
            upstream_name="the root" if up is None else f"learner {up}").start()
        self._sendbuf = np.empty_like(self.flat.grads)
        self._in_flight = False

    def _make_slots(self) -> None:
        from .. import shm, topology

        self._leaf = topology.plan(self.cfg).leaf_of(self.id).id
        try:
            self.slots = shm.GradientSlots.create(shm.new_token(), self._leaf, self.id,
                                                  self.flat.numel)
        except (shm.ShmUnavailable, OSError) as exc:
            log.warning("learner %d: no shared memory with tree node %d, pushing ZeroMQ "
                        "payloads: %s", self.id, self._leaf, exc)

    def _shm_welcome(self, welcome: wire.Message) -> None:
        """The leaf's WELCOME: keep the slots (and map its board) if it accepted them."""
        from .. import shm

        self.slots.unlink()       # the leaf has mapped them, or never will: no name to leak
        token = welcome.fields.get("shm")
        try:
            if token is None:
                raise shm.ShmUnavailable(f"tree node {self._leaf} declined (see its log)")
            if token:
                self.board = shm.WeightBoard.attach(token, self._leaf, self.flat.numel)
            elif self.member is None:
                raise shm.ShmUnavailable(f"tree node {self._leaf} has no weight board")
        except (shm.ShmUnavailable, OSError, ValueError) as exc:
            log.warning("learner %d: pushing ZeroMQ payloads: %s", self.id, exc)
            self.slots.close()
            self.slots = None

    def _gradient(self) -> tuple[list, dict]:
        """The pushed gradient as (payloads, fields): in the next shared slot, or frames."""
        if self.slots is None:
            return wire.chunk(self._sendbuf if self.member is not None else self.flat.grads,
                              self.chunk_bytes), {}
        slot, self._slot = self._slot, self._slot ^ 1
        kernels.copy_into(self.slots.slot(slot), self.flat.grads)
        return [], {"slot": slot}

    def _pushpull(self) -> wire.Message:
        """Push the gradient and pull newer weights in one round trip. To the root PS
        (architecture base) a large gradient goes in parts, so that the PS updates each part
        as it arrives (``runtime.stream_parts``; wire.py GPART)."""
        wait = learners_wait(self.cfg.sync.protocol)
        kinds = {Kind.WEIGHTS, Kind.UPTODATE}
        if self.cfg.architecture.kind == "base":
            return self.ps.pushpull(self.ts, self.flat.grads, self._part_floats,
                                    self.chunk_bytes, wait=wait, kinds=kinds,
                                    numel=self.flat.numel)
        payloads, shared = self._gradient()
        return self.ps.request(Kind.PUSHPULL, self.ts, payloads, reply_kinds=kinds,
                               numel=self.flat.numel, wait=wait, **shared)

    def _load(self, msg: wire.Message) -> None:
        if msg.in_shm:
            if self.board is None:
                raise RuntimeError(f"learner {self.id}: tree node {self._leaf} said to read its "
                                   "weight board, but it never offered one in its WELCOME")
            ts = self.board.read_into(self.flat.weights, timeout_s=self.cfg.runtime.timeout_s)
            if ts < msg.ts:
                raise RuntimeError(f"learner {self.id}: the weight board holds version {ts}, "
                                   f"older than the {msg.ts} tree node {self._leaf} announced")
            self.ts = ts
        else:
            off = 0
            for part in msg.payloads:
                n = part.shape[0]
                kernels.copy_into(self.flat.weights[off:off + n], part)
                off += n
            self.ts = msg.ts
        self.flat.weights_to_device()

    def _backward(self) -> None:
        x, y, _epoch, _ = self.data.next_batch()
        xf = self.prep(x, self.data.mean, self.data.std)
        if self.cfg.data.augment:
            xf = augment(xf, self.generator)
        if self.flat.staged:
            xf, y = xf.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.flat.zero_grad()
        loss = self.loss_fn(self.model(xf), y)
        loss.backward()
        self.flat.grads_to_host()
        self._loss_sum += loss.item()

    def step(self) -> bool:
        """One minibatch: gradient, push, pull. Returns False once the PS said STOP."""
        if self.member is not None:
            return self._step_advstar()
        self._backward()
        reply = self._pushpull()
        self.steps += 1
        if reply.kind == Kind.STOP:
            return False
        if reply.kind == Kind.WEIGHTS:
            self._load(reply)
        return True

    def _step_advstar(self) -> bool:
        """Rudra-adv*: adopt the newest broadcast version, compute, push without waiting."""
        self.member.check()       # the broadcast I/O thread failed: a silent upstream
        ts, self.ts = self.ts, self.member.copy_latest_into(self.flat.weights, self.ts)
        if self.ts != ts:
            self.flat.weights_to_device()
        grad_ts = self.ts
        self._backward()
        if self._in_flight:
            reply = self.ps.recv({Kind.ACK})
            self._in_flight = False
            if reply.kind == Kind.STOP:
                return False
        if self.slots is None:
            kernels.copy_into(self._sendbuf, self.flat.grads)
        payloads, shared = self._gradient()
        self.ps.send(Kind.PUSH, grad_ts, payloads, **shared)
        self._in_flight = True
        self.steps += 1
        return True

    def _wait_for_broadcast(self) -> None:
        """advstar: wait until the first version came down the broadcast (the root sends
        its initial weights to every member that joins), so a learner whose upstream is not
        up yet does not train blind. Bounded by the member's runtime.timeout_s."""
        while self.member.latest_version() is None:
            self.member.check()
            time.sleep(0.01)

    def run(self, stop_event: threading.Event | None = None) -> int:
        """Say HELLO, then train until STOP (or ``stop_event``). Blocks; raises on failure."""
        try:
            self.ps.send(Kind.HELLO, model=self.flat.signature, numel=self.flat.numel,
                         **({"shm": self.slots.token} if self.slots is not None else {}))
            welcome = self.ps.recv({Kind.WELCOME}, numel=self.flat.numel)
            if welcome.kind == Kind.STOP:
                self.finished = True
                return 0
            self._load(welcome)
            if self.slots is not None:
                self._shm_welcome(welcome)
            if self.member is not None:
                self._wait_for_broadcast()
            self._loss_sum, t_last, steps_last = 0.0, time.time(), 0
            mu = self.cfg.sync.batch_size
            while stop_event is None or not stop_event.is_set():
                if not self.step():
                    self.finished = True
                    break
                now = time.time()
                if self.stats and now - t_last >= _METRIC_EVERY_S:
                    n = self.steps - steps_last
                    self.stats.metric({"type": "learner", "learner": self.id, "t": now,
                                       "step": self.steps, "ts": self.ts,
                                       "samples_per_s": n * mu / (now - t_last),
                                       "loss": self._loss_sum / max(n, 1)})
                    self._loss_sum, t_last, steps_last = 0.0, now, self.steps
            return 0
        finally:
            self.close()

    def close(self) -> None:
        for seg in (self.slots, self.board):
            if seg is not None:
                seg.close()
        if self.member is not None:  # a learner that leaves passes STOP on to its children
            self.member.close(stop_reason="training finished" if self.finished else None)
        self.ps.close()
        self.data.close()
        if self.stats:
            self.stats.close()
        if self._own_ctx:
            self.ctx.term()


def serve(cfg, learner_ids: list[int], ps: str, data: str, stats: str | None = None,
          bcast_upstream: list[str] | None = None, bcast_bind: list | None = None) -> int:
    """Entry point of ``rudra-zmq learner``: run these learners (one thread each) to the end.

    ``bcast_upstream``/``bcast_bind`` (advstar): per learner id, its broadcast upstream and
    the endpoint it binds for its broadcast children (None: it has none).

    If one learner fails, the error is logged and raised at once: waiting for the others
    could hang (hardsync waits for every learner), and the launcher stops the run.
    """
    ctx = zmq.Context()
    try:
        return _serve_in(ctx, cfg, learner_ids, ps, data, stats, bcast_upstream, bcast_bind)
    finally:
        # destroy, not term: a SIGTERM (KeyboardInterrupt) can land while a Learner is still
        # being built, before run()'s finally closes its sockets; term() would then wait for
        # them forever and the process would outlive the run.
        ctx.destroy(linger=transport.LINGER_MS)


def _serve_in(ctx, cfg, learner_ids, ps, data, stats, bcast_upstream, bcast_bind) -> int:
    bcast = dict(zip(learner_ids, zip(bcast_upstream or [], bcast_bind or [])))
    if len(learner_ids) == 1:
        return Learner(cfg, learner_ids[0], ps, data, stats, ctx,
                       bcast.get(learner_ids[0])).run()
    errors: list[BaseException] = []
    failed = threading.Event()

    def work(i):
        try:
            Learner(cfg, i, ps, data, stats, ctx, bcast.get(i)).run(stop_event=failed)
        except BaseException as exc:  # reported by the main thread
            log.exception("learner %d failed", i)
            errors.append(exc)
            failed.set()

    threads = [threading.Thread(target=work, args=(i,), name=f"learner-{i}", daemon=True)
               for i in learner_ids]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if failed.wait(0.5):
            raise RuntimeError(f"learner thread failed: {errors[0]!r}") from errors[0]
    if errors:
        raise errors[0]
    return 0
