"""``RUN/metrics.jsonl`` as the statistics server writes it: one strict JSON line per record,
flushed at least every ``FLUSH_S``. A ``start`` record opens the file with the run's clock
(``{"type": "start", "t": 0, "unix": ...}``); a statistics server restarted in the run reads it
back, with where the run's training time stands (``records.TrainingClock``), and goes on with
them. The record types are listed in ``rudra_zmq.results.plots``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..results.records import Metrics, TrainingClock, read_metrics
from .progress import is_number

FLUSH_S = 0.5  # metrics.jsonl is flushed at least this often


class MetricsFile:
    """The metrics file at ``path``, opened for appending (a ``start`` record first in a new
    one; a ``resume`` record with ``resume``).

    ``t0``: the run's start (Unix time): the given one, else the existing file's, else ``now``
    (default: the time of the call). On the run's clock, from the existing file: ``begun``,
    when this period of the run began (0, or its resume); ``started``, when training started
    in it (None if it had not); ``trained_s``, seconds of training in the earlier periods;
    ``kept``, the ``restart`` and ``members`` records it holds (each is written once:
    ``stats/missed_records.py``). Not thread-safe; ``close()`` when done.
    """

    def __init__(
        self, path, t0: float | None = None, *, now: float | None = None, resume: bool = False
    ):
        self.path = Path(path)
        start, earlier = earlier_records(self.path)
        clock = TrainingClock(earlier) if earlier is not None else None
        self.kept = [*earlier["restart"], *earlier["members"]] if earlier is not None else []
        self.t0 = (
            float(t0)
            if t0 is not None
            else start
            if start is not None
            else time.time()
            if now is None
            else now
        )
        self.begun, self.started, self.trained_s = 0.0, None, 0.0
        if clock is not None:
            last = clock.periods[-1]
            self.begun, self.started = last.begin, last.start
            self.trained_s = clock.trained_s - last.trained_s
        self._f = open(self.path, "a")
        if self._f.tell() and not _ends_with_newline(self.path):
            self._f.write("\n")  # a server killed mid-line: its half line stays apart
        if start is None:  # the run's clock, for a restarted stats server to go on with
            self.write(json_line({"type": "start", "t": 0.0, "unix": self.t0}))
        if resume:  # a new period of the run begins
            self.begun = round(time.time() - self.t0, 6)
            self.started, self.trained_s = None, clock.trained_s if clock is not None else 0.0
            self.write(json_line({"type": "resume", "t": self.begun}))
        self._last_flush = time.time()

    def write(self, line: str) -> None:
        """Append one line (``json_line`` of a record). Does not flush."""
        self._f.write(line + "\n")

    def flush(self, force: bool = True) -> None:
        """Flush to the OS, unless not ``force`` and the last flush was under FLUSH_S ago."""
        now = time.time()
        if force or now - self._last_flush >= FLUSH_S:
            self._f.flush()
            self._last_flush = now

    def close(self) -> None:
        self._f.close()


def run_clock(path: Path) -> tuple[float | None, TrainingClock | None]:
    """(the run's start as Unix time, from the ``start`` record that opens an existing metrics
    file; the ``TrainingClock`` of its records), each None for a new file or one written
    before start records existed."""
    start, earlier = earlier_records(path)
    return start, TrainingClock(earlier) if earlier is not None else None


def earlier_records(path: Path) -> tuple[float | None, Metrics | None]:
    """(the run's start as Unix time, from the ``start`` record that opens an existing metrics
    file; its records, ``read_metrics``), each None for a new file or one written before
    start records existed. Raises record_fields.DamagedRecord for a damaged record."""
    try:
        with open(path) as f:
            first = json.loads(f.readline() or "null")
    except (OSError, ValueError):
        return None, None
    if not (
        isinstance(first, dict) and first.get("type") == "start" and is_number(first.get("unix"))
    ):
        return None, None
    return float(first["unix"]), read_metrics(path)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def json_line(rec: dict) -> str:
    """One strict JSON line: a NaN or infinite number (a diverged loss) becomes null, since
    JSON has no NaN and other readers (jq, pandas) refuse Python's ``NaN``. Raises TypeError
    for what JSON cannot hold (a bytes key)."""
    try:
        return json.dumps(rec, separators=(",", ":"), allow_nan=False)
    except ValueError:  # rare (a diverged run): copy the record only then
        return json.dumps(finite(rec), separators=(",", ":"), allow_nan=False)


def finite(x):
    """``x`` as ``json_line`` writes it: a copy in which every NaN or infinite float (in
    dicts and lists too) is None. Pure."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite(v) for v in x]
    return x
