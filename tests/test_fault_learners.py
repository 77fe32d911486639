"""Runs that survive failures, with real processes under `rudra-zmq run`: learners killed and frozen, a tree node killed.
Each run takes ~15-25 s on 2 cores; each test states its bound."""

import signal

import pytest

from cluster import gone
from fault_runs import FAST, Run, pid_of, records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.parametrize("protocol", ["hardsync", "softsync"])
def test_a_killed_learner_no_longer_ends_the_run(tmp_path, protocol):
    """Without restarts: the PS evicts the dead learners (one process of two) after
    runtime.learner_timeout_s and the run finishes with λ=2 (c=2 for hardsync and
    1-softsync), reported in metrics."""
    run = Run(
        tmp_path,
        protocol,
        [
            *FAST,
            f"sync.protocol={protocol}",
            "train.epochs=8",
            "runtime.restart=false",
            "runtime.learner_timeout_s=2",
            "runtime.learners_per_process=2",
        ],
    )
    run.wait_ts(10)
    run.signal("learner2-3", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "learner2-3 is left out (runtime.restart is off)" in run.out
    for i in (2, 3):  # the eviction, on the terminal
        assert f"ps: warning: learner {i} sent nothing for 2 s" in run.out, run.out
    left = [(r["learner"], r["event"], r["learners"], r["c"]) for r in records(run.dir, "members")]
    assert sorted(left) == [(2, "evicted", 2, 2), (3, "evicted", 3, 3)] or sorted(left) == [
        (2, "evicted", 3, 3),
        (3, "evicted", 2, 2),
    ], left
    assert records(run.dir, "done")[0]["epoch"] >= 8


def test_a_frozen_learner_is_evicted_then_rejoins(tmp_path):
    """SIGSTOP of a process of two learners until the PS evicts both (progress timeout 1 s),
    then SIGCONT: λ 4 -> 2, their stale pushes refused, and they rejoin (λ 2 -> 4)."""
    # The freeze must fall in training, after both learners said HELLO (one that never did is
    # given runtime.timeout_s, not the progress timeout), and SIGCONT must come before the
    # other two end training alone: their progress records say the first, the PS's log the
    # evictions (a fixed 3 s freeze let them finish first on a fast host). The first progress
    # records come ~1 s into training, and 20 epochs then left ~1 s on a fast host (less than
    # the 1 s timeout and the rejoin): 50 epochs leave several seconds.
    run = Run(
        tmp_path,
        "frozen",
        [
            *FAST,
            "sync.protocol=softsync",
            "train.epochs=50",
            "runtime.learner_timeout_s=1",
            "runtime.learners_per_process=2",
        ],
    )
    run.wait_learners({0, 1})
    run.signal("learner0-1", signal.SIGSTOP)
    run.wait_log("ps", ["learner 0 evicted", "learner 1 evicted"])
    run.signal("learner0-1", signal.SIGCONT)
    assert run.finish() == 0, run.out
    members = [(r["learner"], r["event"], r["learners"]) for r in records(run.dir, "members")]
    evicted = {m[0] for m in members if m[1] == "evicted"}
    # both frozen ones evicted (λ 4 -> 2) and every evicted learner back (λ 4): a learner not
    # frozen may be evicted too, and rejoin the same way, when a loaded host leaves it silent
    # for the 1 s timeout (a fresh-clone suite: learners 0, 1 and one more, λ 4 -> 1 -> 4)
    assert {0, 1} <= evicted and min(m[2] for m in members) <= 2, members
    for learner in evicted:
        last = max(i for i, m in enumerate(members) if m[:2] == (learner, "evicted"))
        assert (learner, "joined") in [m[:2] for m in members[last:]], members
    assert members[-1][2] == 4, members
    assert records(run.dir, "done")[0]["invalid"] >= 2  # the stale pushes, refused
    log = (run.dir / "logs" / "learner0-1.log").read_text()
    assert "learner 0: rejoining" in log and "learner 1: rejoining" in log


def test_a_killed_tree_node_is_restarted_and_its_learners_rejoin(tmp_path):
    """Rudra-adv, hardsync: SIGKILL of leaf node 1; it is restarted, learners 2 and 3 rejoin
    it (waiting for their held gradients' update, so nothing is counted twice)."""
    run = Run(
        tmp_path,
        "tree",
        [*FAST, "sync.protocol=hardsync", "train.epochs=10", "runtime.learners_per_process=2"],
        config="quickstart_adv.yaml",
    )
    run.wait_ts(20)
    run.signal("node1", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "restarting node1 (1 of at most 3)" in run.out
    assert "rejoining" in (run.dir / "logs" / "learner2-3.log").read_text()
    updates = records(run.dir, "update")
    assert all(r["n_grads"] == 4 for r in updates)  # hardsync: one gradient per learner
    assert sorted(r["ts"] for r in updates) == list(range(1, len(updates) + 1))
    assert all(gone(pid_of(run.dir, label)) for label in ("ps", "node0", "node1"))
