"""How the bytes of a learner's pushes travel to the first hop, and how replies come back into
the model: one carrier per server's range, chosen once at start (:func:`make_carrier`).

- :class:`Frames`: ZeroMQ payload frames in the run's payload codec (``codec.py``; float32
  views, zero-copy). Written again only after the reply to the push that carried them
  (advstar: copied into a send buffer first, since the next backward pass starts before that
  reply). Parts pushed during backward (``buckets.py``) are made before the gradient is
  final and filled as backward finishes each (``share_parts_later``: a half codec narrows
  each part then). Weights are decoded into the model's buffer: the one copy a load makes.
- :class:`SharedSlots` (``architecture.leaf_shm``): two gradient slots in /dev/shm that the
  leaf maps (alternating), and the leaf's weight board; the push names its slot and carries
  no payload. Falls back to frames if the leaf declines or anything about shared memory fails.

Not thread-safe: one learner thread owns its carriers.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import codec, kernels, shm, topology, wire

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

    @property
    def views(self) -> bool:
        """Whether a push's payloads are views of the gradient, read only when sent (float32,
        no send buffer). Pure."""
        return self._sendbuf is None and not self.codec.copies

    @property
    def streams(self) -> bool:
        """Whether a push's parts can be made before backward has filled the gradient and
        each filled as backward finishes it (:meth:`share_parts_later`): float32 views, or a
        half codec narrowing part by part; not through a send buffer. Pure."""
        return self._sendbuf is None

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
        """The push's (offset, payloads) per part (``wire.parts``; ``shape.part_bounds``),
        encoded as ``gradient`` does, once for the whole."""
        return codec.encode_parts(self.codec, grads, bounds, self.chunk_bytes)

    def share_parts(self, grads: np.ndarray, server) -> list[tuple]:
        """The push's (offset, payloads) per part of ``server`` (``shape.Server``: its parts,
        each a contiguous piece of the flat vector with its offset ``at`` in the server's
        share) from the model's whole flat gradient ``grads``: float32 views of each part in
        place (a striped share needs no copy); a half codec narrows the share, gathered (a
        copy for stripes), in one pass (``parts``)."""
        if self.views:
            return [(p.at, wire.chunk(grads[p.lo : p.hi], self.chunk_bytes)) for p in server.parts]
        return self.parts(server.share.gather(grads), server.bounds)

    def share_parts_later(self, grads: np.ndarray, server) -> list[tuple]:
        """As :meth:`share_parts`, made before backward has finished ``grads``: the push's
        (offset, payloads, fill) per part of ``server``; calling ``fill()`` once the part's
        floats are final makes its payloads hold them (float32: the views themselves, nothing
        to do; a half codec: narrows that part alone with its slice of the error-feedback
        residual, the bits :meth:`share_parts` would give after backward). Only where
        :attr:`streams`. Does not block; allocates a half codec's buffer."""
        pieces = [(p.at, grads[p.lo : p.hi]) for p in server.parts]
        return self.codec.parts_later(pieces, server.share.numel, self.chunk_bytes)

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
