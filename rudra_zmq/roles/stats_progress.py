"""The statistics server's progress lines: what a person watching a run reads.

One line per evaluation -- epoch, timestamp, test error and loss, ⟨σ⟩ of the gradients since
the previous line, the learners' samples/s, the time since training started and an estimate of
the time left (``ETA -`` until one can be made) -- and one line when training starts, with how
long start-up took.

Training starts when the parameter server applies its first update: its first ``update``
record, as ``plots.startup_s`` reads it back afterwards. The estimate divides the epochs left by
the rate of epochs between the first update this server saw and the newest update or
evaluation. Pure: no clocks,
no I/O; times are the records' ``t`` on the run's clock (seconds since the run started). Not
thread-safe: the statistics server's thread owns it.
"""
from __future__ import annotations

import math


def is_number(x) -> bool:
    """A finite int or float (not a bool): what a record's numeric field must be to count."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def duration(s: float) -> str:
    """``42.1 s``, ``12m05s`` or ``3h07m``: a length of time a person reads at a glance."""
    if s < 60:
        return f"{s:.1f} s"
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """The progress lines of a run of ``epochs`` epochs; ``started``: the run-clock time at
    which training started, when this server is restarted in a run that had (else None)."""

    def __init__(self, epochs: float, started: float | None = None):
        self.epochs = epochs
        self.started = started
        self._sigma = [0.0, 0]        # Σσ and gradients since the previous eval line
        self._last_sigma = "-"        # as last printed
        self._rates: dict = {}        # learner -> its latest samples/s
        self._first = self._newest = None   # (t, epoch) of updates seen by this server

    def update(self, r: dict) -> str | None:
        """Take one ``update`` record; returns the line to print when it started training."""
        t, epoch, mean, n = r.get("t"), r.get("epoch"), r.get("mean_sigma"), r.get("n_grads")
        if is_number(mean):   # weighted by gradients, as summary.csv's mean_sigma
            n = n if is_number(n) and n >= 1 else 1
            self._sigma[0] += mean * n
            self._sigma[1] += n
        if not is_number(t):
            return None
        self._at(t, epoch)
        if self.started is not None:
            return None
        self.started = t
        return (f"training started: the parameter server applied its first update after "
                f"{t:.1f} s of start-up")

    def _at(self, t: float, epoch) -> None:
        """Training had reached ``epoch`` at ``t``: a point of the epoch rate."""
        if is_number(epoch):
            self._first = self._first or (t, epoch)
            if self._newest is None or t >= self._newest[0]:
                self._newest = (t, epoch)

    def learner(self, r: dict) -> None:
        """Take one ``learner`` record (its samples/s)."""
        if is_number(r.get("samples_per_s")):
            self._rates[r.get("learner")] = r["samples_per_s"]

    def eta_s(self) -> float | None:
        """Seconds left at the epoch rate seen so far (None until there is one)."""
        if self._first is None or self._newest is None:
            return None
        (t0, e0), (t1, e1) = self._first, self._newest
        if not (t1 > t0 and e1 > e0):
            return None
        return max(self.epochs - e1, 0.0) * (t1 - t0) / (e1 - e0)

    def eval_line(self, t: float, ts: int, epoch: float, error: float, loss: float) -> str:
        """The line of an evaluation of the weights at ``ts`` that arrived at ``t``."""
        # Update records come in batches (every 0.5 s from the PS) and may trail the EVAL:
        # with none new since the last line, repeat the last value; "-" = nothing known yet.
        if self._sigma[1]:
            self._last_sigma = f"{self._sigma[0] / self._sigma[1]:.2f}"
            self._sigma = [0.0, 0]
        rate = f"{sum(self._rates.values()):.0f}" if self._rates else "-"
        elapsed = "-" if self.started is None else duration(max(t - self.started, 0.0))
        if self._first is not None:   # the EVAL left the PS with the update that reached epoch
            self._at(t, epoch)
        eta = self.eta_s()
        return (f"epoch {epoch:6.2f}  ts {ts:6d}  test error {100 * error:5.2f}%  loss "
                f"{loss:.4f}  <σ> {self._last_sigma}  samples/s {rate}  elapsed {elapsed}  "
                f"ETA {'-' if eta is None else duration(eta)}")
