"""Gradients pushed in parts: the parameter server's side of GPART sequences.

A learner with a large model pushes its gradient as GPART messages followed by a PUSH or
PUSHPULL x{parts: k} that carries the rest (``wire.py``; ``runtime.stream_parts``). The
server keeps one :class:`PartAssembly` per learner with a sequence in progress and checks
every part as it arrives (same timestamp, contiguous offsets from 0, the final message ending
exactly at the model size, the same pull intent). Two ways to apply the gradient:

- **cut-through**, when this gradient alone makes the next update (c = 1: async, or one
  learner) and the run is not about to end: on the first part the server asks a *copy* of
  the sync engine what the update will be (its timestamp and learning rate), then computes
  each part of the new weights and the new momentum into spare buffers as the part arrives
  (``Updater.step_part``) and streams each weight part back at once (WPART). ZeroMQ moves
  part k+1 in, and part k of the weights out, while the kernel runs on part k. Until the
  final message has passed its checks nothing the server holds changes: the real engine is
  fed and the buffers adopted only then; a bad or missing part drops them, leaving weights,
  momentum and timestamps bit-identical. While a cut-through update is open, every message
  from any other sender is held and handled afterwards in arrival order, so the engine's
  decision stays the one that applies.
- **store-and-forward** otherwise (softsync with c > 1, hardsync, the final update, or a
  cut-through already open): the parts' frames are kept as received (no copy) and the whole
  gradient is handled as one PUSH/PUSHPULL when its final message arrives.

A sequence that stops for ``PART_GAP_S`` (a learner died mid-gradient) is dropped with an
ERROR. Used as a mixin of ``ParameterServer`` (``roles/ps.py``): not thread-safe, runs on the
server's thread.
"""
from __future__ import annotations

import collections
import copy
import time
from dataclasses import dataclass

import numpy as np

from .. import wire
from ..sync import ProtocolViolation, Update
from ..wire import Kind

# A learner sends all its parts back to back; a gap this long means it is gone. Held
# messages of other learners wait at most this long behind an abandoned cut-through.
PART_GAP_S = 10.0


@dataclass
class CutThrough:
    """An update computed part by part: the engine's decision and the spare buffers."""

    update: Update
    g_scale: float
    out: np.ndarray
    v_out: np.ndarray


class PartAssembly:
    """One learner's gradient in parts, checked as it arrives."""

    def __init__(self, ident: bytes, first: wire.Message):
        self.ident = ident
        self.sender, self.ts, self.pull = first.sender, first.ts, first.fields["pull"]
        self.payloads: list[np.ndarray] = []
        self.offset = 0          # floats received so far (where the next part starts)
        self.count = 0           # GPART messages received
        self.cut: CutThrough | None = None
        self.touched = time.monotonic()

    def take(self, msg: wire.Message, numel: int) -> int:
        """Check that ``msg`` continues this sequence and keep its payload; returns the offset
        it starts at. Raises ProtocolViolation naming the mismatch."""
        who = wire.sender_name(self.sender)
        if msg.ts != self.ts:
            raise ProtocolViolation(f"{who}: a part of its gradient has timestamp {msg.ts}, the "
                                    f"first part {self.ts}")
        if msg.kind == Kind.GPART:
            if msg.fields["offset"] != self.offset or msg.fields["pull"] != self.pull:
                raise ProtocolViolation(
                    f"{who}: gradient part at offset {msg.fields['offset']:,} (pull="
                    f"{msg.fields['pull']}) does not continue the parts received (next offset "
                    f"{self.offset:,}, pull={self.pull})")
            if self.count >= wire.MAX_PARTS:
                raise ProtocolViolation(f"{who}: more than {wire.MAX_PARTS} gradient parts")
            self.count += 1
        else:
            if msg.fields["parts"] != self.count or (msg.kind == Kind.PUSHPULL) != self.pull:
                raise ProtocolViolation(
                    f"{who}: {msg.kind.name} x{{parts: {msg.fields['parts']}}} ends a sequence "
                    f"of {self.count} gradient parts (pull={self.pull})")
            if self.offset + msg.payload_numel != numel:
                raise ProtocolViolation(
                    f"{who}: its gradient parts add up to {self.offset + msg.payload_numel:,} "
                    f"floats; the model has {numel:,}")
        lo = self.offset
        self.offset += msg.payload_numel
        self.payloads.extend(msg.payloads)
        self.touched = time.monotonic()
        return lo


class PushPartsMixin:
    """ParameterServer methods for GPART sequences. Expects the server's ``engine``,
    ``updater``, ``numel``, ``chunk_bytes``, ``cfg``, ``tree``, ``broadcast``, ``done``,
    ``_send`` and ``_after_update``; call ``_init_parts`` from ``__init__``."""

    def _init_parts(self) -> None:
        self._parts: dict[int, PartAssembly] = {}
        self._discard: set[int] = set()     # senders whose refused sequence is still arriving
        self._cut: PartAssembly | None = None
        self._held: collections.deque = collections.deque()   # (ident, msg) behind a cut
        self.gradients_in_parts = 0         # sequences completed (reported in "ps" metrics)
        self.cut_through_updates = 0        # of which were applied cut-through

    def _holds(self, msg: wire.Message) -> bool:
        """Whether ``msg`` must wait for the open cut-through update (another sender's)."""
        return self._cut is not None and msg.sender != self._cut.sender

    def _part(self, ident: bytes, msg: wire.Message) -> wire.Message | None:
        """Take one message of a gradient in parts. Returns the whole gradient as one
        PUSH/PUSHPULL message when store-and-forward completes it, else None (a part taken, a
        cut-through update committed and answered, or the rest of a refused sequence
        dropped). Raises ProtocolViolation (the sequence dropped, nothing changed)."""
        sender = msg.sender
        a = self._parts.get(sender)
        try:
            if a is None:
                if sender in self._discard:   # the rest of a sequence already refused...
                    starts = msg.kind == Kind.GPART and msg.fields["offset"] == 0
                    if starts or msg.kind != Kind.GPART:   # ...ends here, or a new one starts
                        self._discard.discard(sender)
                    if not starts:
                        return None
                if msg.kind != Kind.GPART or msg.fields["offset"] != 0:
                    raise ProtocolViolation(
                        f"{wire.sender_name(sender)}: {msg.kind.name} is not the first part of "
                        "a gradient in parts (GPART at offset 0)")
                self.engine.check(sender, msg.ts)   # refuse early what the engine would refuse
                a = self._parts[sender] = PartAssembly(ident, msg)
                self._maybe_cut(a)
            elif not (msg.kind == Kind.GPART or msg.fields.get("parts")):
                raise ProtocolViolation(f"{wire.sender_name(sender)} sent {msg.kind.name} in the "
                                        "middle of a gradient in parts")
            lo = a.take(msg, self.numel)
            if a.cut is not None:
                self._cut_part(a, lo, msg)
        except ProtocolViolation:
            self._drop_parts(sender)
            if msg.kind == Kind.GPART:
                self._discard.add(sender)
            raise
        if msg.kind == Kind.GPART:
            return None
        del self._parts[sender]
        self.gradients_in_parts += 1
        if a.cut is not None:
            self._cut_commit(a, lo)
            return None
        fields = {k: v for k, v in msg.fields.items() if k != "parts"}
        return wire.Message(msg.kind, sender, msg.seq, msg.ts, msg.inc, fields, a.payloads)

    def _maybe_cut(self, a: PartAssembly) -> None:
        e = self.engine
        if (self._cut is not None or self.broadcast is not None or self.tree is not None
                or self.done or e.pending or e.gradients_per_update != 1):
            return
        trial = copy.deepcopy(e)      # what receive() will decide, without changing e
        arrival = trial.receive(a.sender, a.ts)
        u = arrival.update
        if u is None or u.epoch >= self.cfg.train.epochs:   # the final update answers STOP
            return
        out, v_out = self.updater.begin_parts()
        a.cut = CutThrough(u, u.g_scale * arrival.scale, out, v_out)
        self._cut = a

    def _cut_part(self, a: PartAssembly, lo: int, msg: wire.Message) -> None:
        c, off = a.cut, lo
        for piece in msg.payloads:
            self.updater.step_part(piece, off, c.out, c.v_out, c.g_scale, c.update.lr)
            off += piece.shape[0]
        if a.pull and msg.kind == Kind.GPART:
            self._send(a.ident, Kind.WPART, [c.out[lo:off]], at_ts=c.update.timestamp,
                       offset=lo)

    def _cut_commit(self, a: PartAssembly, lo: int) -> None:
        """Every part arrived and passed (the last one starts at ``lo``): feed the engine,
        adopt the buffers, answer."""
        c = a.cut
        arrival = self.engine.receive(a.sender, a.ts)
        u = arrival.update
        if u is None or (u.timestamp, u.lr, u.g_scale * arrival.scale) != (
                c.update.timestamp, c.update.lr, c.g_scale):
            raise RuntimeError(f"internal error: the sync engine decided {u} for a cut-through "
                               f"update computed as {c.update}")
        self.updater.commit_parts(c.out, c.v_out)
        self._cut = None
        self.cut_through_updates += 1
        if a.pull:
            self._send(a.ident, Kind.WEIGHTS, wire.chunk(self.w[lo:], self.chunk_bytes),
                       parts=a.count, sigma=arrival.sigma)
        else:
            self._send(a.ident, Kind.ACK, sigma=arrival.sigma)
        self._after_update(u)

    def _drop_parts(self, sender: int) -> None:
        """Forget ``sender``'s sequence: the one in progress (dropping its cut-through update)
        and any refused one whose rest is still to be discarded."""
        self._discard.discard(sender)
        a = self._parts.pop(sender, None)
        if a is not None and a.cut is not None:
            self.updater.abort_parts(a.cut.out)
            self._cut = None

    def _expire_parts(self) -> None:
        """Drop sequences that stalled for PART_GAP_S (answered ERROR), then go on with the
        messages a dropped cut-through held. Call regularly from the serving loop."""
        if not self._parts:
            return
        gap = min(PART_GAP_S, self.cfg.runtime.timeout_s)
        now = time.monotonic()
        for sender, a in list(self._parts.items()):
            if now - a.touched > gap:
                self._drop_parts(sender)
                self._discard.add(sender)
                self._refuse(a.ident, sender, "parts_timeout",
                             f"{wire.sender_name(sender)}: no part of its gradient for "
                             f"{gap:g} s after {a.count} parts; the gradient is dropped")
        self._release_held()

    def _release_held(self) -> None:
        """Handle the messages held behind a cut-through update, in arrival order; a held
        message may open another cut-through, behind which the rest are held again (per
        sender, order is kept)."""
        pending, self._held = self._held, collections.deque()
        while pending:
            ident, msg = pending.popleft()
            if self._holds(msg):
                self._held.append((ident, msg))
                continue
            self._dispatch(ident, msg)
            if self._cut is None and self._held:   # re-held ones are older than the rest
                self._held.extend(pending)
                pending, self._held = self._held, collections.deque()
