"""SIGTERM a learner process in the middle of its learners' steps, again and again, under
``rudra-zmq run``, and count how often it aborts with "terminate called without an active
exception" instead of exiting (docs/fault-tolerance.md, "Stopping a learner process").

A learner process of ``runtime.learners_per_process`` = 2 runs its learners as threads. On
SIGTERM its main thread stops them (``learner._end_threads``: at most ``_END_THREADS_S``) and
returns; a learner thread still inside torch then (a long step: here the digits quickstart
with µ = ``--batch`` samples: a step of about 10 s) is a daemon thread of an interpreter that is
finalizing: when it comes back for the GIL, CPython ends it with ``pthread_exit``, whose
unwinding through torch's C++ frames calls ``std::terminate``. The launcher restarts the
learner (``runtime.max_restarts`` is set above the tries) and the script kills it again once
its new learners are back in a step.

    python tests/sigterm_stress.py [TRIES] [--batch MU]   # ~15 s a try on 2 cores

Prints one line per try (the process's exit, from the launcher's output) and the count of
aborts; exits 1 if there was any. Owns its run directory (a temporary one) and its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABEL = "learner0-1"  # the process of learners 0 and 1 (threads)


def learner_pid(run_dir: Path) -> int | None:
    """The pid ``processes.json`` gives the learner process (the launcher rewrites it when it
    restarts one)."""
    try:
        rows = json.loads((run_dir / "processes.json").read_text())
    except (OSError, ValueError):
        return None
    pids = [r["pid"] for r in rows if r.get("role") == LABEL]
    return pids[-1] if pids else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(what, timeout_s: float, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := what():
            return got
        time.sleep(every_s)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tries", type=int, nargs="?", default=20)
    ap.add_argument("--batch", type=int, default=80000, help="µ: samples per learner step")
    ap.add_argument("--seed", type=int, default=0, help="of the delays before each SIGTERM")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="sigterm-stress-") as tmp:
        run_dir = Path(tmp) / "run"
        sets = [
            f"sync.batch_size={args.batch}",
            "runtime.learners_per_process=2",
            "runtime.threads_per_learner=1",
            f"runtime.max_restarts={args.tries + 5}",
            "runtime.learner_timeout_s=0",  # a learner being restarted is not evicted
            "train.epochs=1000000",
            "train.eval_every_epochs=0",
            "train.checkpoint_every_s=0",
        ]
        out = open(Path(tmp) / "launcher.log", "w+")  # noqa: SIM115 -- read as it grows
        launcher = subprocess.Popen(
            [sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs/quickstart.yaml")]
            + ["--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        aborts = 0
        try:
            for k in range(args.tries):
                pid = wait_for(lambda: learner_pid(run_dir), 120)
                log = run_dir / "logs" / f"{LABEL}.log"
                # its learners are stepping once learner 0 reported a step after its start
                done = _steps(run_dir)
                wait_for(lambda n=done: _steps(run_dir) > n, 180)
                time.sleep(rng.uniform(0.5, 3.0))  # somewhere inside the next step (seconds)
                os.kill(pid, signal.SIGTERM)
                wait_for(lambda p=pid: not alive(p), 60)
                said = wait_for(lambda p=pid: _exit_line(out, p), 30) or "exit not seen"
                aborted = "SIGABRT" in said or "terminate called" in _tail(log)
                aborts += aborted
                print(f"try {k + 1}: {said}{'  ABORTED' if aborted else ''}", flush=True)
                wait_for(lambda p=pid: learner_pid(run_dir) not in (None, p), 60)
        finally:
            launcher.send_signal(signal.SIGINT)
            try:
                launcher.wait(120)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    print(f"sigterm stress: {aborts} of {args.tries} SIGTERMs aborted the learner process")
    return 1 if aborts else 0


def _steps(run_dir: Path) -> int:
    """How many ``learner`` records of learner 0 the metrics hold (one per step or so)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text(errors="replace")
    except OSError:
        return 0
    return len(re.findall(r'"type":"learner","learner":0,', text))


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:]
    except OSError:
        return ""


def _exit_line(out, pid: int) -> str | None:
    """The launcher's line about the learner process's exit, if it has printed it."""
    out.flush()
    out.seek(0)
    lines = [ln.strip() for ln in out.read().splitlines() if f"(pid {pid})" in ln]
    return lines[-1] if lines else None


if __name__ == "__main__":
    sys.exit(main())
