"""The parameter server's record of what reached its sync engine, in order, for
``rudra-zmq replay``: each gradient's (learner, timestamp it was computed on, the learner's
step: its minibatch), each eviction and each rejoin -- never the gradients themselves.

``RUN/arrivals.bin``: a 16-byte header (``b"RZARRIV1"``, then the PS's incarnation as int64),
then one record per event of four little-endian int32: ``(kind, learner, ts, step)``, kind 0
a gradient, 1 an eviction (``SyncEngine.leave``), 2 a member's HELLO (``SyncEngine.join``).
16 bytes per gradient: an update of c gradients costs 16·c bytes. Events are written with the
update they complete, and flushed with every checkpoint and at the end.

A PS restarted from a checkpoint appends its events after a header of its own incarnation: the
updates lost since the checkpoint make that log no longer the run's, and ``read`` refuses it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ..run_files import ARRIVALS_FILE

MAGIC = b"RZARRIV1"
HEADER = struct.Struct("<8sq")
GRADIENT, LEAVE, JOIN = 0, 1, 2
FLUSH_ROWS = 4096  # events held in memory at most (64 KiB)
RECORD = np.dtype([("kind", "<i4"), ("learner", "<i4"), ("ts", "<i4"), ("step", "<i4")])


class ArrivalLog:
    """Appends events to ``run_dir/arrivals.bin``. Not thread-safe: the PS loop owns it."""

    def __init__(self, run_dir, incarnation: int):
        self.path = Path(run_dir) / ARRIVALS_FILE
        self._f = open(self.path, "ab")  # noqa: SIM115 -- held open for the run, closed by close()
        self._f.write(HEADER.pack(MAGIC, incarnation))
        self._rows: list[tuple[int, int, int, int]] = []

    def gradient(self, learner: int, ts: int, step: int) -> None:
        self._rows.append((GRADIENT, learner, ts, step))
        if len(self._rows) >= FLUSH_ROWS:
            self.flush()

    def leave(self, learner: int) -> None:
        self._rows.append((LEAVE, learner, -1, -1))

    def join(self, learner: int) -> None:
        self._rows.append((JOIN, learner, -1, -1))

    def flush(self) -> None:
        """Write the events so far to the file (to the OS, not fsync'd). Blocks on the write."""
        if self._rows:
            self._f.write(np.array(self._rows, RECORD).tobytes())
            self._rows.clear()
        self._f.flush()

    def close(self) -> None:
        self.flush()
        self._f.close()


def read(run_dir) -> np.ndarray:
    """The events of ``run_dir/arrivals.bin`` (a structured array of ``RECORD``). Raises
    FileNotFoundError without a log, ValueError for a damaged one or one a restarted PS
    appended to (what a replay cannot reproduce). Reads the file."""
    path = Path(run_dir) / ARRIVALS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: replay needs a Rudra-base run recorded with the arrivals "
            "log (runs of a PS tree, of the simulator, or of versions before replay have none)"
        )
    data = path.read_bytes()
    if len(data) < HEADER.size or data[:8] != MAGIC:
        raise ValueError(f"{path} is not an arrivals log (no {MAGIC!r} header)")
    body = data[HEADER.size :]
    if len(body) % RECORD.itemsize:
        raise ValueError(f"{path} ends inside a record ({len(body)} bytes of events)")
    events = np.frombuffer(body, RECORD)
    bad = np.flatnonzero(~np.isin(events["kind"], (GRADIENT, LEAVE, JOIN)))
    if len(bad):
        at = HEADER.size + int(bad[0]) * RECORD.itemsize
        if data[at : at + 8] == MAGIC:  # a header is one record long
            raise ValueError(
                f"{path}: the PS restarted during the run (a second header); the updates it "
                "lost since its checkpoint cannot be replayed"
            )
        raise ValueError(
            f"{path} is damaged: event {int(bad[0])} has kind {events['kind'][bad[0]]}"
        )
    return events
