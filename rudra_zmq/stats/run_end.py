"""When the statistics server may finish: rules over what it has received, with the time
passed in (no sockets, no clock of its own) and one small file read.

A run ends with the PS's ``done`` record or, when none came (it went to a server that has
gone), with ``RUN/ps_final.json`` saying training is done (``end_files.final_done``), looked
at every ``FINAL_FILE_EVERY_S`` once it is ``FINAL_FILE_GRACE_S`` old. The server then keeps reading for ``DONE_QUIET_S``
(stragglers: learner records), and finishes once the final weights (at the ``done``'s ts) are
evaluated -- from their EVAL, or from ``RUN/weights.npy`` -- or after ``DONE_WAIT_S``. A
``done`` without a ts waits for the EVALs it announced instead. Not thread-safe: the
statistics server's thread owns it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import wire
from ..run_files import PS_FINAL_FILE, WEIGHTS_FILE
from ..server.end_files import final_done
from ..shape import ClusterShape
from .progress import is_number

log = logging.getLogger("rudra_zmq.stats")

ONE_SERVER = ClusterShape(1)  # a run's default shape (immutable)
DONE_QUIET_S = 0.2  # after "done", keep reading this long for stragglers (learner records)
DONE_WAIT_S = 10.0  # ... and at most this long for the final weights (EVAL or file)
FINAL_FILE_EVERY_S = 1.0  # without a "done": how often ps_final.json is looked at
FINAL_FILE_GRACE_S = 2.0  # ... and how old it must be: the PS sends its "done" just before
#                           writing it, so a younger file may still have its "done" in flight


class RunEnd:
    """What the statistics server of the run in ``run_dir`` (training ``epochs``, its
    parameter servers those of ``shape``, a ``ClusterShape``: one by default) knows of the end
    of training: ``done``, the PS's ``done`` record with its arrival time and sender (None
    until one came; server 0's, once every server's has come), and the EVALs received per
    sender."""

    def __init__(self, run_dir, epochs: float, shape: ClusterShape = ONE_SERVER):
        self.run_dir, self.epochs, self.shape = Path(run_dir), epochs, shape
        self._dones: dict[int, dict] = {}  # each server's first "done"
        self.done: dict | None = None
        self.evals: dict[int, int] = {}
        self._looked = 0.0  # when ps_final.json was last looked at (no "done" yet)
        self._file_record: dict | None = None  # the "done" the file stood for, to record once

    def eval_received(self, sender: int) -> None:
        self.evals[sender] = self.evals.get(sender, 0) + 1

    def done_received(self, rec: dict, now: float, sender: int) -> None:
        """The first ``done`` record of each server counts (the end is known once every
        server's has come); later ones change nothing."""
        if self.done is not None:
            return
        server = self.shape.record_server(rec)
        if server is None:
            return  # a "done" that names no server of this run: not counted
        self._dones.setdefault(server, rec)
        if len(self._dones) < len(self.shape.servers):
            return
        rec = self._dones[0]
        self.done = {**rec, "arrived": now, "sender": sender}

    def look_for_file(self, now: float, t0: float) -> bool:
        """Whether a ``done`` is known: without one, ``ps_final.json`` saying training is done
        (looked at once per ``FINAL_FILE_EVERY_S``; written ``FINAL_FILE_GRACE_S`` ago or more,
        since the PS's own ``done`` may still be in flight) stands for it, on the run's clock ``t0``.
        Reads one small file at most."""
        if self.done is not None:
            return True
        if now - self._looked < FINAL_FILE_EVERY_S:
            return False
        self._looked = now
        done = final_done(self.run_dir, self.epochs)
        if done is None or now - done["t"] < FINAL_FILE_GRACE_S:
            return False
        log.info(
            "statistics server: %s says training ended at ts %d and no 'done' has "
            "come (sent to a server that is gone); taking it for the 'done'",
            self.run_dir / PS_FINAL_FILE,
            done["ts"],
        )
        done = {**done, "t": round(done["t"] - t0, 6), "source": PS_FINAL_FILE}
        self.done = {**done, "arrived": now, "sender": wire.SENDER_PS}
        self._file_record = done
        return True

    def file_record(self) -> dict | None:
        """The ``done`` record (with ``"source": "ps_final.json"``) that the file stood for,
        once, for the metrics to say how the run's end became known; None otherwise."""
        rec, self._file_record = self._file_record, None
        return rec

    def verdict(self, now: float, evaluated) -> str:
        """Once a ``done`` is known: ``"wait"``, ``"finished"``, or ``"final"``: the final
        weights (``done["ts"]``, not in the timestamps ``evaluated``) are still to evaluate --
        from the file if it holds them, else finish once :meth:`waited_out`."""
        waited = now - self.done["arrived"]
        if waited < DONE_QUIET_S:
            return "wait"
        ts = self.done.get("ts")
        if not isinstance(ts, int) or not is_number(self.done.get("epoch")):
            announced = self.done.get("evals_sent")
            announced = announced if is_number(announced) else 0
            got = self.evals.get(self.done["sender"], 0)
            return "finished" if got >= announced or waited >= DONE_WAIT_S else "wait"
        return "finished" if ts in evaluated else "final"

    def waited_out(self, now: float) -> bool:
        """Whether the final weights were waited for long enough (``DONE_WAIT_S``)."""
        return now - self.done["arrived"] >= DONE_WAIT_S


def final_record(done: dict, last_ts, last_t) -> dict:
    """The ``eval`` record's place of final weights read from the file, for the ``done``
    record ``done`` (its ts, t and epoch on the run's clock): at the time of the final update
    when the newest update record (``last_ts``, ``last_t``) is it, else of ``done``."""
    t = last_t if last_ts == done["ts"] else done["t"]
    return {"ts": done["ts"], "t": t, "epoch": float(done["epoch"]), "weights": WEIGHTS_FILE}
