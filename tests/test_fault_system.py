"""Runs that survive failures, with real processes under `rudra-zmq run`: roles killed with
SIGKILL or frozen with SIGSTOP during training, the PS restarted from its checkpoint, a run
resumed after a crash. Each test states its bound (the run's wall time on 2 cores is ~15 s).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cluster import gone

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

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
        return max((r.get("ts", 0) for r in records(run_dir) if r["type"] in ("ps", "update")),
                   default=0)
    except (OSError, ValueError):   # not there yet, or a line half written
        return 0


def pid_of(run_dir, label) -> int:
    rows = json.loads((run_dir / "processes.json").read_text())
    return [r["pid"] for r in rows if r["role"] == label][-1]   # the newest (after restarts)


class Run:
    """A ``rudra-zmq run`` in the background; ``finish()`` waits for it (bounded)."""

    def __init__(self, tmp_path, name, overrides, config="quickstart.yaml", resume=False):
        self.dir = tmp_path / name
        cmd = [sys.executable, "-m", "rudra_zmq", "run"]
        cmd += ["--resume", str(self.dir)] if resume else [str(ROOT / "configs" / config),
                                                           "--run-dir", str(self.dir)]
        for o in overrides:
            cmd += ["--set", o]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT)

    def wait_ts(self, ts, timeout=90):
        """Block until the PS reported timestamp ``ts`` (at most ``timeout`` s)."""
        deadline = time.time() + timeout
        while newest_ts(self.dir) < ts:
            assert self.proc.poll() is None, self.proc.communicate()[0]
            assert time.time() < deadline, f"timestamp {ts} not reached in {timeout} s"
            time.sleep(0.1)

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


@pytest.mark.parametrize("protocol", ["hardsync", "softsync"])
def test_a_killed_learner_no_longer_ends_the_run(tmp_path, protocol):
    """Without restarts: the PS evicts the dead learners (one process of two) after
    runtime.learner_timeout_s and the run finishes with λ=2 (c=2 for hardsync and
    1-softsync), reported in metrics."""
    run = Run(tmp_path, protocol, [*FAST, f"sync.protocol={protocol}", "train.epochs=10",
                                   "runtime.restart=false", "runtime.learner_timeout_s=2",
                                   "runtime.learners_per_process=2"])
    run.wait_ts(10)
    run.signal("learner2-3", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "learner2-3 is left out (runtime.restart is off)" in run.out
    left = [(r["learner"], r["event"], r["learners"], r["c"]) for r in records(run.dir, "members")]
    assert sorted(left) == [(2, "evicted", 2, 2), (3, "evicted", 3, 3)] or \
        sorted(left) == [(2, "evicted", 3, 3), (3, "evicted", 2, 2)], left
    assert records(run.dir, "done")[0]["epoch"] >= 10


def test_a_frozen_learner_is_evicted_then_rejoins(tmp_path):
    """SIGSTOP of a process of two learners for 3x the progress timeout (1 s), then SIGCONT:
    both evicted (λ 4 -> 2), their stale pushes refused, and they rejoin (λ 2 -> 4)."""
    run = Run(tmp_path, "frozen", [*FAST, "sync.protocol=softsync", "train.epochs=30",
                                   "runtime.learner_timeout_s=1", "runtime.learners_per_process=2"])
    run.wait_ts(10)
    run.signal("learner0-1", signal.SIGSTOP)
    time.sleep(3)
    run.signal("learner0-1", signal.SIGCONT)
    assert run.finish() == 0, run.out
    events = [(r["event"], r["learners"]) for r in records(run.dir, "members")]
    assert events == [("evicted", 3), ("evicted", 2), ("joined", 3), ("joined", 4)], events
    assert records(run.dir, "done")[0]["invalid"] >= 2      # the stale pushes, refused
    log = (run.dir / "logs" / "learner0-1.log").read_text()
    assert "learner 0: rejoining" in log and "learner 1: rejoining" in log


def test_learner_data_and_stats_servers_killed_are_restarted_and_the_run_finishes(tmp_path):
    """One run, three SIGKILLs (learner, data server, statistics server): each is restarted,
    learners ask the new data server again for what was lost, metrics.jsonl goes on with the
    run's clock."""
    run = Run(tmp_path, "roles", [*FAST, "train.epochs=30", "train.eval_every_epochs=10",
                                  "runtime.learners_per_process=2"])
    for ts, label in ((10, "learner2-3"), (100, "data"), (200, "stats")):
        run.wait_ts(ts)
        run.signal(label, signal.SIGKILL)
        time.sleep(0.5)
    assert run.finish() == 0, run.out
    for label in ("learner2-3", "data", "stats"):
        assert f"restarting {label} (1 of at most 3)" in run.out
    starts = records(run.dir, "start")
    assert len(starts) == 1     # the restarted stats server kept the run's clock
    assert records(run.dir, "done")[0]["epoch"] >= 30


def test_a_killed_ps_restarts_from_its_checkpoint_losing_at_most_the_updates_since(tmp_path):
    """SIGKILL of the PS (checkpoints every 20 updates): restarted with a new incarnation,
    every learner rejoins, at most 20 updates are lost (reported), the run finishes."""
    run = Run(tmp_path, "ps", [*FAST, "sync.protocol=async", "train.epochs=20",
                               "train.checkpoint_every_updates=20",
                               "runtime.learners_per_process=2"])
    run.wait_ts(100)
    run.signal("ps", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "restarting ps from its newest checkpoint (1 of at most 3)" in run.out
    (restart,) = records(run.dir, "restart")
    done = records(run.dir, "done")[0]
    assert restart["ts"] >= 100 - 20 and restart["incarnation"] == 2
    assert 0 <= done["lost_updates"] <= 20 and done["epoch"] >= 20
    for label in ("learner0-1", "learner2-3"):
        assert "rejoining" in (run.dir / "logs" / f"{label}.log").read_text()
    assert np.isfinite(np.load(run.dir / "weights.npy")).all()


def test_a_hardsync_run_killed_and_resumed_ends_with_the_same_weights(tmp_path):
    """λ=2 hardsync: a run whose PS is killed (no restarts), then `run --resume`d from a
    checkpoint whose newest copy was bit-flipped, ends with weights bit-identical to an
    uninterrupted run's (same data order, same augmentation-free batches)."""
    common = ["train.eval_every_epochs=0", "sync.protocol=hardsync", "sync.learners=2",
              "train.epochs=5", "train.checkpoint_every_updates=10", "runtime.retry_s=1"]
    whole = Run(tmp_path, "whole", common)
    assert whole.finish() == 0, whole.out
    cut = Run(tmp_path, "cut", [*common, "runtime.restart=false"])
    cut.wait_ts(60)
    cut.signal("ps", signal.SIGKILL)
    assert cut.finish() == 1, cut.out
    newest = sorted((cut.dir / "checkpoints").iterdir())[-1]
    w = newest / "w.npy"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x10                                 # one flipped bit in the weights
    w.write_bytes(bytes(data))
    with pytest.raises(subprocess.CalledProcessError):   # reusing it without --resume
        subprocess.run([sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs/quickstart.yaml"),
                        "--run-dir", str(cut.dir)], check=True, capture_output=True, cwd=ROOT)
    resumed = Run(tmp_path, "cut", [], resume=True)
    assert resumed.finish() == 0, resumed.out
    log = (cut.dir / "logs" / "ps.log").read_text()
    assert f"{newest}" in log and "sha256 mismatch" in log      # the warning names the file
    (restart,) = records(cut.dir, "restart")
    assert restart["checkpoint"] != str(newest)                  # the previous one was used
    assert len(records(cut.dir, "resume")) == 1
    np.testing.assert_array_equal(np.load(cut.dir / "weights.npy"),
                                  np.load(whole.dir / "weights.npy"))


def test_a_killed_tree_node_is_restarted_and_its_learners_rejoin(tmp_path):
    """Rudra-adv, hardsync: SIGKILL of leaf node 1; it is restarted, learners 2 and 3 rejoin
    it (waiting for their held gradients' update, so nothing is counted twice)."""
    run = Run(tmp_path, "tree", [*FAST, "sync.protocol=hardsync", "train.epochs=10",
                                 "runtime.learners_per_process=2"], config="quickstart_adv.yaml")
    run.wait_ts(20)
    run.signal("node1", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "restarting node1 (1 of at most 3)" in run.out
    assert "rejoining" in (run.dir / "logs" / "learner2-3.log").read_text()
    updates = records(run.dir, "update")
    assert all(r["n_grads"] == 4 for r in updates)   # hardsync: one gradient per learner
    assert sorted(r["ts"] for r in updates) == list(range(1, len(updates) + 1))
    assert all(gone(pid_of(run.dir, label)) for label in ("ps", "node0", "node1"))
