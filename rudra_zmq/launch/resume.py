"""What ``rudra-zmq run --resume RUN_DIR`` may change about a run, and the checks.

A resumed run continues the weights, momentum, sync engine and data order of a checkpoint, so
everything that defines the training (model, data, sync, optimizer, architecture, seeds) must
stay as it was. Only keys in ``RESUMABLE`` may differ, and only when given with ``--set``:
how long to train, how often to evaluate and checkpoint, and how the processes run. A run
that already trained its ``train.epochs`` has nothing to do (``finished_note``). No sockets,
no processes; reads the run directory only.
"""

from __future__ import annotations

from pathlib import Path

from .. import config as config_mod
from ..config import ConfigError
from ..results.record_fields import DamagedRecord
from ..results.records import load_final, read_metrics
from ..run_files import CONFIG_FILE, PS_FINAL_FILE, checkpoints_root, metrics_path
from ..server import checkpoint
from ..server.checkpointing import meta_check, saved_ranges
from ..server.end_files import assemble
from ..server.state import ARRAYS
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


def check_records(run_dir, cfg) -> None:
    """Refuse, before anything starts, a run whose records a resumed run would read back
    damaged: ``metrics.jsonl`` (``records.read_metrics``), or a checkpoint directory whose
    every checkpoint is damaged (files, or a manifest's state: ``state.check_meta``
    against ``cfg``'s λ;
    the servers would skip a damaged newer one for the one before, and say so), or
    checkpoints of another number of servers than ``cfg``'s (a damaged ``config.yaml``; a
    server without checkpoints of its range yet is no mismatch). Raises
    record_fields.DamagedRecord naming the file, the record, the field and the value.
    Reads every checkpoint's arrays (their sha256)."""
    if metrics_path(run_dir).is_file():
        read_metrics(run_dir)
    root = checkpoints_root(run_dir)
    ranges, k = saved_ranges(root), cfg.architecture.servers
    split = [r for r in ranges if r is not None]
    if (k == 1 and split and None not in ranges) or (
        k > 1 and (len(split) > k or (None in ranges and not split))
    ):
        held = ", ".join("the whole vector" if r is None else f"[{r[0]}, {r[1]})" for r in ranges)
        raise DamagedRecord(
            f"{Path(run_dir) / CONFIG_FILE} says architecture.servers={k}, but {root} holds "
            f"checkpoints of {held}: the config is damaged, or not this run's"
        )
    shares = [*sorted(root.glob("range-*")), *sorted(root.glob("stripes-*"))]
    for directory in [root, *shares] if root.is_dir() else ():
        check = meta_check(directory, cfg.sync.learners)
        try:
            checkpoint.load_latest(directory, check, ARRAYS, quiet=True)
        except checkpoint.CheckpointError as exc:
            raise DamagedRecord(str(exc)) from None


def finished_note(run_dir, cfg) -> str | None:
    """The one line to print instead of resuming when the run in ``run_dir`` already trained
    ``cfg.train.epochs`` (its PS wrote ``ps_final.json`` saying training was done, at that
    epoch or later), else None. Reads one small file. A run of several servers that all
    finished but whose own files were never joined (no shared file system: each server's
    ``servers/server-I`` copied here afterwards) is joined first (``end_files.assemble``
    over the shape's ``joined_dirs``), and the line says so. Raises
    record_fields.DamagedRecord for a damaged ``ps_final.json`` (``records.load_final``),
    the run's or a server's."""
    joined = ""
    if not (Path(run_dir) / PS_FINAL_FILE).exists():
        shape = ClusterShape.of(cfg)
        dirs = shape.joined_dirs(run_dir)
        for d in dirs:
            load_final(d)  # a damaged one is refused, not skipped
        if assemble(run_dir, dirs, cfg.train.epochs, shape.join):
            joined = f"joined the {len(dirs)} servers' weights into weights.npy; "
    final = load_final(run_dir)
    if final is None:
        return None  # no final state (it stopped early): resume from the checkpoint
    epoch = final["epoch"]
    if not final["done"] or epoch < cfg.train.epochs:
        return None
    return (
        f"rudra-zmq: {joined}nothing to do: {run_dir} already trained {epoch:.2f} epochs of "
        f"train.epochs={cfg.train.epochs:g}; to train on, resume with --set "
        f"train.epochs=N (N > {epoch:.2f})"
    )
