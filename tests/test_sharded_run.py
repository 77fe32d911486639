"""``architecture.servers`` under ``rudra-zmq run``: K parameter servers, each serving one range
of the flat vector, their EVAL slices joined by the statistics server, their files per server
and the run's assembled from them, a killed server restarted from its range's checkpoint."""

import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from fault_runs import FAST, ROOT, Run, records

pytestmark = pytest.mark.timeout(300)

HARDSYNC = ["sync.protocol=hardsync", "sync.learners=2", "train.epochs=3"]


def run(tmp_path, name, overrides):
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs" / "quickstart.yaml")]
        + ["--run-dir", str(tmp_path / name)]
        + [a for o in overrides for a in ("--set", o)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp_path / name, out.stdout


def test_hardsync_with_two_servers_ends_with_one_servers_weights_and_resumes_per_server(tmp_path):
    one, _ = run(tmp_path, "k1", HARDSYNC)
    two, out = run(tmp_path, "k2", [*HARDSYNC, "architecture.servers=2"])
    w1, w2 = np.load(one / "weights.npy"), np.load(two / "weights.npy")
    assert w1.shape == w2.shape
    # two gradients per update: their sum is the same in either order; only torch's own
    # float order could differ between the runs
    assert np.abs(w1 - w2).max() <= 1e-5 * np.abs(w1).max()
    assert not np.array_equal(w1, np.load(two / "servers" / "server-0" / "weights.npy"))
    parts = [np.load(two / "servers" / f"server-{i}" / "weights.npy") for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), w2)  # the run's, joined in order
    final = json.loads((two / "ps_final.json").read_text())
    assert final["done"] and len(final["servers"]) == 2
    assert {f["timestamp"] for f in final["servers"]} == {final["timestamp"]}
    evals = records(two, "eval")
    assert [e["epoch"] for e in evals] == pytest.approx([0, 1, 2, 3], abs=0.1)
    assert all(len(e["server_ts"]) == 2 and e["ts"] == e["server_ts"][0] for e in evals)
    assert {d["server"] for d in records(two, "done")} == {0, 1}
    ups = records(two, "update")
    assert {u["server"] for u in ups} == {0, 1}
    assert len(ups) == 2 * len(records(one, "update"))  # each server's own records
    ranges = sorted(p.name for p in (two / "checkpoints").iterdir())
    assert len(ranges) == 2 and all(r.startswith("range-") for r in ranges)
    assert "result: test error" in out and "per server 0.00, 0.00" in out
    assert final["epoch"] >= 3 and f"{100 * evals[-1]['test_error']:.2f}%" in out
    # resumed to train on: each server from its own range's newest checkpoint
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", "--resume", str(two), "--set", "train.epochs=4"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    again = json.loads((two / "ps_final.json").read_text())
    assert again["epoch"] >= 4 and again["timestamp"] > final["timestamp"]
    assert [f["incarnation"] for f in again["servers"]] == [2, 2]
    assert {r["server"] for r in records(two, "restart")} == {0, 1}
    assert records(two, "eval")[-1]["epoch"] >= 4 and "result: test error" in out.stdout


def test_adv_trees_relay_per_range_and_hardsync_ends_with_one_servers_weights(tmp_path):
    """Rudra-adv with two servers: one tree per range (leaves and an inner node each), each
    relaying its range to its own server; hardsync ends where one server's tree ends."""
    adv = [*HARDSYNC, "sync.learners=4", "architecture.kind=adv", "architecture.depth=2"]
    adv += ["architecture.fanout=2", "train.epochs=2"]
    one, _ = run(tmp_path, "adv1", adv)
    two, out = run(tmp_path, "adv2", [*adv, "architecture.servers=2"])
    w1, w2 = np.load(one / "weights.npy"), np.load(two / "weights.npy")
    assert np.abs(w1 - w2).max() <= 1e-5 * np.abs(w1).max()
    logs = sorted(p.stem for p in (two / "logs").glob("node*.log"))
    assert logs == ["node0", "node0s1", "node1", "node1s1", "node2", "node2s1"]
    relays = [
        line
        for name in logs
        for line in (two / "logs" / f"{name}.log").read_text().splitlines()
        if "relays carrying" in line and "0 refused" in line
    ]
    assert len(relays) == 6  # every node of both trees relayed, nothing refused
    assert "per server 0.00, 0.00" in out and "result: test error" in out


def test_softsync_with_three_servers_trains_to_the_end_with_a_sigma_per_server(tmp_path):
    d, out = run(tmp_path, "k3", ["train.epochs=4", "architecture.servers=3"])
    final = json.loads((d / "ps_final.json").read_text())
    assert len(final["servers"]) == 3 and all(f["done"] for f in final["servers"])
    assert records(d, "eval")[-1]["test_error"] < 0.2  # it learned the digits
    sigmas = {
        k: [s for u in records(d, "update") if u["server"] == k for s in u["sigmas"]]
        for k in range(3)
    }
    assert all(sigmas[k] for k in range(3))
    line = next(x for x in out.splitlines() if x.startswith("result:"))
    assert "per server " + ", ".join(f"{np.mean(sigmas[k]):.2f}" for k in range(3)) in line
    report = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "report", str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # its tables and figures go here
    )
    assert " / ".join(f"{np.mean(sigmas[k]):.2f}" for k in range(3)) in report.stdout


def test_a_killed_server_restarts_from_its_ranges_checkpoint_and_the_run_ends(tmp_path):
    crash = {"PS_CRASH_AT": "checkpoint", "PS_CRASH_TS": "20", "PS_CRASH_SHARD": "1"}
    r = Run(
        tmp_path,
        "killed",
        [*FAST, *HARDSYNC, "train.epochs=4", "architecture.servers=2"]
        + ["train.checkpoint_every_updates=10", "train.eval_every_epochs=1"],
        crash=crash,
    )
    assert r.finish(timeout=240) == 0, r.out
    assert "restarting ps1 from its newest checkpoint" in r.out, r.out
    final = json.loads((r.dir / "ps_final.json").read_text())
    assert [f["incarnation"] for f in final["servers"]] == [1, 2]
    restarts = records(r.dir, "restart")
    assert [x["server"] for x in restarts] == [1] and restarts[0]["ts"] == 20
    assert "result: test error" in r.out
    assert records(r.dir, "eval")[-1]["epoch"] >= 4


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["architecture.servers=0"], "architecture.servers must be >= 1, got 0"),
        (["architecture.servers=2", "architecture.kind=advstar"], "adv* broadcast serves one root"),
        (
            ["architecture.servers=2", "architecture.kind=adv", "architecture.leaf_shm=true"],
            "architecture.leaf_shm with architecture.servers=2",
        ),
        (["architecture.servers=100000"], "more than the model's 9,930 parameters"),
    ],
)
def test_bad_server_counts_stop_before_anything_starts(tmp_path, overrides, says):
    out = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", str(ROOT / "configs" / "quickstart.yaml")]
        + ["--run-dir", str(tmp_path / "bad")]
        + [a for o in overrides for a in ("--set", o)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2 and says in out.stderr, out.stdout + out.stderr
    assert not (tmp_path / "bad").exists()


def test_a_frozen_learner_is_evicted_by_each_server_then_rejoins_each(tmp_path):
    """As test_fault_learners' freeze, with two servers: each evicts the two frozen learners
    on its own (λ 4 -> 2) and takes them back when they rejoin it (λ 2 -> 4)."""
    r = Run(
        tmp_path,
        "frozen",
        [*FAST, "sync.protocol=softsync", "train.epochs=50", "architecture.servers=2"]
        + ["runtime.learner_timeout_s=1", "runtime.learners_per_process=2"],
    )
    r.wait_learners({0, 1})
    r.signal("learner0-1", signal.SIGSTOP)
    for server in ("ps", "ps1"):
        r.wait_log(server, ["learner 0 evicted", "learner 1 evicted"])
    r.signal("learner0-1", signal.SIGCONT)
    assert r.finish() == 0, r.out
    for server in (0, 1):
        events = [
            (x["event"], x["learners"]) for x in records(r.dir, "members") if x["server"] == server
        ]
        assert events == [("evicted", 3), ("evicted", 2), ("joined", 3), ("joined", 4)], events
    log = (r.dir / "logs" / "learner0-1.log").read_text()
    for learner in (0, 1):  # each server's "rejoin" may come in a step of its own
        said = re.findall(rf"learner {learner}: rejoining servers \[([0-9, ]+)\]", log)
        assert {int(k) for ks in said for k in ks.split(",")} == {0, 1}, log


def test_the_model_size_comes_from_a_child_process_when_it_is_not_cached(monkeypatch):
    from rudra_zmq.config import ConfigError, load_config
    from rudra_zmq.launch import preflight
    from rudra_zmq.server import initial_weights

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    monkeypatch.setattr(initial_weights, "read", lambda *a: None)
    assert preflight.model_numel(cfg) == 9930  # built in a child process
    monkeypatch.setattr(preflight, "_SIZE", "import sys; sys.exit('no torch here')")
    with pytest.raises(ConfigError, match="could not build model.name='digits_cnn': no torch"):
        preflight.model_numel(cfg)


@pytest.mark.parametrize("point", ["after-final", "after-final-unsent"])
def test_a_server_that_dies_after_its_own_final_files_still_leaves_the_runs_weights(
    tmp_path, point
):
    """Without restarts, server 1 killed right after writing its ps_final.json (before it
    could join the servers' weights): the run ends with a result, and the launcher joins the
    run's weights.npy from the two servers' files. after-final-unsent: its "done" and final
    EVAL never reached the statistics server (on a loaded host the kill lands before ZeroMQ
    sent them), which evaluates the joined file at once, not after a 60 s wait."""
    crash = {"PS_CRASH_AT": point, "PS_CRASH_SHARD": "1"}
    r = Run(
        tmp_path,
        "late",
        [*FAST, *HARDSYNC, "architecture.servers=2", "runtime.restart=false"],
        crash=crash,
    )
    assert r.finish(timeout=240) == 0, r.out
    assert "ps1 failed after training ended" in r.out and "result: test error" in r.out, r.out
    assert "did not finish within" not in r.out, r.out
    parts = [np.load(r.dir / "servers" / f"server-{i}" / "weights.npy") for i in (0, 1)]
    np.testing.assert_array_equal(np.concatenate(parts), np.load(r.dir / "weights.npy"))
    assert len(json.loads((r.dir / "ps_final.json").read_text())["servers"]) == 2
