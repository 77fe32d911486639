"""Runs that survive failures, with real processes under `rudra-zmq run`: the data, statistics and parameter servers killed and restarted, a hardsync run killed
and resumed.
Each run takes ~15-25 s on 2 cores; each test states its bound."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fault_runs import FAST, ROOT, Run, records
from rudra_zmq.server.checkpoint import list_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_learner_data_and_stats_servers_killed_are_restarted_and_the_run_finishes(tmp_path):
    """One run, three SIGKILLs (learner, data server, statistics server): each is restarted,
    learners ask the new data server again for what was lost, metrics.jsonl goes on with the
    run's clock."""
    run = Run(
        tmp_path,
        "roles",
        [*FAST, "train.epochs=20", "train.eval_every_epochs=10", "runtime.learners_per_process=2"],
    )
    for ts, label in ((10, "learner2-3"), (80, "data"), (160, "stats")):
        run.wait_ts(ts)
        run.signal(label, signal.SIGKILL)
        time.sleep(0.5)
    assert run.finish() == 0, run.out
    for label in ("learner2-3", "data", "stats"):
        assert f"restarting {label} (1 of at most 3)" in run.out
    starts = records(run.dir, "start")
    assert len(starts) == 1  # the restarted stats server kept the run's clock
    assert records(run.dir, "done")[0]["epoch"] >= 20


def test_a_killed_ps_restarts_from_its_checkpoint_losing_at_most_the_updates_since(tmp_path):
    """SIGKILL of the PS (checkpoints every 20 updates): restarted with a new incarnation,
    every learner rejoins, at most 20 updates are lost (reported), the run finishes."""
    run = Run(
        tmp_path,
        "ps",
        [
            *FAST,
            "sync.protocol=async",
            "train.epochs=20",
            "train.checkpoint_every_updates=20",
            "runtime.learners_per_process=2",
        ],
    )
    run.wait_ts(100)
    run.signal("ps", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "restarting ps from its newest checkpoint (1 of at most 3)" in run.out
    (restart,) = records(run.dir, "restart")
    done = records(run.dir, "done")[0]
    assert restart["ts"] >= 100 - 20 and restart["incarnation"] == 2
    assert 0 <= done["lost_updates"] <= 20 and done["epoch"] >= 20
    assert ("updates lost in the restart" in run.out) == (done["lost_updates"] > 0), run.out
    for label in ("learner0-1", "learner2-3"):
        assert "rejoining" in (run.dir / "logs" / f"{label}.log").read_text()
    assert np.isfinite(np.load(run.dir / "weights.npy")).all()


def test_a_hardsync_run_killed_and_resumed_ends_with_the_same_weights(tmp_path):
    """λ=2 hardsync: a run whose PS is killed (no restarts), then `run --resume`d from a
    checkpoint whose newest copy was bit-flipped, ends with weights bit-identical to an
    uninterrupted run's (same data order, same augmentation-free batches; the uninterrupted
    one runs its roles as threads, tests/inproc.py, which computes the same)."""
    from inproc import run_in_threads

    common = [
        "train.eval_every_epochs=0",
        "sync.protocol=hardsync",
        "sync.learners=2",
        "train.epochs=3",
        "train.checkpoint_every_updates=10",
        "runtime.retry_s=1",
    ]
    whole, _ = run_in_threads(ROOT / "configs/quickstart.yaml", common, tmp_path / "whole")
    # The PS kills itself right after its checkpoint at timestamp 40 (of 135): a kill from
    # outside at a timestamp could land after the end on a fast host (3 epochs in 0.5 s).
    crash = {"PS_CRASH_AT": "checkpoint", "PS_CRASH_TS": "40"}
    cut = Run(tmp_path, "cut", [*common, "runtime.restart=false"], crash=crash)
    assert cut.finish() == 1, cut.out
    assert "ps (pid" in cut.out and "SIGKILL" in cut.out, cut.out
    newest = list_checkpoints(cut.dir / "checkpoints")[0]
    assert newest.name == "ckpt-00000004", list(cut.dir.glob("checkpoints/*"))
    w = newest / "w.npy"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x10  # one flipped bit in the weights
    w.write_bytes(bytes(data))
    with pytest.raises(subprocess.CalledProcessError):  # reusing it without --resume
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rudra_zmq",
                "run",
                str(ROOT / "configs/quickstart.yaml"),
                "--run-dir",
                str(cut.dir),
            ],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
    resumed = Run(tmp_path, "cut", [], resume=True)
    assert resumed.finish() == 0, resumed.out
    log = (cut.dir / "logs" / "ps.log").read_text()
    assert f"{newest}" in log and "sha256 mismatch" in log  # the warning names the file
    assert f"ps: warning: checkpoint {newest} is damaged" in resumed.out  # on the terminal
    (restart,) = records(cut.dir, "restart")
    assert restart["checkpoint"] != str(newest)  # the previous one was used
    assert len(records(cut.dir, "resume")) == 1
    np.testing.assert_array_equal(np.load(cut.dir / "weights.npy"), np.load(whole / "weights.npy"))


def test_a_statistics_server_killed_near_the_end_still_reports_the_final_weights(tmp_path):
    """SIGKILL of the statistics server a few epochs before the end (40 epochs, an EVAL
    each): training ends while it restarts (~5 s), and the result line is still the test
    error of the final weights, with an evaluation at the PS's final timestamp."""
    run = Run(tmp_path, "late", ["runtime.timeout_s=60", "runtime.retry_s=1", "train.epochs=40"])
    run.wait_ts(700, timeout=180)  # of ~900; the records trail by up to a second
    run.signal("stats", signal.SIGKILL)
    assert run.finish() == 0, run.out
    assert "restarting stats (1 of at most 3)" in run.out
    final = json.loads((run.dir / "ps_final.json").read_text())
    assert final["done"] and final["epoch"] >= 40
    at_end = [e for e in records(run.dir, "eval") if e["ts"] == final["timestamp"]]
    assert at_end, f"no evaluation of the final weights (ts {final['timestamp']})\n{run.out}"
    result = [line for line in run.out.splitlines() if line.startswith("result: ")]
    assert result == [result[0]] and result[0].startswith(
        f"result: test error {100 * at_end[-1]['test_error']:.2f}% (best "
    ), run.out
    assert f"after {final['epoch']:.2f} epochs in " in result[0]
