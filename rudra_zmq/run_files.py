"""The names of the files in a run directory, in one place.

What a run directory holds (``RUN`` below), and who writes it:

- ``config.yaml``: the resolved config (the launcher, ``worker``, the simulator, ``api``);
- ``metrics.jsonl``: every record of the run, one JSON line each (the statistics server, the
  simulator); ``summary.csv`` and the PNG plots are made from it (``plots``);
- ``weights.npy``: the final weights, then ``ps_final.json``: where training ended, in the
  parameter server's own words (the PS, ``server/end_files.py``);
- ``servers/server-I/``: with ``architecture.servers`` > 1, server I's own ``weights.npy``
  (its range), ``ps_final.json`` and ``arrivals.bin``; the last server to finish writes the
  run's ``weights.npy`` and ``ps_final.json`` from them (``server/end_files.py``);
- ``checkpoints/``: the PS's checkpoints, and ``checkpoints/told.json``: the learners told
  STOP once training was over (``server/checkpointing.py``);
- ``logs/ROLE.log``: each role's output, and ``processes.json``: every pid and command line,
  and how each process that exited ended (``exit``, ``signal``: a killed role's row stays
  beside its restarted successor's) (the launchers);
- ``keys/``: the run's own CurveZMQ keys (``run_plan.run_keys``); ``tensorboard/``: the
  TensorBoard events (``logging.tensorboard``);
- a sweep point's ``point.json`` and ``sweep.log``, and the sweep parent's ``sweep.yaml``
  (``sweep.py``); an unfinished simulation's ``sim_checkpoint.npz`` (``sim/sim_checkpoint.py``);
- ``rudra-zmq launch``'s ``.launch-id`` and, with pdsh, ``.env-LABEL.json``
  (``cluster_launch.py``).

Pure: names and paths only; nothing here touches the disk.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.csv"
WEIGHTS_FILE = "weights.npy"  # the final weights, saved before PS_FINAL_FILE
PS_FINAL_FILE = "ps_final.json"  # where training ended, in the PS's own words
ARRIVALS_FILE = "arrivals.bin"  # the PS's engine events, for replay (server/arrival_log.py)
CHECKPOINT_DIR = "checkpoints"
SERVERS_DIR = "servers"  # architecture.servers > 1: each server's own files, server-I/
TOLD_FILE = "told.json"  # in CHECKPOINT_DIR: learners told STOP (ToldRecord)
LOG_DIR = "logs"
PROCESSES_FILE = "processes.json"
KEYS_DIR = "keys"
TB_DIR = "tensorboard"
POINT_FILE = "point.json"  # a sweep point's record: mode, status, exit code
SWEEP_LOG = "sweep.log"  # a sweep point's output
SWEEP_FILE = "sweep.yaml"  # a sweep parent's grid: its points in order
SIM_CHECKPOINT_FILE = "sim_checkpoint.npz"  # an unfinished `simulate --train` (sim_checkpoint)
LAUNCH_ID_FILE = ".launch-id"  # `launch`: tells a host that shares our file system


def config_path(run_dir) -> Path:
    """``RUN/config.yaml``."""
    return Path(run_dir) / CONFIG_FILE


def metrics_path(run_dir) -> Path:
    """``RUN/metrics.jsonl``."""
    return Path(run_dir) / METRICS_FILE


def sim_checkpoint_path(run_dir) -> Path:
    """``RUN/sim_checkpoint.npz``: an unfinished ``simulate --train``'s checkpoint."""
    return Path(run_dir) / SIM_CHECKPOINT_FILE


def checkpoints_root(run_dir) -> Path:
    """``RUN/checkpoints``: where a run keeps its checkpoints (a server of a range of the
    vector in a folder below it: ``shape.Server.checkpoint_dir``)."""
    return Path(run_dir) / CHECKPOINT_DIR


def server_dir(run_dir, index: int | None) -> Path:
    """Where a parameter server writes its ``weights.npy``, ``ps_final.json`` and
    ``arrivals.bin``: ``RUN`` for the only server (``index`` None), ``RUN/servers/server-I``
    for server ``index`` of a sharded run."""
    if index is None:
        return Path(run_dir)
    return Path(run_dir) / SERVERS_DIR / f"server-{index}"


def log_dir(run_dir) -> Path:
    """``RUN/logs``."""
    return Path(run_dir) / LOG_DIR


def log_path(run_dir, label: str) -> Path:
    """``RUN/logs/LABEL.log``: the output of the role ``label`` (``ps``, ``learner0``, ...)."""
    return log_dir(run_dir) / f"{label}.log"


def env_path(run_dir, label: str) -> Path:
    """``RUN/.env-LABEL.json``: what ``launch --launcher pdsh`` gives the remote guard of
    the role ``label`` (pdsh forwards no stdin)."""
    return Path(run_dir) / f".env-{label}.json"


__all__ = [
    "CONFIG_FILE",
    "METRICS_FILE",
    "SUMMARY_FILE",
    "WEIGHTS_FILE",
    "PS_FINAL_FILE",
    "ARRIVALS_FILE",
    "CHECKPOINT_DIR",
    "SERVERS_DIR",
    "TOLD_FILE",
    "LOG_DIR",
    "PROCESSES_FILE",
    "KEYS_DIR",
    "TB_DIR",
    "POINT_FILE",
    "SWEEP_LOG",
    "SWEEP_FILE",
    "SIM_CHECKPOINT_FILE",
    "LAUNCH_ID_FILE",
    "config_path",
    "metrics_path",
    "checkpoints_root",
    "server_dir",
    "log_dir",
    "log_path",
    "env_path",
]
