"""The final weights as the parameter server left them in the run directory, for the
statistics server to evaluate when their EVAL never reached it (lost with a statistics server
restarted near the end of training, or dropped by a full queue).

The PS writes ``RUN/weights.npy`` and then ``RUN/ps_final.json`` (``roles/ps.py``), so once
the latter names a timestamp, the former holds the weights at it. Reads files only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..run_files import PS_FINAL_FILE, WEIGHTS_FILE
from .ps_report import read_final


def final_weights(run_dir, ts: int, numel: int) -> np.ndarray | None:
    """The weights at timestamp ``ts`` from ``run_dir/weights.npy``, once ``ps_final.json``
    says training ended there; None until then (or when either file is unreadable). Raises
    ValueError when the file holds something other than ``numel`` float32 values."""
    run_dir = Path(run_dir)
    final = read_final(run_dir)
    if final is None or final["timestamp"] != ts:
        return None
    try:
        w = np.load(run_dir / WEIGHTS_FILE, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if w.dtype != np.float32 or w.shape != (numel,):
        raise ValueError(
            f"{run_dir / WEIGHTS_FILE} holds {w.dtype} {w.shape}, not the model's "
            f"{numel:,} float32 values (is it another run's?)"
        )
    return w


def final_done(run_dir, epochs: float) -> dict | None:
    """The ``done`` record (type, ts, t, epoch) that ``run_dir/ps_final.json`` stands for when
    it says training is done at ``epochs`` or later (a finished run resumed to train on has an
    older one, at fewer epochs), else None (also when it is missing or unreadable). A local
    file the PS wrote, so trusted as the PS's word. Reads one small file."""
    final = read_final(run_dir)
    if final is None or not final["epoch"] >= epochs:
        return None
    try:
        t = (Path(run_dir) / PS_FINAL_FILE).stat().st_mtime
    except OSError:
        return None
    return {"type": "done", "ts": final["timestamp"], "t": t, "epoch": float(final["epoch"])}


def final_record(done: dict, last_ts, last_t) -> dict:
    """The ``eval`` record's place of final weights read from the file, for the ``done``
    record ``done`` (its ts, t and epoch on the run's clock): at the time of the final update
    when the newest update record (``last_ts``, ``last_t``) is it, else of ``done``."""
    t = last_t if last_ts == done["ts"] else done["t"]
    return {"ts": done["ts"], "t": t, "epoch": float(done["epoch"]), "weights": WEIGHTS_FILE}
