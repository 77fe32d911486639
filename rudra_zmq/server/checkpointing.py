"""When the parameter server writes its state to ``RUN_DIR/checkpoints/``, and how it starts
from the newest valid one.

A checkpoint is written after an update once ``train.checkpoint_every_s`` seconds or
``train.checkpoint_every_updates`` updates have passed since the last one (either may be 0:
off), when training completes (before the first STOP), and at the end if anything changed
since. Which learners were told STOP after that is kept beside it (``ToldRecord``): a PS
restarted by the same launcher does not wait for learners that have already gone. It is the
``ServerState.snapshot()``; ``server/checkpoint.py`` makes it atomic and verified. Writing blocks the
serving thread (the weights must not change while they are written): its cost is measured in
``bench/RESULTS.md`` (checkpoint cost).

Each server keeps its own directory (``shape.Server.checkpoint_dir``): the one serving the
whole vector ``RUN_DIR/checkpoints/`` (as always), one serving a range ``[lo, hi)`` of the
vector ``RUN_DIR/checkpoints/range-LO-HI/``. A checkpoint records its range and restores only into a
server of the same range (``ServerState.restore``); a server that finds none of its own but
another range's refuses to start afresh (``restore_latest``).

Not thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

from ..results.record_fields import DamagedRecord
from ..run_files import TOLD_FILE
from ..security import auth
from . import checkpoint
from .state import ARRAYS, check_meta

log = logging.getLogger("rudra_zmq.ps")


# a share's folder (``shape.Share.dirname``): a range, or stripes (the first one's, how many)
_RANGE_DIR = re.compile(r"(?:range-(\d+)-(\d+)|stripes-(\d+)-(\d+)-x(\d+))")


def _dir_share(m) -> tuple[int, int, int | None]:
    """(lo, hi, stripes or None) of a matched share folder name (lo, hi: its first stripe)."""
    if m[1] is not None:
        return int(m[1]), int(m[2]), None
    return int(m[3]), int(m[4]), int(m[5])


def meta_check(directory: Path, learners: int):
    """The check of a checkpoint's meta in ``directory`` for ``checkpoint.load_latest``:
    ``state.check_meta`` (λ = ``learners``), and its range the one the directory
    holds (``range-LO-HI``, ``stripes-LO-HI-xN``, else the whole vector). Raises
    record_fields.DamagedRecord."""
    named = _RANGE_DIR.fullmatch(Path(directory).name)

    def check(meta) -> None:
        check_meta(meta, learners)
        lo, hi, n = _dir_share(named) if named else (0, meta["numel"], None)
        saved = meta.get("range") or [0, meta["numel"]]
        striped = bool(saved) and isinstance(saved[0], list)
        ok = (
            (striped and n == len(saved) and saved[0] == [lo, hi])
            if n is not None
            else (not striped and saved == [lo, hi])
        )
        if not ok:
            raise DamagedRecord(
                f"meta.range is {saved}; {Path(directory).name} holds the checkpoints of "
                + (f"range [{lo}, {hi})" if n is None else f"{n} stripes from [{lo}, {hi})")
            )

    return check


def saved_ranges(root: Path) -> list[tuple[int, int] | None]:
    """The ranges (lo, hi) with checkpoints under the checkpoint directory ``root`` (a striped
    share's first stripe), None for the whole vector (checkpoints in ``root`` itself). Blocks
    (lists directories)."""
    found = [None] if checkpoint.list_checkpoints(root) else []
    if root.is_dir():
        found += sorted(
            _dir_share(m)[:2]
            for p in root.iterdir()
            if (m := _RANGE_DIR.fullmatch(p.name)) and checkpoint.list_checkpoints(p)
        )
    return found


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
        self.seconds = 0.0  # time spent writing (for the PS's report)

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
        log.info(
            "checkpoint %s at timestamp %d (%.0f ms)",
            path.name,
            state.engine.timestamp,
            1000 * (self._last_t - t0),
        )
        return path


def restore_latest(state, directory: Path, root: Path | None = None) -> Path | None:
    """Continue ``state`` from the newest valid checkpoint in ``directory`` (its range's
    ``Server.checkpoint_dir``); returns its path, or None if the run has no checkpoints. Raises
    checkpoint.CheckpointError if none is valid, ValueError if it holds another model or
    range, or if there are none for ``state.share`` but some for other ranges of the run under
    ``root`` (the run's checkpoint directory, ``run_files.checkpoints_root``; None: ``directory``)
    (a resumed run split otherwise would silently start afresh). Blocks (reads the files)."""
    ck = checkpoint.load_latest(directory, meta_check(directory, state.learners), ARRAYS)
    if ck is not None:
        try:
            state.restore(ck.arrays, ck.meta)
        except ValueError as exc:  # another model's or range's: say which checkpoint
            raise ValueError(f"{ck.path / checkpoint.MANIFEST}: {exc}") from None
        return ck.path
    root = directory if root is None else root
    others = saved_ranges(root)
    if others:
        names = ", ".join(
            "the whole vector" if r is None else f"[{r[0]:,}, {r[1]:,})" for r in others
        )
        raise ValueError(
            f"{root} holds checkpoints of range {names} but none of range "
            f"{state.share} that this server serves: restore each server from its "
            "own range's checkpoints (was the number of servers changed? checkpoints "
            "written before stripes restore with wire.stripes=false)"
        )
    return None


def launch_session() -> str | None:
    """Which ``rudra-zmq run``/``launch`` started this process: a hash of its run token (never
    the token), or None for a role started by hand."""
    token = auth.run_token()
    return None if token is None else hashlib.sha256(token.encode()).hexdigest()[:16]


class ToldRecord:
    """The learners told STOP once training is over, in ``DIRECTORY/told.json``, so that a PS
    killed during its shutdown and restarted by the same launcher does not wait
    ``runtime.timeout_s`` for learners that were told and have exited.

    The record names the launch (``launch_session``) and the timestamp where training ended:
    a run resumed later (``--resume``: new learner processes) or trained further ignores it.
    ``save`` is called before each STOP is sent, so a crash between the two leaves a learner
    marked told that was not: it then finds no server and the launcher ends it
    (``LEARNER_EXIT_S``), whereas the other order would make the restarted PS wait. Without a
    launch (roles by hand) nothing is kept. Not thread-safe: the PS's thread.
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / TOLD_FILE
        self.session = launch_session()
        self._saved: frozenset = frozenset()

    def save(self, state) -> None:
        """Record ``state.stopped`` if it grew. Blocks for a small write (no fsync: it must
        survive the process, not the machine)."""
        if self.session is None or state.stopped <= self._saved:
            return
        record = {
            "session": self.session,
            "timestamp": state.engine.timestamp,
            "told": sorted(state.stopped),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(TOLD_FILE + ".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)
        self._saved = frozenset(state.stopped)

    def restore(self, state) -> set[int]:
        """Mark the learners this launch already told STOP, if ``state`` (just restored) is
        where training ended; returns them (empty otherwise). A damaged record is ignored with
        a warning. Blocks (reads the file)."""
        if self.session is None or not state.done:
            return set()
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return set()
        except (OSError, ValueError) as exc:
            log.warning(
                "ignoring %s (%s): learners not yet heard from are waited for", self.path, exc
            )
            return set()
        told = record.get("told") if isinstance(record, dict) else None
        if (
            (record.get("session") if isinstance(record, dict) else None) != self.session
            or record.get("timestamp") != state.engine.timestamp
            or not isinstance(told, list)
        ):
            return set()  # another launch's, or another end of training
        told = {i for i in told if isinstance(i, int) and 0 <= i < state.learners}
        state.stopped |= told
        self._saved = frozenset(state.stopped)
        return told
