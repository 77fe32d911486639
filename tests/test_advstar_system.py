"""Whole Rudra-adv* runs: the root PS (with its broadcast root), the tree nodes and the
learners (each a broadcast member) of architecture.kind=advstar; as threads of this process
where training is the subject (tests/inproc.py), as processes of `rudra-zmq run` where a
process dies or is started by hand."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from test_system import DIGITS, ROOT, threaded_run, updates

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
CONFIG = ROOT / "configs/quickstart_advstar.yaml"


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def test_quickstart_advstar_trains_to_high_accuracy_with_weights_only_from_the_broadcast(tmp_path):
    run_dir, out = threaded_run(tmp_path, "advstar", ["runtime.timeout_s=60"], config=CONFIG)
    assert "broadcast: root -> learner 0" in out and "broadcast: learner 2 -> learner 3" in out
    evals = records(run_dir, "eval")
    print(f"advstar quickstart: final test error {evals[-1]['test_error']:.2%}")
    assert evals and evals[-1]["test_error"] <= 0.10, evals[-1]
    # every learner trained on versions that only the broadcast delivered (WELCOME is ts 0)
    newest = {}
    for r in records(run_dir, "learner"):
        newest[r["learner"]] = max(newest.get(r["learner"], 0), r["ts"])
    assert sorted(newest) == [0, 1, 2, 3] and min(newest.values()) > 0, newest
    ups = updates(run_dir)
    assert len(ups) >= 100 and all(r["n_grads"] >= 4 for r in ups)  # 1-softsync, λ = 4
    from rudra_zmq.config import load_config

    alpha0 = load_config(CONFIG).optimizer.lr
    for r in ups:
        assert r["lr"] == pytest.approx(alpha0 / max(r["mean_sigma"], 1.0), rel=1e-12)
    assert not list(run_dir.glob("*.sock")), "tree nodes remove their ipc sockets"


@contextlib.contextmanager
def training_run(run_dir, *overrides):
    """A ``rudra-zmq run`` of CONFIG (digits, 1000 epochs) in the background, yielded once it
    applied its first update (at most 90 s); killed on the way out if still running."""
    cmd = [sys.executable, "-m", "rudra_zmq", "run", str(CONFIG), "--run-dir", str(run_dir)]
    for o in [*DIGITS, "train.epochs=1000", *overrides]:
        cmd += ["--set", o]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    try:
        deadline, metrics = time.time() + 90, run_dir / "metrics.jsonl"
        while not (metrics.exists() and '"update"' in metrics.read_text()):
            assert time.time() < deadline and proc.poll() is None, "no training in 90 s"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_broadcast_member_that_dies_stops_the_run_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "dies"
    with training_run(run_dir) as proc:
        entries = json.loads((run_dir / "processes.json").read_text())
        victim = next(e for e in entries if e["role"] == "learner1")  # mid-chain
        os.kill(victim["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert f"learner1 (pid {victim['pid']}) exited with code -9 (SIGKILL)" in out, out


def test_an_interrupted_run_stops_learner_threads_and_their_broadcast_members_quietly(tmp_path):
    """Ctrl-C of a run with two learners per process (each a broadcast member with an I/O
    thread): exit 130, and each learner process's log ends saying SIGTERM stopped it, with no
    error (its sockets closed by the threads that own them: a stop is not a failure). A
    warning that a broadcast child had gone may come: the processes stop in any order."""
    run_dir = tmp_path / "int"
    with training_run(run_dir, "runtime.learners_per_process=2") as proc:
        # the first update can come before the other learner process is up (still importing
        # torch, no handler yet: SIGTERM would end it silently); wait for both banners
        deadline = time.time() + 60
        while len([p for p in (run_dir / "logs").glob("learner*.log") if p.read_text()]) < 2:
            assert time.time() < deadline, "a learner process never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    logs = sorted((run_dir / "logs").glob("learner*.log"))
    assert len(logs) == 2, logs
    for log in logs:
        lines = log.read_text().splitlines()
        assert lines[-1] == "rudra-zmq learner: stopped by SIGTERM", (log.name, lines)
        bad = [x for x in lines if "ERROR" in x or "Traceback" in x or "failed" in x]
        assert not bad, (log.name, lines)


def test_a_learner_started_by_hand_times_out_naming_its_silent_broadcast_upstream(tmp_path):
    import numpy as np
    import zmq

    from rudra_zmq import transport, wire
    from rudra_zmq.wire import Kind

    ctx = zmq.Context()
    leaf = ctx.socket(zmq.ROUTER)  # answers the learner's HELLO, no more
    leaf.setsockopt(zmq.LINGER, 0)
    leaf_ep = f"tcp://127.0.0.1:{leaf.bind_to_random_port('tcp://127.0.0.1')}"
    silent = transport.free_tcp_endpoint()  # learner 0 was never started
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "learner",
        "--config",
        str(CONFIG),
        "--id",
        "1",
        "--ps",
        leaf_ep,
        "--data",
        transport.free_tcp_endpoint(),
        "--bcast-upstream",
        silent,
    ]
    for o in ["sync.learners=2", "runtime.timeout_s=3"]:
        cmd += ["--set", o]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    try:
        assert leaf.poll(90_000), "the learner never said HELLO"
        ident, *frames = leaf.recv_multipart()
        hello = wire.decode(frames)
        leaf.send_multipart(
            [
                ident,
                *wire.encode(
                    Kind.WELCOME,
                    wire.node_sender(0),
                    1,
                    0,
                    7,
                    [np.zeros(hello.fields["numel"], np.float32)],
                    learners=2,
                    protocol="softsync",
                ),
            ]
        )
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ctx.destroy(linger=0)
    assert proc.returncode == 1, out
    assert (
        f"learner 1: no weights from learner 0 at {silent} for 3 s (runtime.timeout_s) "
        "while training is not finished"
    ) in out, out
