"""A `rudra-zmq run` in the background for the failure tests (test_fault_*.py): start it,
wait for a timestamp, signal one of its processes, read its metrics."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAST = ["train.eval_every_epochs=0", "runtime.timeout_s=60", "runtime.retry_s=1"]


def records(run_dir, kind=None):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "batch":
            out += rec["items"]
        else:
            out.append(rec)
    return [r for r in out if kind is None or r["type"] == kind]


def newest_ts(run_dir) -> int:
    try:
        return max(
            (r.get("ts", 0) for r in records(run_dir) if r["type"] in ("ps", "update")), default=0
        )
    except (OSError, ValueError):  # not there yet, or a line half written
        return 0


def role_pids(run_dir, label=None) -> list[int]:
    """The pids of every process the launcher started for ``label`` (all labels: None), oldest
    first (a restarted role's newest is last), from RUN_DIR/processes.json."""
    rows = json.loads((run_dir / "processes.json").read_text())
    return [r["pid"] for r in rows if label is None or r["role"] == label]


def pid_of(run_dir, label) -> int:
    return role_pids(run_dir, label)[-1]  # the newest (after restarts)


class Run:
    """A ``rudra-zmq run`` in the background; ``finish()`` waits for it (bounded). ``crash``
    (environment for tests/ps_crash.py, e.g. ``{"PS_CRASH_AT": ...}``): its first PS kills
    itself at that point."""

    def __init__(
        self, tmp_path, name, overrides, config="quickstart.yaml", resume=False, crash=None
    ):
        self.dir = tmp_path / name
        env = None
        if crash:
            cmd = [sys.executable, str(ROOT / "tests" / "ps_crash.py"), "run"]
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            env = {**os.environ, **crash, "PYTHONPATH": path}
        else:
            cmd = [sys.executable, "-m", "rudra_zmq", "run"]
        cmd += (
            ["--resume", str(self.dir)]
            if resume
            else [str(ROOT / "configs" / config), "--run-dir", str(self.dir)]
        )
        for o in overrides:
            cmd += ["--set", o]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
        )

    def wait_ts(self, ts, timeout=90):
        """Block until the PS reported timestamp ``ts`` (at most ``timeout`` s)."""
        deadline = time.time() + timeout
        while newest_ts(self.dir) < ts:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.time() < deadline, f"timestamp {ts} not reached in {timeout} s"
            time.sleep(0.1)

    def wait_checkpoint(self, timeout=90):
        """Block until the PS wrote its first checkpoint (at most ``timeout`` s): the PS's own
        word that training is under way, where the metrics (``wait_ts``) can lag it by the
        statistics server's start-up under load."""
        deadline = time.time() + timeout
        while not any((self.dir / "checkpoints").glob("ckpt-*")):
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.time() < deadline, f"no checkpoint written in {timeout} s"
            time.sleep(0.05)

    def wait_learners(self, ids, timeout=90):
        """Block until every learner in ``ids`` reported progress (a ``learner`` record): it
        said HELLO and trains, so the PS's silence rule applies to it."""
        deadline = time.time() + timeout
        while not set(ids) <= {r["learner"] for r in self._records_so_far("learner")}:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.time() < deadline, f"no progress from learners {ids} in {timeout} s"
            time.sleep(0.05)

    def wait_log(self, label, texts, timeout=60):
        """Block until RUN/logs/LABEL.log holds every string in ``texts``."""
        deadline, log = time.time() + timeout, self.dir / "logs" / f"{label}.log"
        while not (log.exists() and all(t in log.read_text() for t in texts)):
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.time() < deadline, f"{log} lacks {texts} after {timeout} s"
            time.sleep(0.05)

    def _records_so_far(self, kind):
        try:
            return records(self.dir, kind)
        except (OSError, ValueError):  # not there yet, or a line half written
            return []

    def signal(self, label, sig):
        pid = pid_of(self.dir, label)
        os.kill(pid, sig)
        return pid

    def finish(self, timeout=120):
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        self.out = out
        return self.proc.returncode
