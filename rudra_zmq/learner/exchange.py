"""How a learner trades gradients for weights: one class per way, chosen once at start.

Exchanges (what goes up and what comes back):

- :class:`PushPull` (``base``, ``adv``): one PUSHPULL round trip per step, stamped with the
  timestamp of the weights the gradient was computed on; the reply is WEIGHTS (copied into
  the model) or UPTODATE, sent when the server's sync engine says: under hardsync after its
  update, so every learner starts the next step on the same weights.
- :class:`BroadcastPush` (``advstar``): push without waiting; weights arrive by the learners'
  broadcast on a :class:`~rudra_zmq.broadcast.member.BroadcastMember` I/O thread, and the
  newest complete version is adopted between steps.

Carriers (how the bytes travel to the first hop):

- :class:`Frames`: ZeroMQ payload frames in the run's payload codec (``codec.py``; float32
  views, zero-copy). Written again only after the reply to the push that carried them
  (advstar: copied into a send buffer first, since the next backward pass starts before that
  reply). Weights are decoded into the model's buffer: the one copy a load makes.
- :class:`SharedSlots` (``architecture.leaf_shm``): two gradient slots in /dev/shm that the
  leaf maps (alternating), and the leaf's weight board; the push names its slot and carries
  no payload. Falls back to frames if the leaf declines or anything about shared memory fails.

Rejoining: a server that answers ``rejoin`` (it restarted from a checkpoint, or evicted this
learner for silence) gets a new HELLO with the newest timestamp this learner saw; the
gradient it refused is dropped (at most once; with error feedback, its rounding residual
too), and the WELCOME's weights and data step
(``on_welcome``) are where the learner goes on.

Not thread-safe: one learner thread owns its exchange.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import codec, kernels, shm, topology, wire
from ..channel import Channel, ServerError
from ..wire import Kind

log = logging.getLogger("rudra_zmq.learner")


class Frames:
    """Gradients and weights as ZeroMQ payload frames encoded by ``wire_codec``. ``own_buffer``:
    copy each gradient into a send buffer first (for pushes still in flight during the next
    step)."""

    hello_fields: dict = {}

    def __init__(
        self, numel: int, chunk_bytes: int, own_buffer: bool = False, wire_codec=codec.FLOAT32
    ):
        self.chunk_bytes, self.codec = chunk_bytes, wire_codec
        # a half codec narrows into a buffer of its own: no send buffer needed
        self._sendbuf = (
            np.empty(numel, np.float32) if own_buffer and not wire_codec.copies else None
        )

    def welcomed(self, welcome: wire.Message) -> Frames:
        """The carrier to use after the server's WELCOME (frames stay frames)."""
        return self

    def gradient(self, grads: np.ndarray) -> tuple[list, dict]:
        """The push's (payloads, fields) for ``grads``. Does not block."""
        if self._sendbuf is not None:
            kernels.copy_into(self._sendbuf, grads)
            grads = self._sendbuf
        return self.codec.encode(grads, self.chunk_bytes), {}

    def parts(self, grads: np.ndarray, bounds) -> list[tuple]:
        """The push's (offset, payloads) per part (``wire.parts``; ``span.part_bounds``),
        encoded as ``gradient`` does, once for the whole."""
        return codec.encode_parts(self.codec, grads, bounds, self.chunk_bytes)

    def refused(self) -> None:
        """The last gradient was refused (rejoin): the codec forgets what it kept of it."""
        self.codec.forget()

    def load(self, msg: wire.Message, weights: np.ndarray) -> int:
        """Decode a WEIGHTS/WELCOME reply's frames into ``weights`` (from x{at}: the parts
        before it came ahead); returns its timestamp."""
        codec.load(weights[msg.fields.get("at", 0) :], msg.payloads)
        return msg.ts

    def close(self) -> None:
        """Nothing to release."""


class SharedSlots:
    """leaf_shm: gradients through two shared slots, weights from the leaf's board."""

    def __init__(self, cfg, learner_id: int, numel: int, frames: Frames):
        """``frames``: the carrier to fall back to (and to load frame replies with)."""
        self.id, self.numel, self.timeout_s = learner_id, numel, cfg.runtime.timeout_s
        self.advstar = cfg.architecture.kind == "advstar"  # no board: weights by broadcast
        self.leaf = topology.plan(cfg).leaf_of(learner_id).id
        self.frames = frames
        self.slots = shm.GradientSlots.create(shm.new_token(), self.leaf, learner_id, numel)
        self.hello_fields = {"shm": self.slots.token}
        self.board = None
        self._next = 0

    def welcomed(self, welcome: wire.Message):
        """Keep the slots (and map the leaf's board) if the leaf accepted them; else close
        them and return the frames carrier."""
        self.slots.unlink()  # the leaf has mapped them, or never will: no name to leak
        token = welcome.fields.get("shm")
        try:
            if token is None:
                raise shm.ShmUnavailable(f"tree node {self.leaf} declined (see its log)")
            if token:
                self.board = shm.WeightBoard.attach(token, self.leaf, self.numel)
            elif not self.advstar:
                raise shm.ShmUnavailable(f"tree node {self.leaf} has no weight board")
            return self
        except (shm.ShmUnavailable, OSError, ValueError) as exc:
            log.warning("learner %d: pushing ZeroMQ payloads: %s", self.id, exc)
            self.close()
            return self.frames

    def gradient(self, grads: np.ndarray) -> tuple[list, dict]:
        """Copy ``grads`` into the next slot; the push names it and carries no payload."""
        slot, self._next = self._next, self._next ^ 1
        kernels.copy_into(self.slots.slot(slot), grads)
        return [], {"slot": slot}

    def refused(self) -> None:
        """A slot's gradient is float32 as computed: nothing kept (the fallback's codec)."""
        self.frames.refused()

    def load(self, msg: wire.Message, weights: np.ndarray) -> int:
        """Copy the weights a reply refers to (frames, or the board) into ``weights``."""
        if not msg.in_shm:
            return self.frames.load(msg, weights)
        if self.board is None:
            raise RuntimeError(
                f"learner {self.id}: tree node {self.leaf} said to read its "
                "weight board, but it never offered one in its WELCOME"
            )
        ts = self.board.read_into(weights, timeout_s=self.timeout_s)
        if ts < msg.ts:
            raise RuntimeError(
                f"learner {self.id}: the weight board holds version {ts}, "
                f"older than the {msg.ts} tree node {self.leaf} announced"
            )
        return ts

    def close(self) -> None:
        """Unmap the slots and the board."""
        for seg in (self.slots, self.board):
            if seg is not None:
                seg.close()


def make_carrier(cfg, learner_id: int, numel: int):
    """Frames, or shared slots where ``architecture.leaf_shm`` asks and /dev/shm allows."""
    # advstar pushes without waiting: the gradient must leave the model's buffer first
    frames = Frames(
        numel,
        cfg.runtime.chunk_mib << 20,
        own_buffer=cfg.architecture.kind == "advstar",
        wire_codec=codec.for_gradients(cfg),
    )
    if cfg.architecture.leaf_shm:
        try:
            return SharedSlots(cfg, learner_id, numel, frames)
        except (shm.ShmUnavailable, OSError) as exc:
            log.warning(
                "learner %d: no shared memory with its leaf, pushing ZeroMQ payloads: %s",
                learner_id,
                exc,
            )
    return frames


class PushPull:
    """One PUSHPULL round trip per step to the PS or the leaf tree node (base, adv)."""

    def __init__(self, cfg, learner_id: int, flat, channel: Channel, carrier):
        self.id, self.flat, self.ps, self.carrier = learner_id, flat, channel, carrier
        self.ts = -1
        self.rejoins = 0
        self.on_welcome = lambda step: None  # the learner repositions its data here

    def start(self) -> bool:
        """Say HELLO and load the WELCOME's weights. Blocks; False if the run already ended."""
        self.ps.send(
            Kind.HELLO,
            model=self.flat.signature,
            numel=self.flat.numel,
            **({"had": self.ts} if self.ts >= 0 else {}),
            **self.carrier.hello_fields,
        )
        welcome = self.ps.recv({Kind.WELCOME}, numel=self.flat.numel)
        if welcome.kind == Kind.STOP:
            return False
        self._load(welcome)
        self.carrier = self.carrier.welcomed(welcome)
        self.on_welcome(welcome.fields.get("step"))
        return True

    def rejoin(self, why: Exception) -> bool:
        """The server asked for a new HELLO: say it (see the module docstring). Blocks."""
        self.rejoins += 1
        log.warning("learner %d: rejoining (%s)", self.id, why)
        self.carrier.refused()  # the refused gradient's error-feedback residual goes with it
        return self.start()

    def _load(self, msg: wire.Message) -> None:
        self.ts = self.carrier.load(msg, self.flat.weights)
        self.flat.weights_to_device()

    def step(self, backward) -> bool:
        """``backward()`` fills the gradient; push it and take newer weights. Blocks for the
        reply; False once the server said STOP."""
        backward()
        payloads, fields = self.carrier.gradient(self.flat.grads)
        try:
            reply = self.ps.request(
                Kind.PUSHPULL,
                self.ts,
                payloads,
                numel=self.flat.numel,
                reply_kinds={Kind.WEIGHTS, Kind.UPTODATE},
                **fields,
            )
        except ServerError as exc:
            if exc.code != "rejoin":
                raise
            return self.rejoin(exc)
        if reply.kind == Kind.STOP:
            return False
        if reply.kind == Kind.WEIGHTS:
            self._load(reply)
        return True

    def close(self, finished: bool) -> None:
        """Release the carrier."""
        self.carrier.close()


class BroadcastPush(PushPull):
    """Rudra-adv*: PUSH without waiting; weights by the learners' broadcast."""

    def __init__(self, cfg, learner_id: int, flat, channel, carrier, ctx, bcast):
        super().__init__(cfg, learner_id, flat, channel, carrier)
        self.member = broadcast_member(cfg, ctx, bcast, flat.numel, learner_id)
        self._in_flight = False

    def start(self) -> bool:
        """HELLO, then wait (bounded by runtime.timeout_s) until the first version came down
        the broadcast, so a learner whose upstream is not up yet does not train blind."""
        if not super().start():
            return False
        while self.member.latest_version() is None:
            self.member.check()
            time.sleep(0.01)
        return True

    def step(self, backward) -> bool:
        """Adopt the newest broadcast version, compute, collect the previous push's ACK and
        PUSH this gradient without waiting. Blocks only for that ACK; False after STOP."""
        self.member.check()  # the broadcast I/O thread failed: a silent upstream
        ts, self.ts = self.ts, self.member.copy_latest_into(self.flat.weights, self.ts)
        if self.ts != ts:
            self.flat.weights_to_device()
        grad_ts = self.ts
        backward()
        if self._in_flight:
            self._in_flight = False
            try:
                if self.ps.recv({Kind.ACK}).kind == Kind.STOP:
                    return False
            except ServerError as exc:
                if exc.code != "rejoin":
                    raise
                return self.rejoin(exc)
        payloads, fields = self.carrier.gradient(self.flat.grads)
        self.ps.send(Kind.PUSH, grad_ts, payloads, **fields)
        self._in_flight = True
        return True

    def close(self, finished: bool) -> None:
        """Stop the broadcast member (a learner that leaves passes STOP to its children)."""
        super().close(finished)
        self.member.close(stop_reason="training finished" if finished else None)


def make_exchange(cfg, learner_id: int, flat, channel, ctx, bcast=None):
    """The exchange for ``architecture.kind``: BroadcastPush (advstar) or PushPull."""
    carrier = make_carrier(cfg, learner_id, flat.numel)
    try:
        if cfg.architecture.kind == "advstar":
            return BroadcastPush(cfg, learner_id, flat, channel, carrier, ctx, bcast)
        return PushPull(cfg, learner_id, flat, channel, carrier)
    except BaseException:
        carrier.close()
        raise


def broadcast_member(cfg, ctx, bcast, numel: int, learner_id: int):
    """Learner ``learner_id``'s place in Rudra-adv*'s broadcast, started: ``bcast`` is its
    (upstream, bind) endpoints; its children and upstream come from the run's topology. Raises
    ValueError naming the missing option. Used by the learner and the synthetic learner."""
    from ..broadcast.member import BroadcastMember

    if not bcast or not bcast[0]:
        raise ValueError(
            f"learner {learner_id}: architecture.kind=advstar needs its "
            "broadcast upstream (rudra-zmq learner --bcast-upstream EP)"
        )
    up = topology.broadcast_upstream(cfg, learner_id)
    kids = topology.broadcast_children(cfg, learner_id)
    if kids and not bcast[1]:
        raise ValueError(
            f"learner {learner_id} forwards the broadcast to learners {kids}: "
            "give it an endpoint to bind (--bcast-bind EP)"
        )
    return BroadcastMember(
        ctx,
        bcast[1] if kids else None,
        bcast[0],
        numel,
        member=learner_id,
        children=kids,
        chunk_bytes=cfg.runtime.chunk_mib << 20,
        timeout_s=cfg.runtime.timeout_s,
        upstream_name="the root" if up is None else f"learner {up}",
        dtypes=codec.dtypes(cfg),
    ).start()
