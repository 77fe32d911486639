"""What ``rudra-zmq run --resume RUN_DIR`` may change about a run, and the checks.

A resumed run continues the weights, momentum, sync engine and data order of a checkpoint, so
everything that defines the training (model, data, sync, optimizer, architecture, seeds) must
stay as it was. Only keys in ``RESUMABLE`` may differ, and only when given with ``--set``:
how long to train, how often to evaluate and checkpoint, and how the processes run. A run
that already trained its ``train.epochs`` has nothing to do (``finished_note``). No sockets,
no processes; reads the run directory only.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import config as config_mod
from ..config import ConfigError
from ..run_files import CONFIG_FILE, PS_FINAL_FILE
from ..server.end_files import assemble
from ..shape import ClusterShape

# Keys (or whole sections, ending in ".") a resumed run may change with --set.
RESUMABLE = (
    "train.epochs",
    "train.eval_every_epochs",
    "train.eval_every_updates",
    "train.checkpoint_every_s",
    "train.checkpoint_every_updates",
    "runtime.",
)


def resumable(key: str) -> bool:
    """Whether ``key`` (``section.name``) may change when a run is resumed. Pure."""
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def resume_config(run_dir, config_path=None, overrides=()):
    """The config to resume ``run_dir`` with: its saved ``config.yaml`` (or ``config_path``,
    which must match it) with the ``--set`` ``overrides``. Raises ConfigError naming a key
    that changed without --set, or one that a resumed run cannot change; FileNotFoundError
    when ``run_dir`` holds no run."""
    saved_path = Path(run_dir) / CONFIG_FILE
    if not saved_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no run to resume (no {CONFIG_FILE} there)")
    saved = config_mod.load_config(saved_path)
    cfg = config_mod.load_config(config_path or saved_path, list(overrides))
    given = {item.split("=", 1)[0].strip() for item in overrides}
    old, new = (config_mod.flat_keys(config_mod.to_dict(c)) for c in (saved, cfg))
    for flat in (old, new):  # unset and false both mean plaintext under `run` (runs saved
        if flat.get("security.curve") is None:  # before the unset default said false)
            flat["security.curve"] = False
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if not resumable(key):
            raise ConfigError(
                f"{key} is {old.get(key)!r} in {saved_path} but {new.get(key)!r} now: a resumed "
                f"run cannot change it (it defines the training). Resumable with --set: "
                f"{', '.join(RESUMABLE)}"
            )
        if key not in given:
            raise ConfigError(
                f"{key} changed from {old.get(key)!r} to {new.get(key)!r} "
                f"without --set; give --set {key}=... to change it on resume"
            )
    return cfg


def finished_note(run_dir, cfg) -> str | None:
    """The one line to print instead of resuming when the run in ``run_dir`` already trained
    ``cfg.train.epochs`` (its PS wrote ``ps_final.json`` saying training was done, at that
    epoch or later), else None. Reads one small file. A run of several servers that all
    finished but whose own files were never joined (no shared file system: each server's
    ``servers/server-I`` copied here afterwards) is joined first (``end_files.assemble``
    over the shape's ``joined_dirs``), and the line says so."""
    joined = ""
    if not (Path(run_dir) / PS_FINAL_FILE).exists():
        dirs = ClusterShape.of(cfg).joined_dirs(run_dir)
        if assemble(run_dir, dirs, cfg.train.epochs):
            joined = f"joined the {len(dirs)} servers' weights into weights.npy; "
    try:
        final = json.loads((Path(run_dir) / PS_FINAL_FILE).read_text())
        done, epoch = final["done"], float(final["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no final state (it stopped early): resume from the checkpoint
    if done is not True or epoch < cfg.train.epochs:
        return None
    return (
        f"rudra-zmq: {joined}nothing to do: {run_dir} already trained {epoch:.2f} epochs of "
        f"train.epochs={cfg.train.epochs:g}; to train on, resume with --set "
        f"train.epochs=N (N > {epoch:.2f})"
    )
