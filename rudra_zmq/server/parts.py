"""A hardsync round whose gradients and weights travel in parts (``wire.parts`` > 1).

Each learner sends its gradient of a server's range as P messages (PUSHPULL x{at, more}, one
sequence number) in any order: as its backward pass completes them, the last layers' first
(``learner/buckets.py``). Part i is complete once every member's part i is in: the server
then updates those elements into the next version at once and sends each member that part
(WEIGHTS x{at, more}) while other parts are still arriving, so both directions of every link
carry data. The update the sync engine decides (the last member's last part) steps the parts
still open and publishes the version; each member's reply then carries only the elements it
was not sent ahead (x{at}: one contiguous run of parts, else the whole range).

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

from ..shape import part_bounds
from ..sync import ProtocolViolation


class PartRound:
    """Who sent which part this round, which parts were stepped, what went ahead to whom.

    Args:
        numel: the floats of the server's range.
        parts: ``wire.parts`` (fewer when the range is smaller: ``shape.part_bounds``).
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
        self.requests: dict[int, tuple[int, set]] = {}  # sender -> (seq, its parts in)
        self.sent: dict[int, set] = {}  # sender -> the parts whose weights went ahead to it
        self.lr: float | None = None  # the rate the parts stepped ahead used

    def index(self, sender: int, at: int, count: int, more: bool) -> int:
        """The part a message with x{at, more} and ``count`` floats is; raises
        ProtocolViolation unless it is exactly one of this server's parts. Pure."""
        i = self._index.get(at)
        if i is None or self.bounds[i + 1] - at != count:
            raise ProtocolViolation(
                f"learner {sender} sent a part of {count:,} floats at {at:,}"
                f"{' (more to come)' if more else ''}; this server cuts its range into "
                f"{self.parts} parts at {self.bounds[:4]}...: is the learner running "
                "another wire.parts?"
            )
        return i

    def arrive(self, sender: int, seq: int, i: int) -> str:
        """Part ``i`` of request ``seq`` from ``sender``: ``"add"`` (sum it), ``"drop"`` (its
        part was stepped, or this learner's copy of it is in already) or ``"copy"`` (a resend
        of a part already taken). The caller sums an ``"add"``. A part lost on the way leaves
        the request open: the learner asks (CHECK) and sends it again whole."""
        req = self.requests.get(sender)
        if req is None or req[0] != seq:
            req = self.requests[sender] = (seq, set())
        if i in req[1]:
            return "copy"
        req[1].add(i)
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

    def has_all(self, sender: int, seq: int) -> bool:
        """Whether every part of ``sender``'s request ``seq`` is in. Pure."""
        req = self.requests.get(sender)
        return req is not None and req[0] == seq and len(req[1]) == self.parts

    def ahead_to(self, i: int, members) -> list[tuple[int, int]]:
        """(sender, seq) of the members to send stepped part ``i`` ahead: those whose
        request is open; marks it sent to them."""
        out = []
        for sender in sorted(members):
            req = self.requests.get(sender)
            if req is not None:
                self.sent.setdefault(sender, set()).add(i)
                out.append((sender, req[0]))
        return out

    def finished(self, timestamp: int) -> None:
        """The round's update made version ``timestamp``: remember what went ahead (for the
        replies), and start a new round."""
        self.tails = {s: (timestamp, self._rest(sent)) for s, sent in self.sent.items() if sent}
        self.reset()

    def _rest(self, sent: set) -> tuple[int, int]:
        """The run of elements [lo, hi) not in the parts ``sent``: (0, end) for the whole
        range when they are not one contiguous run. Pure."""
        rest = [i for i in range(self.parts) if i not in sent]
        if not rest:
            return (self.bounds[-1], self.bounds[-1])
        if rest[-1] - rest[0] + 1 != len(rest):
            return (0, self.bounds[-1])
        return (self.bounds[rest[0]], self.bounds[rest[-1] + 1])

    def tail(self, sender: int, timestamp: int) -> tuple[int, int]:
        """The elements [lo, hi) ``sender``'s reply with version ``timestamp`` carries: what
        did not go ahead to it ((0, end): the whole range). Forgets it: a reply goes once."""
        ts, rest = self.tails.pop(sender, (None, (0, self.bounds[-1])))
        return rest if ts == timestamp else (0, self.bounds[-1])


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
        ProtocolViolation, with nothing changed); True if it completed the request (every
        part in, in whatever order they came)."""
        i = self.round.index(sender, at, count, more)
        what = self.round.arrive(sender, seq, i)
        if what == "add":
            self.updater.add_at(at, payloads)
        return what in ("add", "drop") and self.round.has_all(sender, seq)

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
