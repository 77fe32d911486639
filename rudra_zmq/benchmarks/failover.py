"""How fast a run notices and survives failures, measured on whole ``rudra-zmq run``s.

Scenarios (one run each, on the quickstart config unless ``--config``):

- ``dead``: a learner SIGKILLed (``runtime.restart=false``): seconds from the kill to the
  PS's eviction record (the progress timeout ``runtime.learner_timeout_s`` decides);
- ``hung``: a learner SIGSTOPped: the same, for a process whose sockets stay open;
- ``ps``: the PS SIGKILLed (restarts on): seconds from the kill to the next update, and the
  updates lost, with ``runtime.retry_s`` as given (learners send again after it).

Times come from the run's ``metrics.jsonl`` (its ``start`` record anchors the clock).

Examples::

    rudra-zmq bench failover                         # all three, learner timeout 2 s
    rudra-zmq bench failover --scenarios ps --retry-s 1 5
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..run_files import PROCESSES_FILE, metrics_path
from .common import Report, add_output_args

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument(
        "--scenarios", nargs="+", choices=("dead", "hung", "ps"), default=["dead", "hung", "ps"]
    )
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    p.add_argument("--learner-timeout-s", type=float, default=2.0)
    p.add_argument(
        "--retry-s",
        type=float,
        nargs="+",
        default=[1.0, 5.0],
        help="runtime.retry_s values for the ps scenario (default 1 5)",
    )
    p.add_argument("--at-ts", type=int, default=60, help="fail once the PS is this far")
    add_output_args(p)


def _records(run_dir: Path) -> list[dict]:
    out = []
    try:
        lines = metrics_path(run_dir).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        out += rec["items"] if rec.get("type") == "batch" else [rec]
    return out


def _one(config, overrides, label, action, at_ts, pause_s=0.0, timeout=240) -> tuple:
    """Run ``config``, apply ``action`` (a signal) to process ``label`` once the PS reached
    ``at_ts``; returns (records, unix time of the action, output). Blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "rudra_zmq", "run", config, "--run-dir", str(run_dir)]
        for o in overrides:
            cmd += ["--set", o]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + timeout
            while time.time() < deadline:
                recs = _records(run_dir)
                if max((r.get("ts", 0) for r in recs if r["type"] == "update"), default=0) >= at_ts:
                    break
                time.sleep(0.05)
            rows = json.loads((run_dir / PROCESSES_FILE).read_text())
            pid = [r["pid"] for r in rows if r["role"] == label][-1]
            acted = time.time()
            os.kill(pid, action)
            if pause_s:
                time.sleep(pause_s)
                os.kill(pid, signal.SIGCONT)
            out, _ = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return _records(run_dir), acted, out


def _t0(recs) -> float:
    return next(r["unix"] for r in recs if r["type"] == "start")


def run(args) -> int:
    """Print one line per scenario."""
    to = args.learner_timeout_s
    base = [
        "train.eval_every_epochs=0",
        "train.epochs=60",
        f"runtime.learner_timeout_s={to}",
        "train.checkpoint_every_s=1",
    ]
    rep = Report(
        args,
        "failover",
        notes=[
            f"{Path(args.config).name}, epochs 60, runtime.learner_timeout_s={to:g}, checkpoints "
            "every 1 s; times from metrics.jsonl"
        ],
    )
    for sc in args.scenarios:
        if sc in ("dead", "hung"):
            recs, acted, _ = _one(
                args.config,
                [*base, "runtime.restart=false"],
                "learner1",
                signal.SIGKILL if sc == "dead" else signal.SIGSTOP,
                args.at_ts,
                pause_s=3 * to if sc == "hung" else 0.0,
            )
            ev = [r for r in recs if r["type"] == "members" and r["event"] == "evicted"]
            detect = ev[0]["t"] + _t0(recs) - acted if ev else float("nan")
            rec = {
                "scenario": sc,
                "detect_s": detect,
                "timeout_s": to,
                "lambda_after": ev[0]["learners"] if ev else None,
            }
            rep.case(
                rec,
                f"{sc:>5} learner: evicted {detect:5.2f} s after the "
                f"{'SIGKILL' if sc == 'dead' else 'SIGSTOP'} (timeout {to:g} s), "
                f"λ -> {rec['lambda_after']}",
            )
            continue
        for retry in args.retry_s:
            recs, acted, _ = _one(
                args.config, [*base, f"runtime.retry_s={retry}"], "ps", signal.SIGKILL, args.at_ts
            )
            t_act = acted - _t0(recs)
            restart = next((r for r in recs if r["type"] == "restart"), None)
            after = [
                r["t"]
                for r in recs
                if r["type"] == "update"
                and r["t"] > t_act
                and restart is not None
                and r["ts"] > restart["ts"]
            ]
            done = next((r for r in recs if r["type"] == "done"), {})
            rec = {
                "scenario": "ps",
                "retry_s": retry,
                "to_next_update_s": min(after) - t_act if after else float("nan"),
                "to_restart_s": restart["t"] - t_act if restart else float("nan"),
                "lost_updates": done.get("lost_updates"),
            }
            rep.case(
                rec,
                f"   ps crash (retry_s {retry:g}): restarted after "
                f"{rec['to_restart_s']:5.2f} s, next update after "
                f"{rec['to_next_update_s']:5.2f} s, {rec['lost_updates']} updates "
                "lost",
            )
    rep.close()
    return 0
