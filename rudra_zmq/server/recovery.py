"""A server restarted without a usable checkpoint of its range takes the range back from the
freshest copy its learners hold, instead of starting it over (docs/fault-tolerance.md, "A
server restarted without a checkpoint").

Every learner holds the whole vector at the timestamp of the last weights it loaded from each
server. Rejoining, it says HELLO with that timestamp (x{had}), its next data step (x{step}) and
its copy of the server's range (float32 payloads, the range's size: checked by ``wire.decode``
like any payload). The restarted server holds every HELLO (no WELCOME yet) until each of the
run's λ learners said one, or ``window_s`` after the first came; then it resumes at the newest
copy's timestamp (momentum zero: no learner holds it), each learner's data where it says, and
welcomes them all. A copy with a value that is not finite, or a timestamp or step out of range,
is refused (not used; the learner is still welcomed). With no copy at all (every learner
restarted too), the range starts from the initial weights, as before, and says so.

The updates lost are those the freshest copy had not seen: the newest ``had`` any learner
reports minus the timestamp resumed at (at most the freshest learner's staleness).

Pure: no sockets, no clock of its own (``now`` is given); not thread-safe (the server's thread).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import wire

MAX_TS = 2**53  # a timestamp or step a learner reports beyond this is refused


@dataclass
class Held:
    """A HELLO held while the server recovers: its connection, sender and seq."""

    ident: bytes
    sender: int
    seq: int


@dataclass
class Recovered:
    """What the learners gave back: ``weights`` (None: no copy, start from the initial ones),
    the timestamp ``ts`` they are at, from learner ``source``; each learner's data ``steps``;
    ``newest`` the newest timestamp any learner saw from the dead incarnation (-1: none);
    ``refused`` (learner, why) for each copy not used."""

    weights: np.ndarray | None
    ts: int
    source: int | None
    steps: dict
    newest: int
    refused: list = field(default_factory=list)

    @property
    def lost(self) -> int:
        """Updates lost in the restart: those the freshest copy had not seen."""
        return max(0, self.newest - self.ts)

    @property
    def origin(self) -> str:
        """Where the range came from: ``learner L``, ``tree node N`` or ``initial``."""
        return "initial" if self.source is None else wire.sender_name(self.source)


class Recovery:
    """The HELLOs and copies of a server recovering its range of ``numel`` floats, for a run of
    ``learners`` learners; done once every one said HELLO, or ``window_s`` after the first."""

    def __init__(self, learners: int, numel: int, window_s: float):
        self.learners, self.numel, self.window_s = learners, numel, window_s
        self.held: list[Held] = []
        self.heard: set[int] = set()
        self.first_at: float | None = None
        self._best: tuple[int, int, np.ndarray] | None = None  # (ts, learner, copy)
        self._steps: dict[int, int] = {}
        self._newest = -1
        self.refused: list[tuple[int, str]] = []

    def offer(self, ident: bytes, msg: wire.Message, now: float) -> None:
        """Hold learner ``msg.sender``'s HELLO (registered already), taking its copy if it is
        the freshest so far and sound."""
        sender, f = msg.sender, msg.fields
        if self.first_at is None:
            self.first_at = now
        self.held = [h for h in self.held if h.sender != sender]  # its newest HELLO stands
        self.held.append(Held(ident, sender, msg.seq))
        self.heard.add(sender)
        had, step = f.get("had", -1), f.get("step")
        why = None
        if not -1 <= had < MAX_TS:
            why = f"timestamp {had} out of range"
        elif step is not None and not 0 <= step < MAX_TS:
            why = f"data step {step} out of range"
        if why is not None:
            self.refused.append((sender, why))
            return
        self._newest = max(self._newest, had)
        if step is not None and sender >= 0:  # (a tree node's HELLO carries no step)
            self._steps[sender] = step
        if not msg.payloads or had < 0:
            return
        if self._best is not None and self._best[0] >= had:
            return  # not fresher than the one kept (copied only when it is)
        copy = np.empty(self.numel, np.float32)
        at = 0
        for p in msg.payloads:  # float32, the range's size: wire.decode checked both
            copy[at : at + p.shape[0]] = p
            at += p.shape[0]
        if at != self.numel or not np.isfinite(copy).all():
            self.refused.append((sender, "its copy holds values that are not finite"))
            return
        self._best = (had, sender, copy)

    def due(self, now: float) -> bool:
        """Whether to resume now: every learner said HELLO, or the window since the first
        one passed."""
        if len(self.heard) >= self.learners:
            return True
        return self.first_at is not None and now - self.first_at >= self.window_s

    def result(self) -> Recovered:
        """The copy to resume from (the freshest sound one), or none."""
        if self._best is None:
            return Recovered(None, 0, None, dict(self._steps), self._newest, list(self.refused))
        ts, source, copy = self._best
        return Recovered(copy, ts, source, dict(self._steps), self._newest, list(self.refused))
