"""The Rudra-base parameter server: holds the weights, sums gradients, applies updates.

One thread owns everything (the ROUTER socket, the weights, the sync engine), so the update
needs no lock; the heavy work runs in the compiled kernels with the GIL released and, for
large models, on ``runtime.ps_threads`` OpenMP threads. ZeroMQ's I/O thread moves the bytes.

Per request (all validated by ``wire.decode`` and ``SyncEngine.check`` before any state is
touched; a refused request gets an ERROR reply and leaves the weights bit-identical):

- HELLO: check the learner's model signature and size, reply WELCOME with the weights;
- PUSH / PUSHPULL: the gradient frames are read in place (no copy) and either
  accumulated into ``acc`` with their staleness scale, or — when this one gradient completes
  an update (async, c = 1) — fed straight into the update kernel, skipping the sum. Such a
  PUSHPULL is served in compiled code (``ps_hot.py``: the same checks, kernel and reply, then
  the engine's accounting) unless ``runtime.hot_path`` is off;
- GPART... then PUSH / PUSHPULL x{parts}: a gradient in parts (``push_parts.py``): updated
  part by part as it arrives when it alone makes the update (cut-through), else kept and
  handled as one PUSH / PUSHPULL when complete;
- PULL / PUSHPULL: answered with WEIGHTS if the server's timestamp is newer than the learner's,
  else UPTODATE, or (hardsync: ``wait``) parked until the next update.
- RELAY (Rudra-adv, ``architecture.kind: adv``): a tree node's sum of several learners'
  gradients with their vector clock; the sync engine accounts every gradient of the clock
  (``receive_many``: c counts learner gradients), the sum is added to ``acc`` and the update
  averages by the number of gradients; answered like PUSHPULL. A tree node's HELLO names the
  learners below it, checked against the tree the config plans; a STOP to a node counts as a
  STOP to each of those learners (the node passes it on), so the server ends when every
  learner was told, directly or through its node.

Copies, and why: none for weights. Pulls are answered with the current weight array itself,
zero-copy, so a version must never be written again once handed out: the update writes the
next version into another buffer instead of in place (``versions.WeightVersions``; the kernels'
``out=``, the same single pass over memory). A buffer is reused once no send holds it.
"""
from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import numpy as np
import zmq

from .. import fastio, kernels, topology, transport, wire
from ..update import Updater, stream_part_floats
from ..sync import LRSchedule, ProtocolViolation, SyncEngine
from ..wire import Kind
from .ps_report import PSReport
from .ps_hot import HotPathMixin
from .push_parts import PushPartsMixin

log = logging.getLogger("rudra_zmq.ps")

_NOTHING = object()   # serve_forever: the wait ended without a message
WAIT_MS = 100   # the longest the serving loop waits in libzmq before looking at its clocks
_REQUESTS = {Kind.HELLO, Kind.PUSH, Kind.PULL, Kind.PUSHPULL, Kind.BYE, Kind.RELAY, Kind.GPART}


def initial_model(cfg):
    """Build the configured model; return (weights copy, segments, signature, input shape)."""
    from ..datasets import dataset_shape
    from ..flat import FlatModel
    from ..models import build_model

    shape = dataset_shape(cfg.data)
    flat = FlatModel(build_model(cfg.model.name, cfg.data.num_classes, shape,
                                 seed=cfg.model.seed))
    segments = flat.segments() if cfg.optimizer.param_multipliers else [(0, flat.numel, 1.0, 1.0)]
    return flat.weights.copy(), segments, flat.signature, shape


class ParameterServer(PushPartsMixin, HotPathMixin):
    """A parameter server bound at ``bind``; ``serve_forever()`` runs it in the calling thread.

    Args:
        cfg: the run's Config.
        bind: endpoint to bind (``tcp://HOST:0`` picks a port; see ``.endpoint``).
        stats: the statistics server's endpoint, or None.
        run_dir: where to write ``weights.npy`` at the end, or None.
        model: optional (weights, segments, signature) to skip building the torch model
            (benchmarks with synthetic gradients).
        broadcast: architecture.kind advstar only: the endpoint the Rudra-adv* broadcast root
            binds (``roles/broadcast.py``); every new version goes out there, and gradients
            are answered ACK (no weights in replies).
    Not thread-safe: construct and serve from one thread.
    """

    def __init__(self, cfg, bind: str, stats: str | None = None, run_dir: str | None = None,
                 ctx: zmq.Context | None = None, model=None, broadcast: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        if model is None:
            weights, segments, signature, _ = initial_model(cfg)
        else:
            weights, segments, signature = model
        self.chunk_bytes = cfg.runtime.chunk_mib << 20
        numel = int(np.asarray(weights).shape[0])
        self.updater = Updater(weights, segments, cfg.optimizer, stream_part_floats(
            numel, self.chunk_bytes, cfg.runtime.stream_parts))
        # the optimizer state, by name (tests and benchmarks look at them)
        self.numel, self.segments, self.versions = numel, segments, self.updater.versions
        self.acc, self.part_floats = self.updater.acc, self.updater.part_floats
        self.signature = signature
        self.inc = secrets.randbits(62) + 1
        s, o = cfg.sync, cfg.optimizer
        from ..datasets import dataset_size
        self.engine = SyncEngine(
            s.protocol, s.learners, LRSchedule(o.lr, o.lr_policy, tuple(o.lr_steps), o.lr_gamma),
            n=s.n, batch_size=s.batch_size, epoch_size=dataset_size(cfg.data))
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = transport.make_socket(self.ctx, zmq.ROUTER, hwm=max(64, 4 * s.learners))
        # A restarted learner reconnects with the same routing id: let it take over the name
        # instead of being silently refused while the old connection lingers.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.endpoint = transport.bind(self.sock, bind)
        # every message in and out goes through the compiled framing (fastio.py)
        self.io = fastio.FastSocket(self.sock)
        self.stats = None
        if stats:
            from .stats_client import StatsClient
            self.stats = StatsClient(self.ctx, stats, wire.SENDER_PS)
        self.identities: dict[int, bytes] = {}
        # Rudra-adv: the planned tree, and the learners below each registered tree node
        self.tree = topology.plan(cfg) if cfg.architecture.kind != "base" else None
        # Rudra-adv* (advstar): the one place that sets up the broadcast; see _after_update.
        self.broadcast = None
        if cfg.architecture.kind == "advstar":
            from .broadcast import BroadcastRoot
            if not broadcast:
                raise ValueError("architecture.kind=advstar: the parameter server needs a "
                                 "broadcast endpoint to bind (rudra-zmq ps --bcast-bind EP)")
            self.broadcast = BroadcastRoot(
                self.ctx, broadcast, self.numel, chunk_bytes=self.chunk_bytes,
                children=topology.broadcast_children(cfg, None)).start()
            # v0: the chain is up. No copy: a weight version is never written again while
            # anything refers to it (WeightVersions), the broadcast's frames included.
            self.broadcast.publish(self.engine.timestamp, self.w, copy=False)
        self.subtrees: dict[int, frozenset] = {}
        self.parked: list[tuple[bytes, int]] = []   # (routing id, learner) waiting for ts+1
        self.stopped: set[int] = set()
        self.done = False
        self.invalid = 0
        self.undelivered = 0
        self._warned: set = set()
        self._seq = 0
        self._streamed = False     # handle(): the reply went out during the update
        self.metrics = PSReport(self.stats)
        self._next_eval_epoch = cfg.train.eval_every_epochs or float("inf")
        self._init_parts()
        self._init_hot()

    # ------------------------------------------------------------------ sending
    def _send(self, ident: bytes, kind: Kind, payloads=(), at_ts: int | None = None,
              **fields) -> None:
        """Send one message to ``ident``, stamped with the current timestamp (or ``at_ts``:
        a cut-through update's parts go out before the engine has advanced)."""
        self._seq += 1
        ts = self.engine.timestamp if at_ts is None else at_ts
        frames = wire.encode(kind, wire.SENDER_PS, self._seq, ts, self.inc, payloads, **fields)
        try:
            # NOBLOCK: each learner has at most one request in flight, so its queue is never
            # full unless it misbehaves; then the reply is dropped rather than stalling the PS.
            self.io.send_multipart([ident, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: that learner is gone (ROUTER_MANDATORY)
            self.undelivered += 1
            log.warning("could not reply %s to %r: %s", kind.name, ident, exc)

    @property
    def w(self) -> np.ndarray:
        """The current weights (never written again: safe to send zero-copy)."""
        return self.updater.w

    @property
    def v(self) -> np.ndarray:
        """The momentum (a cut-through update swaps in its second buffer)."""
        return self.updater.v

    def _weights_payload(self) -> list[np.ndarray]:
        return wire.chunk(self.w, self.chunk_bytes)

    def _refuse(self, ident: bytes, sender, code: str, message: str) -> None:
        self.invalid += 1
        key = (ident, code)
        if key not in self._warned:  # log once per sender and reason, count all
            self._warned.add(key)
            log.warning("refused a message from %s (%r): %s", sender, ident, message)
        self._send(ident, Kind.ERROR, code=code, error=message)

    # ------------------------------------------------------------------ handling
    def handle(self, frames) -> None:
        """Process one ROUTER message (routing id first). Never raises for bad input."""
        if len(frames) < 2:
            return  # no routing id + header: nothing to answer
        ident = bytes(frames[0])
        try:
            msg = wire.decode(frames[1:], kinds=_REQUESTS, numel=self.numel,
                              learners=self.cfg.sync.learners, gradient_parts=True)
        except wire.WireError as exc:
            self._refuse(ident, "unknown sender", exc.code, str(exc))
            return
        if self._holds(msg):   # behind an open cut-through update (push_parts.py)
            self._held.append((ident, msg))
            return
        self._dispatch(ident, msg)
        if self._cut is None and self._held:
            self._release_held()

    def _dispatch(self, ident: bytes, msg: wire.Message) -> None:
        """Act on one validated request (refusing what the protocol does not allow)."""
        if self.done:
            if msg.kind != Kind.GPART:   # a gradient in parts gets its STOP at the end
                self._drop_parts(msg.sender)
                self._stop(ident, msg.sender)
            return
        try:
            if msg.kind == Kind.HELLO:
                self._hello(ident, msg)
                return
            self._check_sender(ident, msg)
            if msg.kind == Kind.GPART or msg.fields.get("parts") or msg.sender in self._parts:
                msg = self._part(ident, msg)
                if msg is None:
                    return
            if msg.kind == Kind.BYE:
                self._stopped(msg.sender)
                self._send(ident, Kind.ACK)
                return
            sigma, self._streamed = None, False
            reply = None if msg.kind == Kind.PUSH else ident
            if msg.kind in (Kind.PUSH, Kind.PUSHPULL):
                sigma = self._push(msg, reply)
            elif msg.kind == Kind.RELAY:
                sigma = self._relay(msg, reply)
            if self.done:  # this gradient completed training
                self._stop(ident, msg.sender)
            elif self._streamed:
                pass       # the new weights went out part by part during the update
            elif msg.kind == Kind.PUSH or self.broadcast is not None:  # advstar: no weights
                self._send(ident, Kind.ACK, sigma=sigma)
            else:
                self._pull(ident, msg, sigma)
        except ProtocolViolation as exc:
            self._refuse(ident, msg.sender, "protocol", str(exc))

    def _hello(self, ident: bytes, msg: wire.Message) -> None:
        learner, f = msg.sender, msg.fields
        who = wire.sender_name(learner)
        if self.tree is not None:
            below = self.tree.check_child(None, learner, f.get("subtree"))
        elif wire.node_id(learner) is not None or "subtree" in f:
            raise ProtocolViolation(f"{who} says HELLO as a tree node, but this server runs "
                                    "architecture.kind=base (is it running another config?)")
        elif not 0 <= learner < self.cfg.sync.learners:
            raise ProtocolViolation(f"learner id {learner} is out of range 0.."
                                    f"{self.cfg.sync.learners - 1} (sync.learners)")
        if f["numel"] != self.numel or f["model"] != self.signature:
            raise ProtocolViolation(
                f"{who} runs a model with {f['numel']:,} parameters (signature "
                f"{f['model']}); this server holds {self.numel:,} ({self.signature}). Is "
                f"{who} running another model config?")
        self.identities[learner] = ident
        if self.hot is not None:
            self.hot.set_ident(learner, ident)
        self._drop_parts(learner)   # a restarted learner starts its gradients afresh
        if wire.node_id(learner) is not None:
            self.subtrees[learner] = below
        self._send(ident, Kind.WELCOME, self._weights_payload(), learners=self.cfg.sync.learners,
                   protocol=self.cfg.sync.protocol)

    def _check_sender(self, ident: bytes, msg: wire.Message) -> None:
        if self.identities.get(msg.sender) != ident:
            raise ProtocolViolation(f"{wire.sender_name(msg.sender)} has not said HELLO on "
                                    "this connection")
        if msg.inc not in (0, self.inc):
            raise ProtocolViolation(f"{wire.sender_name(msg.sender)} talks to server incarnation "
                                    f"{msg.inc}, this is {self.inc} (the server restarted): say "
                                    "HELLO again")
        is_node = msg.sender in self.subtrees
        if msg.kind == Kind.RELAY and not is_node:
            raise ProtocolViolation(f"{wire.sender_name(msg.sender)} sent RELAY; only tree "
                                    "nodes relay gradient sums")
        if msg.kind in (Kind.PUSH, Kind.PUSHPULL, Kind.GPART) and is_node:
            raise ProtocolViolation(f"{wire.sender_name(msg.sender)} sent {msg.kind.name}; "
                                    "tree nodes send their gradient sums as RELAY")

    def _push(self, msg: wire.Message, reply: bytes | None) -> int:
        arrival = self.engine.receive(msg.sender, msg.ts)   # raises before touching weights
        self._add(msg.payloads, arrival.scale, arrival.update, 1, reply, arrival.sigma)
        return arrival.sigma

    def _relay(self, msg: wire.Message, reply: bytes | None) -> int:
        """A tree node's sum of gradients: account its clock, add the sum, maybe update."""
        entries = msg.clock
        topology.Tree.check_clock(msg.sender, entries, self.subtrees[msg.sender])
        arrival = self.engine.receive_many(entries)   # raises before touching weights
        self._add(msg.payloads, 1.0, arrival.update, len(entries), reply, arrival.sigma)
        return arrival.sigma

    def _add(self, payloads, scale: float, update, count: int, reply=None, sigma=None) -> None:
        """Add one message's ``count`` gradients (summed in ``payloads``) to ``acc``, and apply
        ``update`` if they complete one — streaming the new weights to ``reply`` (the sender,
        if it pulls) and the parked learners as they are computed, where that applies."""
        to = ()
        if update is not None and self.part_floats < self.numel and self.broadcast is None \
                and update.epoch < self.cfg.train.epochs:   # (the last update answers STOP)
            to = [(ident, {}) for ident, _ in self.parked]
            if reply is not None:
                to.append((reply, {"sigma": sigma}))
            if to:
                self.parked, self._streamed = [], reply is not None
        self.updater.receive(payloads, scale, update, count, self._part_sender(to))
        if update is not None:
            self._after_update(update)

    def _part_sender(self, to):
        """``Updater.step``'s ``on_part`` for ``to`` ((routing id, reply fields) pairs), or
        None: each part of the new weights goes to them as soon as it is final (WPART...,
        then WEIGHTS), so ZeroMQ moves part i while the kernel computes part i+1."""
        if not to:
            return None

        def send_part(lo, hi, out, last, n_parts):
            for ident, fields in to:
                if last:
                    self._send(ident, Kind.WEIGHTS, [out[lo:hi]], parts=n_parts - 1, **fields)
                else:
                    self._send(ident, Kind.WPART, [out[lo:hi]], offset=lo)
        return send_part

    def _after_update(self, update) -> None:
        self.metrics.update(update)
        t = self.cfg.train
        if update.epoch >= t.epochs:
            self.done = True
        if self.broadcast is not None:  # Rudra-adv*: the new version goes down the broadcast
            self.broadcast.publish(update.timestamp, self.w, done=self.done, copy=False,
                                   reason=f"training finished at epoch {update.epoch:.2f}")
        if (t.eval_every_updates and update.timestamp % t.eval_every_updates == 0) or \
                update.epoch >= self._next_eval_epoch or self.done:
            while update.epoch >= self._next_eval_epoch:
                self._next_eval_epoch += t.eval_every_epochs
            self._eval()
        parked, self.parked = self.parked, []
        for ident, learner in parked:
            if self.done:
                self._stop(ident, learner)
            else:
                self._send(ident, Kind.WEIGHTS, self._weights_payload())

    def _pull(self, ident: bytes, msg: wire.Message, sigma) -> None:
        extra = {} if sigma is None else {"sigma": sigma}
        if self.engine.timestamp > msg.ts:
            self._send(ident, Kind.WEIGHTS, self._weights_payload(), **extra)
        elif msg.fields["wait"]:
            self.parked.append((ident, msg.sender))
        else:
            self._send(ident, Kind.UPTODATE, **extra)

    def _stopped(self, sender: int) -> None:
        self.stopped |= self.tree.below(sender) if self.tree else {sender}  # nodes pass it on

    def _stop(self, ident: bytes, learner: int) -> None:
        self._stopped(learner)
        self._send(ident, Kind.STOP, reason=f"training finished at epoch {self.engine.epoch:.2f}")

    # ------------------------------------------------------------------ statistics
    def _eval(self) -> None:
        if self.stats:
            self.stats.eval_weights(self.engine.timestamp, self.engine.epoch,
                                    self.w, self.chunk_bytes)

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event=None) -> int:
        """Serve until training is done and every learner was told, or ``stop_event`` is set.

        Blocks. Raises TimeoutError if no learner sends anything for ``runtime.timeout_s``.
        """
        timeout = self.cfg.runtime.timeout_s
        last_msg = time.time()
        if self.stats:
            self._eval()  # test error of the initial weights (epoch 0)
        # One blocking receive per message (libzmq waits with the GIL released, at most
        # WAIT_MS): no Poller and no zmq.Again per message on the hot path.
        self.sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
        try:
            while not (stop_event is not None and stop_event.is_set()):
                if self.done and self.stopped >= set(range(self.cfg.sync.learners)):
                    break
                self._arm_hot()
                try:   # HotPS serves the hot request in C (ps_hot.py); else frames
                    frames = self.io.recv_multipart() if self.hot is None else self.hot.serve()
                except zmq.Again:
                    frames = _NOTHING
                if frames is None:
                    self._hot_served()
                    last_msg = time.time()
                elif frames is not _NOTHING:
                    self._disarm_hot()
                    self.handle(frames)
                    last_msg = time.time()
                elif time.time() - last_msg > timeout:
                    if self.done:
                        log.warning("training is done but learners %s never came back; exiting",
                                    sorted(set(range(self.cfg.sync.learners)) - self.stopped))
                        break
                    raise TimeoutError(
                        f"parameter server: no message from any learner for {timeout:.0f} s at "
                        f"timestamp {self.engine.timestamp} (learners registered: "
                        f"{sorted(i for i in self.identities if i >= 0)}, tree nodes: "
                        f"{sorted(wire.node_id(s) for s in self.subtrees)}); is a learner or "
                        "tree node dead?")
                if self._parts:
                    self._expire_parts()
                self.metrics.tick(self)
        finally:
            self._finish()
        return 0

    def _finish(self) -> None:
        self.metrics.tick(self, force=True)
        if self.done:
            self.metrics.done(self)
        if self.stats:
            self.stats.close()
        if self.run_dir is not None:
            np.save(self.run_dir / "weights.npy", self.w)
        if self.broadcast is not None:
            self.broadcast.close()
        self.io.close(linger=transport.LINGER_MS)
        if self._own_ctx:
            self.ctx.term()


def serve(cfg, bind: str, stats: str | None = None, run_dir: str | None = None,
          broadcast: str | None = None) -> int:
    """Entry point of ``rudra-zmq ps``: run one parameter server until training ends."""
    threads = cfg.runtime.ps_threads or kernels.get_num_threads()
    kernels.set_num_threads(threads)
    ps = ParameterServer(cfg, bind, stats, run_dir, broadcast=broadcast)
    if ps.broadcast is not None:
        print(f"broadcast root listening on {ps.broadcast.endpoint}", flush=True)
    print(f"parameter server listening on {ps.endpoint} ({ps.numel:,} parameters, "
          f"{cfg.sync.protocol}, λ={cfg.sync.learners}, {threads} kernel threads)", flush=True)
    return ps.serve_forever()
