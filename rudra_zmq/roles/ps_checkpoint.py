"""When the parameter server writes its state to ``RUN_DIR/checkpoints/``, and how it starts
from the newest valid one.

A checkpoint is written after an update once ``train.checkpoint_every_s`` seconds or
``train.checkpoint_every_updates`` updates have passed since the last one (either may be 0:
off), and at the end. It is the ``ServerState.snapshot()``; ``checkpoint.py`` makes it atomic
and verified. Writing blocks the serving thread (the weights must not change while they are
written): its cost is measured in ``bench/RESULTS.md`` (checkpoint cost).

Not thread-safe: owned by the parameter server's thread.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from .. import checkpoint

log = logging.getLogger("rudra_zmq.ps")


def checkpoint_dir(run_dir) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


class CheckpointSchedule:
    """Writes the state's checkpoints into ``directory`` on the configured schedule, counting
    updates from ``timestamp`` (where the server starts)."""

    def __init__(self, train_cfg, directory: Path, timestamp: int = 0):
        self.every_s = train_cfg.checkpoint_every_s
        self.every_updates = train_cfg.checkpoint_every_updates
        self.directory = directory
        self._last_t = time.monotonic()
        self.last_ts = timestamp
        self.written = 0
        self.seconds = 0.0      # time spent writing (for the PS's report)

    def after_update(self, state) -> None:
        """Write a checkpoint if one is due. Blocks while writing."""
        ts = state.engine.timestamp
        due_t = self.every_s > 0 and time.monotonic() - self._last_t >= self.every_s
        due_u = self.every_updates > 0 and ts - self.last_ts >= self.every_updates
        if due_t or due_u:
            self.save(state)

    def save(self, state) -> Path:
        """Write one checkpoint now. Blocks."""
        t0 = time.monotonic()
        arrays, meta = state.snapshot()
        path = checkpoint.save(self.directory, arrays, meta)
        self._last_t, self.last_ts = time.monotonic(), state.engine.timestamp
        self.written += 1
        self.seconds += self._last_t - t0
        log.info("checkpoint %s at timestamp %d (%.0f ms)", path.name, state.engine.timestamp,
                 1000 * (self._last_t - t0))
        return path


def restore_latest(state, directory: Path) -> Path | None:
    """Continue ``state`` from the newest valid checkpoint in ``directory``; returns its path,
    or None if there is none. Raises checkpoint.CheckpointError if none is valid, ValueError
    if it holds another model. Blocks (reads the files)."""
    ck = checkpoint.load_latest(directory)
    if ck is None:
        return None
    state.restore(ck.arrays, ck.meta)
    return ck.path
