"""A hardsync round whose gradients and weights travel in parts (``wire.parts`` > 1).

Each learner sends its gradient of a server's range as P messages in order (PUSHPULL x{at,
more}, one sequence number). Part i is complete once every member's part i is in: the server
then updates those elements into the next version at once and sends each member that part
(WEIGHTS x{at, more}) while later parts are still arriving, so both directions of every link
carry data. The update the sync engine decides (the last member's last part) steps the parts
still open and publishes the version; each member's reply then carries only the elements it
was not sent ahead (x{at}).

Exactness: per element the arithmetic is the whole update's (the same sum, rate, momentum and
decay). A part holds one copy per learner per round; a learner's part that comes after its
part was stepped (a learner that rejoined mid-round) is dropped and counted. A learner that
leaves mid-round keeps the parts it sent in the sum, as a whole gradient does; each part is
averaged over the learners in it. The parts stepped ahead use the rate of the update that
completes the round with every member (``SyncEngine.next_lr``).

This module keeps the bookkeeping only (pure: no sockets, no arithmetic); ``ServerState``
drives it with the updater. Not thread-safe: owned by the server's thread.
"""

from __future__ import annotations

from ..span import part_bounds
from ..sync import ProtocolViolation


class PartRound:
    """Who sent which part this round, which parts were stepped, what went ahead to whom.

    Args:
        numel: the floats of the server's range.
        parts: ``wire.parts`` (fewer when the range is smaller: ``span.part_bounds``).
    """

    def __init__(self, numel: int, parts: int):
        self.bounds = part_bounds(numel, parts)
        self.parts = len(self.bounds) - 1
        self._index = {lo: i for i, lo in enumerate(self.bounds[:-1])}
        self.dropped = 0  # parts not counted: sent after their part was stepped
        self.tails: dict[int, tuple[int, int]] = {}  # sender -> (timestamp, offset) ahead
        self.reset()

    def reset(self) -> None:
        """A new round: nothing in, nothing stepped."""
        self.contrib = [set() for _ in range(self.parts)]
        self.stepped = [False] * self.parts
        self.requests: dict[int, list[int]] = {}  # sender -> [seq, next part expected]
        self.sent: dict[int, int] = {}  # sender -> end of the weights sent ahead to it
        self.lr: float | None = None  # the rate the parts stepped ahead used

    def index(self, sender: int, at: int, count: int, more: bool) -> int:
        """The part a message with x{at, more} and ``count`` floats is; raises
        ProtocolViolation unless it is exactly one of this server's parts. Pure."""
        i = self._index.get(at)
        ok = i is not None and self.bounds[i + 1] - at == count and more == (i < self.parts - 1)
        if not ok:
            raise ProtocolViolation(
                f"learner {sender} sent a part of {count:,} floats at {at:,}"
                f"{' (more to come)' if more else ''}; this server cuts its range into "
                f"{self.parts} parts at {self.bounds[:4]}...: is the learner running "
                "another wire.parts?"
            )
        return i

    def arrive(self, sender: int, seq: int, i: int) -> str:
        """Part ``i`` of request ``seq`` from ``sender``: ``"add"`` (sum it), ``"drop"`` (its
        part was stepped, or this learner's copy of it is in already), ``"copy"`` (a resend
        of a part already taken) or ``"gap"`` (an earlier part of the request is missing: the
        request is sent again whole). The caller sums an ``"add"``."""
        req = self.requests.get(sender)
        if req is None or req[0] != seq:
            if i != 0:
                return "gap"
            req = self.requests[sender] = [seq, 0]
        if i < req[1]:
            return "copy"
        if i > req[1]:
            return "gap"
        req[1] = i + 1
        if self.stepped[i] or sender in self.contrib[i]:
            self.dropped += 1
            return "drop"
        self.contrib[i].add(sender)
        return "add"

    def complete(self, members) -> list[int]:
        """The parts not yet stepped that every one of ``members`` has sent. Pure."""
        members = set(members)
        return [
            i
            for i in range(self.parts)
            if not self.stepped[i] and members and members <= self.contrib[i]
        ]

    def g_scale(self, i: int, default: float) -> float:
        """1/(learners in part i): the part's mean (``default`` for a part nobody sent)."""
        return 1.0 / len(self.contrib[i]) if self.contrib[i] else default

    def ahead_to(self, i: int, members) -> list[tuple[int, int]]:
        """(sender, seq) of the members to send stepped part ``i`` ahead: those whose
        request is open and that have every part before it; marks it sent to them."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        out = []
        for sender in sorted(members):
            req = self.requests.get(sender)
            if req is not None and self.sent.get(sender, 0) == lo:
                self.sent[sender] = hi
                out.append((sender, req[0]))
        return out

    def finished(self, timestamp: int) -> None:
        """The round's update made version ``timestamp``: remember what went ahead (for the
        replies), and start a new round."""
        self.tails = {s: (timestamp, end) for s, end in self.sent.items() if end > 0}
        self.reset()

    def tail(self, sender: int, timestamp: int) -> int:
        """Where ``sender``'s reply with version ``timestamp`` starts: past what went ahead
        to it (0: the whole range). Forgets it: a reply goes once."""
        ts, end = self.tails.pop(sender, (None, 0))
        return end if ts == timestamp else 0


class PartedUpdates:
    """A server's updates made part by part: a :class:`PartRound` driven with the server's
    ``updater`` (``update.Updater``) and sync ``engine``. Not thread-safe."""

    def __init__(self, updater, engine, parts: int):
        self.updater, self.engine = updater, engine
        self.round = PartRound(updater.numel, parts)
        self.rate_changed = 0  # rounds whose update's rate differed from the parts' ahead
        self.stepped_ahead = 0  # parts stepped before their round's update

    def record(self) -> dict:
        """What ``ps_final.json`` says of the parts (``docs/wire.md``). Pure."""
        return {
            "parts": self.round.parts,
            "stepped_ahead": self.stepped_ahead,
            "dropped": self.round.dropped,
            "rate_changed": self.rate_changed,
        }

    @property
    def open(self) -> bool:
        """Whether a part of this round is in the sum (not a state to checkpoint: the parts'
        senders are not saved, and they send them again after a restart)."""
        return any(self.round.contrib)

    def take(self, sender: int, seq: int, at: int, payloads, more: bool, count: int) -> bool:
        """Sum one part of ``count`` floats (checked against this server's parts first:
        ProtocolViolation, with nothing changed); True if it was the request's last part with
        all before it in."""
        i = self.round.index(sender, at, count, more)
        what = self.round.arrive(sender, seq, i)
        if what == "add":
            self.updater.add_at(at, payloads)
        return not more and what in ("add", "drop")

    def ahead(self) -> list[tuple[int, object]]:
        """Step the parts every member has sent; returns (offset, the new weights there)
        for each, to be sent ahead to the members (``round.ahead_to``)."""
        members = self.engine.members
        out = []
        for i in self.round.complete(members):
            if self.round.lr is None:
                self.round.lr = self.engine.next_lr()
            lo, hi = self.round.bounds[i], self.round.bounds[i + 1]
            g = self.round.g_scale(i, 1.0 / max(len(members), 1))
            out.append((i, self.updater.step_part(lo, hi, g, self.round.lr)))
            self.round.stepped[i] = True
            self.stepped_ahead += 1
        return out

    def finish(self, update) -> None:
        """The engine's ``update`` closes the round: step the parts still open at its rate
        and publish the version."""
        r = self.round
        for i in range(r.parts):
            if not r.stepped[i]:
                g = r.g_scale(i, update.g_scale)
                self.updater.step_part(r.bounds[i], r.bounds[i + 1], g, update.lr)
        self.updater.publish_parts()
        if r.lr is not None and r.lr != update.lr:
            self.rate_changed += 1  # a member left or joined at a step of the schedule
        r.finished(update.timestamp)
