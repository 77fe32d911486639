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

The gradient buffer is sent zero-copy; it is written again only by the next backward pass,
which starts after the PS's reply, and the PS replies only after ZeroMQ delivered the push.
Received weights are copied once, into the flat buffer that the model's parameters view.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch
import zmq

from .. import kernels, transport, wire
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
    own thread, with a shared thread-safe ``zmq.Context``.
    """

    def __init__(self, cfg, learner_id: int, ps: str, data: str, stats: str | None = None,
                 ctx: zmq.Context | None = None):
        from ..datasets import dataset_shape
        from ..flat import FlatModel
        from ..models import build_model
        from .data_server import DataClient

        self.cfg = cfg
        self.id = learner_id
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        shape = dataset_shape(cfg.data)
        self.model = build_model(cfg.model.name, cfg.data.num_classes, shape, seed=cfg.model.seed)
        self.flat = FlatModel(self.model)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        timeout_ms = int(cfg.runtime.timeout_s * 1000)
        self.ps = transport.Channel(self.ctx, ps, learner_id, name="parameter server",
                                    timeout_ms=timeout_ms, hwm=4)
        self.data = DataClient(self.ctx, data, learner_id, prefetch=cfg.data.prefetch,
                               timeout_ms=timeout_ms)
        self.stats = None
        if stats:
            from .stats_server import StatsClient
            self.stats = StatsClient(self.ctx, stats, learner_id)
        self.generator = torch.Generator().manual_seed(cfg.train.seed * 1000 + learner_id)
        self.ts = 0
        self.steps = 0

    def _load(self, msg: wire.Message) -> None:
        off = 0
        for part in msg.payloads:
            n = part.shape[0]
            kernels.copy_into(self.flat.weights[off:off + n], part)
            off += n
        self.ts = msg.ts

    def step(self) -> bool:
        """One minibatch: gradient, push, pull. Returns False once the PS said STOP."""
        x, y, _epoch, _ = self.data.next_batch()
        mean, std = self.data.mean, self.data.std
        from ..datasets import to_float
        xf = to_float(x, mean, std)
        if self.cfg.data.augment:
            xf = augment(xf, self.generator)
        self.flat.zero_grad()
        loss = self.loss_fn(self.model(xf), y)
        loss.backward()
        self._loss_sum += loss.item()
        reply = self.ps.request(Kind.PUSHPULL, self.ts, wire.chunk(self.flat.grads,
                                                                   self.chunk_bytes),
                                reply_kinds={Kind.WEIGHTS, Kind.UPTODATE},
                                numel=self.flat.numel,
                                wait=self.cfg.sync.protocol == "hardsync")
        self.steps += 1
        if reply.kind == Kind.STOP:
            return False
        if reply.kind == Kind.WEIGHTS:
            self._load(reply)
        return True

    def run(self, stop_event: threading.Event | None = None) -> int:
        """Say HELLO, then train until STOP (or ``stop_event``). Blocks; raises on failure."""
        try:
            self.ps.send(Kind.HELLO, model=self.flat.signature, numel=self.flat.numel)
            welcome = self.ps.recv({Kind.WELCOME}, numel=self.flat.numel)
            if welcome.kind == Kind.STOP:
                return 0
            self._load(welcome)
            self._loss_sum, t_last, steps_last = 0.0, time.time(), 0
            mu = self.cfg.sync.batch_size
            while stop_event is None or not stop_event.is_set():
                if not self.step():
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
        self.ps.close()
        self.data.close()
        if self.stats:
            self.stats.close()
        if self._own_ctx:
            self.ctx.term()


def serve(cfg, learner_ids: list[int], ps: str, data: str, stats: str | None = None) -> int:
    """Entry point of ``rudra-zmq learner``: run these learners (one thread each) to the end.

    If one learner fails, the error is logged and raised at once: waiting for the others
    could hang (hardsync waits for every learner), and the launcher stops the run.
    """
    ctx = zmq.Context()
    if len(learner_ids) == 1:
        try:
            return Learner(cfg, learner_ids[0], ps, data, stats, ctx).run()
        finally:
            ctx.term()
    errors: list[BaseException] = []
    failed = threading.Event()

    def work(i):
        try:
            Learner(cfg, i, ps, data, stats, ctx).run(stop_event=failed)
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
    ctx.term()
    return 0
