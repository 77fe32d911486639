"""Whole Rudra-adv runs: the root PS, the tree nodes and the learners of architecture.kind=adv
(as threads of this process, tests/inproc.py; a tree node that dies: `rudra-zmq run`, as a
user would), compared with flat Rudra-base runs of the same learners and data."""

import sys

import numpy as np
import pytest

from cluster import kill_during_training, weights_difference
from test_system import DIGITS, ROOT, threaded_run, updates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HARD = [
    *DIGITS,
    "sync.protocol=hardsync",
    "sync.learners=4",
    "sync.batch_size=8",
    "train.epochs=0.25",
    "optimizer.lr=0.05",
]
SOFT = [
    *DIGITS,
    "sync.protocol=softsync",
    "sync.n=2",
    "sync.learners=4",
    "sync.batch_size=8",
    "train.epochs=2",
    "optimizer.lr=0.02",
    "optimizer.lr_policy=staleness",
]
TREE = ["architecture.kind=adv", "architecture.fanout=2"]


@pytest.fixture(scope="module")
def flat_hardsync(tmp_path_factory):
    run_dir, _ = threaded_run(tmp_path_factory.mktemp("flat"), "flat", HARD)
    return run_dir


@pytest.mark.parametrize("depth", [1, 2])
def test_hardsync_through_a_tree_gives_the_weights_of_flat_hardsync(flat_hardsync, tmp_path, depth):
    tree, out = threaded_run(
        tmp_path, f"tree{depth}", [*HARD, *TREE, f"architecture.depth={depth}"]
    )
    assert "tree node 0 (leaf): learners 0,1" in out
    if depth == 2:
        assert "tree node 2 (inner node, level 2): nodes 0,1" in out
    moved, rel = weights_difference(flat_hardsync, tree)
    print(f"depth {depth}: training moved the weights by {moved:.2e}; tree vs flat {rel:.2e}")
    assert rel <= 1e-5, f"relative difference {rel:.2e}"
    u_flat, u_tree = updates(flat_hardsync), updates(tree)
    assert len(u_tree) == len(u_flat) >= 10
    # the root sees every learner gradient, with its own timestamp: σ ≡ 0, 4 per update
    assert all(r["sigmas"] == [0, 0, 0, 0] and r["n_grads"] == 4 for r in u_tree)
    assert not list(tree.glob("*.sock")), "tree nodes remove their ipc sockets"


def test_softsync_through_a_tree_has_the_staleness_of_flat_softsync(tmp_path):
    flat, _ = threaded_run(tmp_path, "flat", SOFT)
    tree, _ = threaded_run(tmp_path, "tree", [*SOFT, *TREE])
    s_flat = np.mean([s for r in updates(flat)[20:] for s in r["sigmas"]])
    s_tree = np.mean([s for r in updates(tree)[20:] for s in r["sigmas"]])
    print(f"2-softsync, λ=4: <σ> flat {s_flat:.2f}, tree (2 leaves of 2) {s_tree:.2f}")
    # n(λ-1)/λ = 1.5 for equal-speed learners (test_tree checks tree = flat event by event,
    # deterministically). Real processes on 2 shared cores are not equal-speed: a clean-clone
    # CI run under load measured flat 1.38 but tree 0.41 (and another flat 0.62, in
    # test_system), so only a loose band is asserted: clearly stale, within λ+1.
    assert 0.25 <= s_flat <= 2.6, s_flat
    assert 0.2 <= s_tree <= 2.6, s_tree
    # c = 2 counts learner gradients: an update holds 2, or 3 when a relay of 2 meets 1 pending
    assert all(2 <= r["n_grads"] <= 3 for r in updates(tree))
    for r in updates(tree):
        assert r["lr"] == pytest.approx(0.02 / max(r["mean_sigma"], 1.0), rel=1e-12)


def test_without_restarts_a_tree_node_that_dies_stops_the_run_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "dies"
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "run",
        str(ROOT / "configs/quickstart.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    for o in [*HARD, *TREE, "train.epochs=1000", "runtime.restart=false"]:
        cmd += ["--set", o]
    rc, out, victim = kill_during_training(
        cmd,
        run_dir,
        lambda entries: next((e for e in entries if e["role"] == "node1"), None),
        cwd=ROOT,
    )
    assert rc == 1, out
    assert f"node1 (pid {victim['pid']}) exited with code -9 (SIGKILL)" in out, out
