"""The statistics server's progress lines: what a person watching a run reads.

One line per evaluation -- epoch, timestamp, test error and loss, then, over the updates
since the previous line (previous line's ts < update ts <= this one's, as ``summary.csv``
counts them): ⟨σ⟩ of their gradients and samples/s (their gradients times µ, over the time
from the previous line's last update to this line's last update); then the seconds of
training so far and an estimate of the time left (``ETA -`` until one can be made) -- and
one line when training starts, with how long start-up took; and one when λ changes (a learner
evicted or rejoining) or the parameter server restarted.

An evaluation's line waits until the ``update`` records up to its timestamp have arrived (the
PS sends them in batches, every 0.5 s, on another connection than its EVALs), so that what
it says is what the records say; at the end of the run (``flush``) what still waits is
printed with what is known. So the evaluation of the initial weights (ts 0) is printed once
training has started, after the line that says so.

Training starts when the parameter server applies its first update: its first ``update``
record (in a resumed run, the first after the resume), as ``records.TrainingClock`` reads it
back afterwards. Times are seconds of training: ``trained_s`` before this period of the run
(a resumed run's earlier periods) plus the time since this period's first update. The
estimate divides the epochs left by the epoch rate since the first update this server saw.
Pure: no clocks, no I/O; ``t`` values are the records' on the run's clock (seconds since the
run started). Not thread-safe: the statistics server's thread owns it.
"""

from __future__ import annotations

import math

from ..results.records import sigma_sum
from ..wire_kinds import copy_holder_sender


def is_number(x) -> bool:
    """A finite int or float (not a bool): what a record's numeric field must be to count."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def duration(s: float) -> str:
    """``42.1 s``, ``12m05s`` or ``3h07m``: a length of time a person reads at a glance."""
    if s < 60:
        return f"{s:.1f} s"
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


MAX_UPDATES = 2**15  # update records kept apart until their line is printed


class Progress:
    """The progress lines of a run of ``epochs`` epochs, µ = ``batch_size`` samples per
    gradient.

    ``begun``: when this period of the run began on the run's clock (0, or its resume);
    ``started``: when training started in it, for a server restarted after it had (else
    None); ``trained_s``: seconds of training in the run's earlier periods.
    """

    def __init__(
        self,
        epochs: float,
        batch_size: int = 1,
        started: float | None = None,
        *,
        begun: float = 0.0,
        trained_s: float = 0.0,
    ):
        self.epochs = epochs
        self.batch_size = batch_size
        self.started = started
        self.begun = begun
        self.trained_s = trained_s
        self._updates: list[tuple] = []  # (ts, t, Σσ, gradients) not yet on a line
        self._anchor = None  # (ts, t) of the last update on a printed line
        self._upto = -1  # ts of the newest update record
        self._waiting: list[tuple] = []  # evaluations whose line waits for update records
        self._first = self._newest = None  # (t, epoch) of updates seen by this server
        self._since: list[str] = []  # restarts since the last evaluation's line

    def update(self, r: dict) -> list[str]:
        """Take one ``update`` record; returns the lines to print now (that training started,
        evaluations whose updates have all arrived)."""
        t, ts, epoch = r.get("t"), r.get("ts"), r.get("epoch")
        if not is_number(t) or not isinstance(ts, int):
            return []
        s, n = sigma_sum(r)
        self._updates.append((ts, t, s, n))
        if len(self._updates) > MAX_UPDATES:
            self._merge_oldest()
        self._upto = ts
        self._at(t, epoch)
        lines = []
        if self.started is None:
            self.started = t
            lines.append(
                f"training started: the parameter server applied its first update "
                f"after {t - self.begun:.1f} s of start-up"
            )
        return lines + self._due()

    def _merge_oldest(self) -> None:
        """Sum the older half of the updates not yet on a line into one entry (their newest
        ts and t, Σσ and gradient count): memory stays bounded when evaluations are far apart
        or off, and the next line's ⟨σ⟩ stays exact (its samples/s is then measured from the
        end of the merged updates). The newer half stays apart for an evaluation of a
        timestamp among them, arriving late."""
        half = len(self._updates) // 2
        old, self._updates = self._updates[:half], self._updates[half:]
        newest = max(old, key=lambda u: u[1])
        merged = (max(u[0] for u in old), newest[1], sum(u[2] for u in old), sum(u[3] for u in old))
        self._updates.insert(0, merged)

    def members(self, r: dict) -> list[str]:
        """Take one ``members`` record (λ changed); returns its line (which says the file it
        was read from, ``source``, when its record was lost)."""
        late = r.get("source")
        seen = "" if late is None else f" (its record read from {late})"
        return [
            f"λ = {r.get('learners')} learners (learner {r.get('learner')} "
            f"{r.get('event')} at ts {r.get('ts')}), c = {r.get('c')}{seen}"
        ]

    def restart(self, r: dict) -> list[str]:
        """Take one ``restart`` record: a server restarted at ``ts``, from its checkpoint or
        its learners' copy of its range (``from``; the updates past ``ts`` were lost: ``lost``,
        as far as known then); returns its line, and the next evaluation's line says it
        too. Only server 0's restart moves the timestamps these lines count, and not one read
        late from its files (``source``: the updates since came after it)."""
        ts, server, late = r.get("ts"), r.get("server"), r.get("source")
        if isinstance(ts, int) and not server and late is None:
            self._updates = [u for u in self._updates if u[0] <= ts]
            self._upto = min(self._upto, ts)
        who = "parameter server" if server is None else f"server {server}"
        origin = r.get("from")
        if origin is None or origin == "checkpoint":
            origin = f"checkpoint {r.get('checkpoint')}"
        elif copy_holder_sender(origin) is not None:  # a tree node's: a learner's below
            origin = f"{origin}'s copy of its range"
        else:
            origin = "the initial weights (no learner held a copy)"
        lost = r.get("lost")
        said = f": {lost} updates lost" if isinstance(lost, int) and lost > 0 else ""
        self._since.append(f"{who} restarted at ts {ts}{said}")
        seen = "" if late is None else f" (its record read from {late})"
        return [
            f"{who} restarted (incarnation {r.get('incarnation')}) at ts {ts} from {origin}{said}"
            f"{seen}"
        ]

    def _at(self, t: float, epoch) -> None:
        """Training had reached ``epoch`` at ``t``: a point of the epoch rate."""
        if is_number(epoch):
            self._first = self._first or (t, epoch)
            if self._newest is None or t >= self._newest[0]:
                self._newest = (t, epoch)

    def evaluated(self, t: float, ts: int, epoch: float, error: float, loss: float) -> list[str]:
        """Take the evaluation of the weights at ``ts`` that arrived at ``t``; returns the
        lines to print now (its own once the updates up to ``ts`` have arrived)."""
        self._waiting.append((t, ts, epoch, error, loss))
        return self._due()

    def flush(self) -> list[str]:
        """The lines of every evaluation still waiting, with what is known (the run ended)."""
        lines = [self._line(*w) for w in self._waiting]
        self._waiting = []
        return lines

    def _due(self) -> list[str]:
        lines = []
        while self._waiting and self.started is not None and self._waiting[0][1] <= self._upto:
            lines.append(self._line(*self._waiting.pop(0)))
        return lines

    def train_s(self, t: float) -> float:
        """Seconds of training at ``t`` (a time before training started counts as its start)."""
        return (
            self.trained_s + max(t - self.started, 0.0)
            if self.started is not None
            else self.trained_s
        )

    def eta_s(self) -> float | None:
        """Seconds left at the epoch rate seen so far (None until there is one)."""
        if self._first is None or self._newest is None:
            return None
        (t0, e0), (t1, e1) = self._first, self._newest
        if not (t1 > t0 and e1 > e0):
            return None
        return max(self.epochs - e1, 0.0) * (t1 - t0) / (e1 - e0)

    def _line(self, t: float, ts: int, epoch: float, error: float, loss: float) -> str:
        """The line of an evaluation, over the updates since the previous line."""
        mine = [u for u in self._updates if u[0] <= ts]
        self._updates = [u for u in self._updates if u[0] > ts]
        count = sum(u[3] for u in mine)
        sigma = f"{sum(u[2] for u in mine) / count:.2f}" if count else "-"
        rate = "-"
        if mine:
            anchor = self._anchor or mine[0][:2]  # the first interval: from the first update
            grads = sum(u[3] for u in mine if u[0] > anchor[0])
            last = max(mine, key=lambda u: u[1])
            if last[1] > anchor[1]:
                rate = f"{grads * self.batch_size / (last[1] - anchor[1]):.0f}"
            self._anchor = last[:2]
        elapsed = "-" if self.started is None else duration(self.train_s(t))
        if self._first is not None:  # the EVAL left the PS with the update that reached epoch
            self._at(t, epoch)
        eta = self.eta_s()
        since = f"  ({'; '.join(self._since)})" if self._since else ""
        self._since = []
        return (
            f"epoch {epoch:6.2f}  ts {ts:6d}  test error {100 * error:5.2f}%  loss "
            f"{loss:.4f}  <σ> {sigma}  samples/s {rate}  elapsed {elapsed}  "
            f"ETA {'-' if eta is None else duration(eta)}{since}"
        )
