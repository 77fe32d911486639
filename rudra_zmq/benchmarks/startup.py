"""Start-up of the quickstart: this installation beside another checkout, alternating.

    rudra-zmq bench startup --against /tmp/startup_base [--repeats 5]

Start-up is the time from starting ``rudra-zmq run configs/quickstart.yaml`` to the parameter
server's first update (the first ``update`` record of ``metrics.jsonl``, on the Unix clock of
its ``start`` record), measured from outside so that both sides count the same thing; beside
it, the CPU seconds (user + system) of the whole run, every process included, which depend
much less on other work on the machine (the training and the plots are the same on both
sides, so the difference is start-up). Each repeat runs both sides, in alternating order, with
``train.epochs=1`` (start-up does not depend on the epochs). ``--against`` is a checkout with
its compiled kernels (a ``git worktree add`` of an older commit with ``rudra_zmq/_kernels*.so``
copied in), run with ``PYTHONPATH`` set to it, from its root; this side runs the
``rudra_zmq`` that runs this command. One warm-up run per side first (file cache). Prints one
line per run, then each side's median and the ratio of the medians, and of each repeat's pair.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..run_files import metrics_path
from . import common

CONFIG = "configs/quickstart.yaml"  # a checkout's path; a shipped name where there is none
REPEATS = 5
TIMEOUT_S = 300


def cpu_s() -> float:
    """CPU seconds of every descendant process waited for so far (the launcher's included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def startup_s(root: Path | None, run_dir: Path) -> tuple[float, float]:
    """Run the quickstart (1 epoch) from checkout ``root`` (None: this installation, from the
    run's folder): (seconds from its start to the PS's first update, CPU seconds of the whole
    run). Blocks until the run ends."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = str(root)
    else:
        root = run_dir.parent
    cpu0, began = cpu_s(), time.time()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "run",
            CONFIG,
            "--set",
            "train.epochs=1",
            "--run-dir",
            str(run_dir),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{root}: exit {res.returncode}\n{res.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics_path(run_dir).read_text().splitlines()]
    unix = next(r["unix"] for r in records if r.get("type") == "start")
    first = min(r["t"] for r in records if r.get("type") == "update")
    return unix + first - began, cpu_s() - cpu0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--against",
        required=True,
        type=Path,
        metavar="CHECKOUT",
        help="the checkout to compare with (its kernels built or copied in)",
    )
    p.add_argument(
        "--repeats", type=int, default=REPEATS, help=f"pairs of runs (default {REPEATS})"
    )


def run(args) -> int:
    """Handler of ``rudra-zmq bench startup``; blocks for every run (about 2 x (repeats + 1)
    quickstart runs of one epoch)."""
    if not (args.against / "rudra_zmq").is_dir():
        raise ValueError(f"--against {str(args.against)!r} is not a rudra_zmq checkout")
    print(common.kernels_line(), flush=True)
    sides = {"base": args.against.resolve(), "new": None}
    times: dict[str, list[float]] = {name: [] for name in sides}
    cpus: dict[str, list[float]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="rudra-startup-") as tmp:
        n = 0
        for root in sides.values():  # warm-up: the file cache, the digits cache
            n += 1
            startup_s(root, Path(tmp) / f"run{n}")
        for i in range(args.repeats):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                n += 1
                s, cpu = startup_s(sides[name], Path(tmp) / f"run{n}")
                times[name].append(s)
                cpus[name].append(cpu)
                load = os.getloadavg()[0]
                print(
                    f"repeat {i}  {name:4}  start-up {s:5.2f} s  run's CPU {cpu:5.2f} s  "
                    f"(load average {load:.1f})",
                    flush=True,
                )
    for what, got in (("start-up", times), ("run's CPU", cpus)):
        med = {name: statistics.median(v) for name, v in got.items()}
        pairs = [b / a for a, b in zip(got["new"], got["base"])]
        print(
            f"median {what}: base {med['base']:.2f} s, new {med['new']:.2f} s; "
            f"base/new {med['base'] / med['new']:.2f}x (per repeat: "
            f"{', '.join(f'{r:.2f}' for r in pairs)})"
        )
    return 0
