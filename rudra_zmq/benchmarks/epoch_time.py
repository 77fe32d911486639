"""Time per epoch of shipped configs, through the real system on this machine.

Each config runs as ``rudra-zmq run CONFIG`` for a short budget (``--epochs``, no evaluation
during training) and its time per epoch is read from the PS's ``update`` records: the
steady-state window after the first ``--skip`` fraction of updates, (t_last - t_first) /
(epoch_last - epoch_first), so start-up (imports, data loading) is excluded. One line per
config; the full run's time is about that times its ``train.epochs``.

    rudra-zmq bench epoch-time --data ../shared/data/cifar10-jpeg.tar.gz configs/cifar10_*.yaml
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ..run_files import metrics_path
from . import common

EPOCHS = 0.25
SKIP = 0.2
LEARNERS_PER_PROCESS = 10  # 30 learners in 3 processes: one torch import each (memory)


def seconds_per_epoch(metrics: Path, skip: float) -> float | None:
    """Steady-state seconds per epoch from a run's update records, or None if too few."""
    ups = [json.loads(line) for line in metrics.read_text().splitlines() if '"update"' in line]
    ups.sort(key=lambda r: r["ts"])
    ups = ups[int(len(ups) * skip) :]
    if len(ups) < 2 or ups[-1]["epoch"] <= ups[0]["epoch"]:
        return None
    return (ups[-1]["t"] - ups[0]["t"]) / (ups[-1]["epoch"] - ups[0]["epoch"])


def add_arguments(p) -> None:
    p.add_argument("configs", nargs="+", help="config files")
    p.add_argument("--data", required=True, help="CIFAR-10 root (e.g. the JPEG tarball)")
    p.add_argument(
        "--epochs", type=float, default=EPOCHS, help=f"epochs of each run (default {EPOCHS:g})"
    )
    p.add_argument(
        "--skip",
        type=float,
        default=SKIP,
        help=f"fraction of updates left out at the start (default {SKIP:g})",
    )


def run(args) -> int:
    """Run each config in turn (blocks until all end); exit code 1 if any failed."""
    print(common.kernels_line(), flush=True)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(args.configs):
            cfg = yaml.safe_load(Path(path).read_text())
            run_dir = Path(tmp) / f"run{i}"
            cmd = [
                sys.executable,
                "-m",
                "rudra_zmq",
                "run",
                path,
                "--run-dir",
                str(run_dir),
                "--set",
                f"data.root={args.data}",
                "--set",
                f"train.epochs={args.epochs}",
                "--set",
                "train.eval_every_epochs=0",
                "--set",
                f"runtime.learners_per_process={LEARNERS_PER_PROCESS}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            spe = (
                seconds_per_epoch(metrics_path(run_dir), args.skip)
                if proc.returncode == 0
                else None
            )
            if spe is None:
                failed += 1
                print(
                    f"{path}: FAILED (exit {proc.returncode})\n{proc.stdout[-800:]}"
                    f"{proc.stderr[-800:]}",
                    flush=True,
                )
                continue
            epochs = cfg.get("train", {}).get("epochs", 0)
            print(
                f"{path}: {spe:7.1f} s/epoch  ({spe * epochs / 3600:.1f} h for its "
                f"{epochs:g} epochs)",
                flush=True,
            )
    return 1 if failed else 0
