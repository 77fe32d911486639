"""The simulator's checkpoints: a long ``simulate --train`` continues where it was stopped.

A ×0.1 point of the paper's schedule takes hours on a CPU, 140 epochs on a GPU longer: a
simulation that starts from zero after every interruption may never end. The simulated timing
does not depend on the gradients (``simulator._events``), so a resumed simulation replays the
event stream from the start without computing anything up to the checkpoint's update, and
takes from the checkpoint only what the gradients made: the PS's weights and momentum
(``update.Updater``), the weights versions learners still compute on, and the evaluations so
far. The result equals the uninterrupted run's up to float summation order (tested).

One file, ``RUN/sim_checkpoint.npz`` (``run_files.sim_checkpoint_path``), written atomically
after each evaluation (and at least every ``EVERY_S`` seconds, at an update) and removed when
the run directory is complete. It holds a fingerprint of what decides the training (the
config but ``runtime.*``, the timing seed, jitter, speeds, the gradient path); a checkpoint
of other settings is refused, naming what must match.
"""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import config as config_mod
from ..data.dataset_cache import save_npz

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (another run's, or unreadable); says which."""


@dataclass
class SimState:
    """What a resumed simulation takes over: everything up to and including update ``ts``."""

    ts: int  # the last update applied before the checkpoint
    epoch: float
    w: np.ndarray  # the PS's weights after update ts
    v: np.ndarray  # its momentum buffer
    versions: dict = field(default_factory=dict)  # weights version -> weights, still in use
    evals: list = field(default_factory=list)  # the evaluation records so far
    evals_next: float = float("inf")  # the epoch of the next evaluation


def fingerprint(cfg, *, seed: int, jitter: float, speeds, path: str) -> str:
    """A digest of what decides a simulation's training: the config except ``runtime.*``,
    the timing ``seed``, ``jitter``, ``speeds`` and the gradient ``path`` (batched or
    per-gradient). A key removed since (``config.KEPT_VALUES``) counts at the value every
    run now behaves as, and a key added since (``config.ADDED_DEFAULTS``) is left out at its
    default, so checkpoints written before either still resume. Pure."""
    data = config_mod.to_dict(cfg)
    data.pop("runtime", None)
    for key, default in config_mod.ADDED_DEFAULTS.items():
        section, name = key.split(".", 1)
        if data.get(section, {}).get(name) == default:
            del data[section][name]
    for key, value in config_mod.KEPT_VALUES.items():  # a removed key, as checkpoints hold it
        section, name = key.split(".", 1)
        data.setdefault(section, {}).setdefault(name, value)
    key = {"config": data, "seed": seed, "jitter": jitter, "speeds": list(speeds), "path": path}
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def save(path: Path, print_: str, state: SimState) -> None:
    """Write ``state`` with the fingerprint ``print_`` to ``path`` atomically (a reader sees
    the previous checkpoint or this one). Blocks on the disk; raises OSError."""
    meta = {
        "format": FORMAT,
        "fingerprint": print_,
        "ts": state.ts,
        "epoch": state.epoch,
        "evals": state.evals,
        "evals_next": state.evals_next if np.isfinite(state.evals_next) else None,
        "versions": sorted(state.versions),
    }
    arrays = {f"version_{v}": a for v, a in state.versions.items()}
    save_npz(path, meta=np.array(json.dumps(meta)), w=state.w, v=state.v, **arrays)


def load(path: Path, print_: str) -> SimState:
    """The checkpoint at ``path``, if it was written with the fingerprint ``print_``. Raises
    CheckpointError (unreadable, another format, or another run's settings). Blocks."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = _meta(z)
            if meta.get("format") != FORMAT:
                raise CheckpointError(
                    f"{path} is a simulator checkpoint of format {meta.get('format')}, this "
                    f"version reads {FORMAT}: remove it to start afresh"
                )
            if meta["fingerprint"] != print_:
                raise CheckpointError(
                    f"{path} was written by a simulation of other settings (config other than "
                    "runtime.*, --seed, --jitter, --speeds or --gradients): resume with the "
                    "same ones, or remove it to start afresh"
                )
            versions = {int(v): z[f"version_{v}"] for v in meta["versions"]}
            w, v = z["w"], z["v"]
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} cannot be read as a simulator checkpoint: {exc}") from None
    nxt = meta.get("evals_next")
    return SimState(
        ts=int(meta["ts"]),
        epoch=float(meta["epoch"]),
        w=w,
        v=v,
        versions=versions,
        evals=list(meta["evals"]),
        evals_next=float("inf") if nxt is None else float(nxt),
    )


def _meta(z) -> dict:
    """The JSON record of an opened checkpoint ``z``."""
    return json.loads(str(z["meta"]))


def describe(path: Path) -> str | None:
    """'update TS, epoch E' of the checkpoint at ``path`` for a message, or None when there is
    none or it cannot be read. Blocks on the disk."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = _meta(z)
        return f"update {meta['ts']}, epoch {meta['epoch']:.2f}"
    except (OSError, KeyError, ValueError, TypeError, zipfile.BadZipFile):
        return None


EVERY_S = 600.0  # at most this long between checkpoints (evaluations may be rarer)


class Saver:
    """Writes a simulation's checkpoint after each evaluation, and after the first update
    ``EVERY_S`` seconds after the last one (``due``, ``save``), for the training loops of
    ``simulator`` and ``sim_batched``. Not thread-safe; blocks on the disk."""

    def __init__(self, path: Path, print_: str, updater, evals):
        self.path, self.print_, self.updater, self.evals = path, print_, updater, evals
        self.saved = 0
        self._last = time.monotonic()

    def due(self, evaluated: bool) -> bool:
        """Whether to checkpoint after an update: it was evaluated, or ``EVERY_S`` passed."""
        return evaluated or time.monotonic() - self._last >= EVERY_S

    def save(self, update, versions: dict) -> None:
        """Checkpoint the state right after ``update`` (a ``sync.Update``, just applied);
        ``versions``: weights version -> the weights learners still use."""
        u = self.updater
        state = SimState(
            ts=update.timestamp,
            epoch=update.epoch,
            w=u.w,
            v=u.v,
            versions=versions,
            evals=list(self.evals.result.evals),
            evals_next=self.evals.next,
        )
        save(self.path, self.print_, state)
        self.saved += 1
        self._last = time.monotonic()
