"""A parameter server killed (SIGKILL) at any point of its shutdown: the launcher restarts it
and the run ends with its result within seconds, not after ``runtime.timeout_s``.

Each run is the quickstart under ``rudra-zmq run`` (real processes) with
``runtime.timeout_s=600``; the PS's first incarnation kills itself at a named point
(``tests/ps_crash.py``; more points there): at the third STOP (training over, its checkpoint
written, two learners told and gone), right after it handed the "done" record to ZeroMQ, and
right after it wrote ``ps_final.json`` (the statistics server may have finished by then). The bound is this test's own: a restarted PS that
waited for learners already told, or for a statistics server that has gone, would take
``runtime.timeout_s`` (600 s) and fail it; a clean run takes 40-80 s on a loaded 2-core
machine, the restart ~10-20 s more.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from fault_runs import ROOT, records
from rudra_zmq.run_files import TOLD_FILE
from rudra_zmq.security import auth
from rudra_zmq.server.checkpointing import ToldRecord

pytestmark = pytest.mark.timeout(300)
BOUND_S = 240  # far below runtime.timeout_s (600): a stall fails the run's wait


def crashed_run(tmp_path, point, stop=1, extra=()):
    run_dir = tmp_path / point
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "ps_crash.py"),
        "run",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--run-dir",
        str(run_dir),
    ]
    for o in (
        "train.epochs=2",
        "train.eval_every_epochs=1",
        "runtime.timeout_s=600",
        "runtime.retry_s=1",
        "runtime.learners_per_process=4",
        *extra,
    ):
        cmd += ["--set", o]
    env = {
        **os.environ,
        "PS_CRASH_AT": point,
        "PS_CRASH_STOP": str(stop),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # the launcher's roles follow it (parent-death signal)
        out, _ = proc.communicate()
        pytest.fail(f"the run did not end within {BOUND_S} s after a PS crash at {point!r}:\n{out}")
    return proc.returncode, out, run_dir


@pytest.mark.slow
@pytest.mark.parametrize("point,stop", [("stopping", 3), ("sending-done", 1), ("after-final", 1)])
def test_a_ps_killed_during_its_shutdown_is_restarted_and_the_run_ends(tmp_path, point, stop):
    rc, out, run_dir = crashed_run(tmp_path, point, stop)
    assert rc == 0, out
    assert "restarting ps from its newest checkpoint (1 of at most 3)" in out, out
    assert "result: test error" in out, out
    final = json.loads((run_dir / "ps_final.json").read_text())
    assert final["done"] and final["epoch"] >= 2 and final["incarnation"] == 2
    # the PS's "done", or ps_final.json standing for it where the killed PS's "done" was lost
    # and the statistics server finished before the restarted PS's came (stats/run_end.py)
    assert records(run_dir, "done"), "the metrics do not record the end of training"
    assert np.isfinite(np.load(run_dir / "weights.npy")).all()


@pytest.mark.slow
@pytest.mark.parametrize("point,rc", [("finishing", 1), ("after-final", 0)])
def test_without_restarts_a_ps_killed_at_the_end_fails_the_run_until_its_final_weights_are_saved(
    tmp_path, point, rc
):
    """runtime.restart=false: a PS killed before it wrote ps_final.json (every learner told,
    the final checkpoint not yet written) stops the run (exit 1) and ``--resume`` finishes it;
    one killed after it ends the run with the weights it saved and their result line."""
    code, out, run_dir = crashed_run(tmp_path, point, extra=("runtime.restart=false",))
    assert code == rc, out
    assert "ps (pid" in out and "SIGKILL" in out, out
    assert ("the run ends with those weights" in out) == (rc == 0), out
    assert ("result: test error" in out) == (rc == 0), out
    if rc == 1:  # --resume finishes it from the checkpoint written as training ended
        resumed = subprocess.run(
            [sys.executable, "-m", "rudra_zmq", "run", "--resume", str(run_dir)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=BOUND_S,
        )
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0 and "result: test error" in out, out
    final = json.loads((run_dir / "ps_final.json").read_text())
    assert final["done"] and final["epoch"] >= 2 and final["incarnation"] == 1 + rc
    assert any(e["ts"] == final["timestamp"] for e in records(run_dir, "eval")), out


def told_state(ts=45, done=True, stopped=()):
    return SimpleNamespace(
        engine=SimpleNamespace(timestamp=ts), done=done, learners=4, stopped=set(stopped)
    )


def test_the_told_record_holds_only_for_the_same_launch_and_the_same_end(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.RUN_TOKEN_ENV, "a" * 32)
    ToldRecord(tmp_path).save(told_state(stopped={1, 2}))
    assert "a" * 32 not in (tmp_path / TOLD_FILE).read_text()  # a hash, not the token
    st = told_state()
    assert ToldRecord(tmp_path).restore(st) == {1, 2} and st.stopped == {1, 2}
    for other in (told_state(ts=46), told_state(done=False)):  # trained on / not over
        assert ToldRecord(tmp_path).restore(other) == set() and not other.stopped
    monkeypatch.setenv(auth.RUN_TOKEN_ENV, "b" * 32)  # another launch (--resume)
    assert ToldRecord(tmp_path).restore(told_state()) == set()
    monkeypatch.delenv(auth.RUN_TOKEN_ENV)  # roles by hand
    assert ToldRecord(tmp_path).restore(told_state()) == set()
    (tmp_path / TOLD_FILE).write_text("{not json")
    monkeypatch.setenv(auth.RUN_TOKEN_ENV, "a" * 32)
    assert ToldRecord(tmp_path).restore(told_state()) == set()
