"""The final weights as the parameter server left them in the run directory, for the
statistics server to evaluate when their EVAL never reached it (lost with a statistics server
restarted near the end of training, or dropped by a full queue).

The PS writes ``RUN/weights.npy`` and then ``RUN/ps_final.json`` (``roles/ps.py``), so once
the latter names a timestamp, the former holds the weights at it. Reads files only.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .ps_report import PS_FINAL_FILE

WEIGHTS_FILE = "weights.npy"


def final_weights(run_dir, ts: int, numel: int) -> np.ndarray | None:
    """The weights at timestamp ``ts`` from ``run_dir/weights.npy``, once ``ps_final.json``
    says training ended there; None until then (or when either file is unreadable). Raises
    ValueError when the file holds something other than ``numel`` float32 values."""
    run_dir = Path(run_dir)
    try:
        final = json.loads((run_dir / PS_FINAL_FILE).read_text())
        if not isinstance(final, dict) or final.get("timestamp") != ts or \
                final.get("done") is not True:
            return None
        w = np.load(run_dir / WEIGHTS_FILE, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if w.dtype != np.float32 or w.shape != (numel,):
        raise ValueError(f"{run_dir / WEIGHTS_FILE} holds {w.dtype} {w.shape}, not the model's "
                         f"{numel:,} float32 values (is it another run's?)")
    return w


def final_record(done: dict, last_ts, last_t) -> dict:
    """The ``eval`` record's place of final weights read from the file, for the ``done``
    record ``done`` (its ts, t and epoch on the run's clock): at the time of the final update
    when the newest update record (``last_ts``, ``last_t``) is it, else of ``done``."""
    t = last_t if last_ts == done["ts"] else done["t"]
    return {"ts": done["ts"], "t": t, "epoch": float(done["epoch"]), "weights": WEIGHTS_FILE}
