"""`rudra-zmq worker` with server 1 on a rank of its own (architecture.servers=2), killed in
the last seconds of training or of its shutdown (tests/ps_crash.py): its rank's supervision
restarts it from its range's checkpoint, it tells the learners STOP, and rank 0 still reports
the run's final weights, evaluated."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from cluster import free_port_range
from fault_runs import FAST, ROOT
from rudra_zmq.results.compare import run_summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SETS = [*FAST, "sync.protocol=hardsync", "sync.learners=2", "train.epochs=3"]
SETS += ["architecture.servers=2"]


def _start(
    rank: int, port: int, run_dir, crash: dict | None, restart: str, more=()
) -> subprocess.Popen:
    head = [sys.executable, str(ROOT / "tests" / "ps_crash.py")] if crash else None
    cmd = [*(head or [sys.executable, "-m", "rudra_zmq"]), "worker"]
    cmd += [str(ROOT / "configs" / "quickstart.yaml"), "--rank", str(rank), "--world-size", "4"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--run-dir", str(run_dir)]
    cmd += [a for s in [*SETS, f"runtime.restart={restart}", *more] for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.update(crash or {})
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "point,restart",
    [("stopping", "true"), ("after-final-unsent", "false")],
)
def test_a_server_rank_killed_as_training_ends_is_restarted_and_rank_0_reports(
    tmp_path, point, restart
):
    """stopping: killed at its first STOP (training over, its checkpoint written);
    after-final-unsent, without restarts: right after its final files, its "done" and final
    EVAL never having reached rank 0's statistics server."""
    ranks, outs, said = _run(tmp_path, point, restart)
    assert [p.returncode for p in ranks] == [0, 0, 0, 0], said
    assert "rudra-zmq: ps1 (pid" in outs[1] and "exited with code -9" in outs[1], said
    if restart == "true":
        assert "restarting ps1 from its newest checkpoint" in outs[1], said
    else:
        assert "ps1 failed after training ended" in outs[1], said
    assert "did not finish within" not in outs[0], said
    assert "result: test error" in outs[0], said
    summary = run_summary(tmp_path / "run")
    assert summary["epochs"] >= 3.0 - 1e-6 and summary["final_error"] is not None, summary


def _run(tmp_path, point, restart, more=(), port=None, whole_rank=False):
    """The 4 ranks, server 1's crashing at ``point`` (None: not; ``whole_rank``: its rank's
    launcher killed with it), to their end: (processes, outputs, a text of both for
    assertion messages)."""
    port, run_dir = port or free_port_range(8), tmp_path / "run"
    crash = {"PS_CRASH_AT": point, "PS_CRASH_SHARD": "1"} if point else None
    if whole_rank:
        crash["PS_CRASH_PARENT"] = "1"
    ranks = [_start(r, port, run_dir, crash if r == 1 else None, restart, more) for r in range(4)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    said = "\n".join(
        f"--- rank {r} (exit {p.returncode}):\n{o[-2500:]}"
        for r, (p, o) in enumerate(zip(ranks, outs))
    )
    return ranks, outs, said


def test_a_server_rank_that_fails_for_good_stops_rank_0_and_the_learners_end(tmp_path):
    """Without restarts, server 1 killed at its first STOP (training over, no final files,
    its final EVAL lost: the statistics server cannot end the run): its rank tells rank 0,
    which stops the run with the reason instead of waiting for that server's records
    forever; the learner ranks, told STOP by server 0, end without a failure after
    runtime.timeout_s of silence from server 1. (With its final EVAL sent, rank 0 may also
    end with the result first: a truthful end too, not what this test is about.)"""
    ranks, outs, said = _run(tmp_path, "stopping-unsent", "false", ["runtime.timeout_s=10"])
    assert [p.returncode for p in ranks] == [1, 1, 0, 0], said
    assert (
        "rudra-zmq: server 1 failed on its own rank and cannot go on (ps1 exited with code -9)"
        "; stopping the run" in outs[0]
    ), said
    assert "rank 1: told rank 0 that server 1 cannot go on (ps1 exited with code -9)" in outs[1]
    for out in outs[2:]:
        assert "finished training and [1] has said nothing since" in out, said


def test_a_server_rank_whose_server_cannot_start_stops_rank_0(tmp_path):
    """Server 1's port is taken on its host: its rank's server exits at start-up, the rank
    tells rank 0, which stops the run naming it, instead of waiting for it forever."""
    port = free_port_range(8)
    with socket.socket() as taken:  # ps1 listens at the master port + 3
        taken.bind(("127.0.0.1", port + 3))
        taken.listen()
        ranks, outs, said = _run(tmp_path, None, "false", ["runtime.timeout_s=10"], port)
    assert ranks[0].returncode == 1 and ranks[1].returncode == 1, said
    # ps1 exits before or after the launcher saw its (taken) port accept connections
    why = r"\(it did not start; its rank's output says why\)|\(ps1 exited with code 1\)"
    assert re.search(
        rf"rudra-zmq: server 1 failed on its own rank and cannot go on ({why}); stopping the run",
        outs[0],
    ), said
    assert "Address already in use" in outs[1], said


def test_a_server_rank_lost_whole_after_training_stops_rank_0_once_silent(tmp_path):
    """Server 1's rank killed whole (its launcher first, then its server, at its first STOP,
    its final EVAL lost: the host lost as training ends): nobody reports it, rank 0 stops the
    run once that rank has said nothing for runtime.timeout_s, instead of waiting for its
    records forever."""
    ranks, outs, said = _run(
        tmp_path, "stopping-unsent", "false", ["runtime.timeout_s=10"], whole_rank=True
    )
    assert [p.returncode for p in ranks] == [1, -9, 0, 0], said
    assert re.search(
        r"rudra-zmq: the rank of server 1 \(tcp://127\.0\.0\.1:\d+\) has said nothing for "
        r"10 s \(runtime\.timeout_s\): its host or its launcher is gone; stopping the run",
        outs[0],
    ), said
