"""The launcher, with small fake role processes: success, a failing learner, a hanging child,
an interrupted run. Every test checks that no process it started is left behind."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import gone
from rudra_zmq import config as config_mod
from rudra_zmq import devices
from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.launch import launcher, run_plan

pytestmark = pytest.mark.timeout(30)

# A fake for every role. argv: BEHAVIOUR-JSON ROLE ARGS...; the behaviour of a process is
# looked up by its label (stats, data, ps, learner0, learner2-3) and defaults to "ok".
# Servers listen on their --bind endpoint, as the launcher waits for that before going on.
FAKE_ROLE = textwrap.dedent("""
    import json, os, pathlib, signal, socket, subprocess, sys, time
    behaviour, role, args = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    opt = lambda name: args[args.index(name) + 1] if name in args else None
    run_dir = pathlib.Path(opt("--config")).parent
    label = role if role not in ("learner", "node") else role + opt("--id").replace(",", "-")
    action = behaviour.get(label, "ok")
    print(f"{label} starting: {action}", file=sys.stderr)
    (run_dir / f"{label}.started").write_text(repr(time.time()))
    if action.startswith("slow:") or action == "stall":   # progress lines, then listen
        for i in range(int(float(action[5:]) / 0.2) if action != "stall" else 3):
            print(f"{label}: decoding, {i}", file=sys.stderr, flush=True)
            (run_dir / f"{label}.progress").write_text(repr(time.time()))
            time.sleep(0.2)
        if action == "stall":   # ... or fall silent, never listening
            time.sleep(60)
    if opt("--bind") and not action.startswith(("exit:", "signal:", "deaf")):
        time.sleep(0.2)  # a server takes a while to listen
        if opt("--bind").startswith("ipc://"):   # a tree node's leaf endpoint
            server = socket.socket(socket.AF_UNIX)
            server.bind(opt("--bind")[len("ipc://"):])
            server.listen()
        else:
            host, port = opt("--bind")[len("tcp://"):].rsplit(":", 1)
            server = socket.create_server((host, int(port)))
        (run_dir / f"{label}.listening").write_text(repr(time.time()))
    if action.startswith("exit:"):
        time.sleep(0.2)
        print(f"{label} failing on purpose", file=sys.stderr)
        sys.exit(int(action[5:]))
    if action.startswith("signal:"):
        time.sleep(0.2)
        os.kill(os.getpid(), int(action[7:]))
    if action == "killed_after_end" and not (run_dir / "stats.killed").exists():
        while not (run_dir / "ps.exited").exists():   # dies after the PS exited, once
            time.sleep(0.05)
        time.sleep(0.3)
        (run_dir / "stats.killed").write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    if action in ("sleep", "deaf"):
        time.sleep(60)
    if action in ("hang", "hang_tree"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if action == "hang_tree":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            (run_dir / f"{label}.grandchild").write_text(str(child.pid))
        while True:
            time.sleep(1)
    if action == "mark_term":   # says when SIGTERM came, then does what "ok" does
        def _term(*_):
            (run_dir / f"{label}.terminated").write_text(repr(time.time()))
            os._exit(0)
        signal.signal(signal.SIGTERM, _term)
    # "ok": what the real role does, minus the work
    if role == "stats":
        print("epoch 0.0 starting", flush=True)
        while not (run_dir / "ps.state.done").exists():
            time.sleep(0.05)
        if action.startswith("after_ps:"):   # another server trains on this long
            time.sleep(float(action[9:]))
            (run_dir / "stats.finished").write_text(repr(time.time()))
        print("epoch 1.0 test error 0.5", flush=True)
        print(f"run directory: {run_dir}", flush=True)
    elif role == "data":
        time.sleep(60)  # until SIGTERM
    elif role == "ps":
        while not any(run_dir.glob("learner*.started")):   # training needs learners
            time.sleep(0.05)
        time.sleep(0.5)
        if action.startswith("final:"):   # training done at that epoch: ps_final.json
            done = {"timestamp": 7, "epoch": float(action[6:]), "done": True}
            (run_dir / "ps_final.json").write_text(json.dumps(done))
        (run_dir / "ps.state.done").write_text("")
        import atexit; atexit.register(lambda: (run_dir / "ps.exited").write_text(""))
    elif action == "orphan":   # waits on a PS that never answers once it has exited
        while not (run_dir / "ps.exited").exists():
            time.sleep(0.05)
        print(f"{label}: no reply from its parent", file=sys.stderr)
        sys.exit(1)
    else:
        time.sleep(0.3)
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Make the launcher start FAKE_ROLE; returns a function that sets the behaviours.
    Afterwards, kills anything still alive that processes.json lists (and fails the test)."""
    script = tmp_path / "fake_role.py"
    script.write_text(FAKE_ROLE)
    behaviour = {}
    monkeypatch.setattr(
        launcher,
        "_role_command",
        lambda role, args: [sys.executable, str(script), json.dumps(behaviour), role, *args],
    )
    monkeypatch.setattr(launcher, "TERM_GRACE_S", 1.0)
    yield behaviour.update
    leftovers = [pid for pid in all_pids(tmp_path) if not gone(pid)]
    for pid in leftovers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    assert not leftovers, f"processes left behind: {leftovers}"


def all_pids(root: pathlib.Path) -> list[int]:
    pids = []
    for path in root.rglob("processes.json"):
        pids += [row["pid"] for row in json.loads(path.read_text())]
    pids += [int(p.read_text()) for p in root.rglob("*.grandchild")]
    return pids


def write_config(tmp_path, *lines):
    path = tmp_path / "c.yaml"
    path.write_text(
        "\n".join(["name: t", f"runtime: {{run_dir: {tmp_path / 'runs'}}}", *lines]) + "\n"
    )
    return str(path)


def only_run_dir(tmp_path) -> pathlib.Path:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def test_a_successful_run_returns_0_with_config_logs_and_progress(tmp_path, fake, capsys):
    fake({})
    cfg = write_config(tmp_path, "sync: {learners: 3}")
    assert launcher.run(cfg, ["optimizer.lr=0.25"]) == 0
    out = capsys.readouterr().out

    run_dir = only_run_dir(tmp_path)
    assert run_dir.name.startswith("t-")
    saved = load_config(run_dir / "config.yaml")
    assert saved == load_config(cfg, ["optimizer.lr=0.25"])
    rows = json.loads((run_dir / "processes.json").read_text())
    assert [r["role"] for r in rows] == ["stats", "data", "ps", "learner0", "learner1", "learner2"]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {f"{r['role']}.log" for r in rows}
    assert "epoch 1.0 test error 0.5" in (run_dir / "logs" / "stats.log").read_text()
    # the summary, the stats server's progress echoed as it came, and the final lines
    assert "hardsync, lambda=3 learners" in out and "endpoints ps tcp://127.0.0.1:" in out
    assert out.index("epoch 0.0 starting") < out.index("epoch 1.0 test error 0.5")
    assert out.rstrip().endswith(f"run directory: {run_dir}\nlogs: {run_dir / 'logs'}")
    assert out.count("run directory: ") == 1  # the stats server's line is not repeated


def test_learners_are_grouped_per_process_and_given_their_ids(tmp_path, fake):
    fake({})
    run_dir = tmp_path / "mine"
    cfg = write_config(tmp_path, "sync: {learners: 5}")
    assert launcher.run(cfg, ["runtime.learners_per_process=2"], run_dir=run_dir) == 0
    rows = json.loads((run_dir / "processes.json").read_text())
    learners = {r["role"]: r["command"] for r in rows if r["role"].startswith("learner")}
    assert sorted(learners) == ["learner0-1", "learner2-3", "learner4"]
    cmd = learners["learner2-3"]
    assert cmd[cmd.index("--id") + 1] == "2,3"
    assert cmd[cmd.index("--config") + 1] == str(run_dir.absolute() / "config.yaml")


def test_each_server_listens_before_anything_that_connects_to_it_starts(tmp_path, fake):
    fake({})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 2}")) == 0
    run_dir = only_run_dir(tmp_path)
    t = {
        p.name: float(p.read_text())
        for p in [*run_dir.glob("*.started"), *run_dir.glob("*.listening")]
    }
    assert t["stats.listening"] < t["ps.started"]
    assert max(t["ps.listening"], t["data.listening"]) < min(
        t["learner0.started"], t["learner1.started"]
    )


def test_a_server_that_never_listens_fails_the_run_after_the_timeout(tmp_path, fake, capsys):
    fake({"data": "deaf", "ps": "sleep"})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}"), ["runtime.timeout_s=1"]) == 1
    err = capsys.readouterr().err
    assert "data (pid" in err and "is not accepting connections on tcp://127.0.0.1:" in err
    assert "its log has not grown for 1 s (runtime.timeout_s)" in err
    assert not (only_run_dir(tmp_path) / "learner0.started").exists()


def test_a_server_slow_to_listen_is_waited_for_while_it_writes_progress(tmp_path, fake):
    fake({"data": "slow:3"})  # 3 s of progress lines (decoding a dataset), then it listens
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}"), ["runtime.timeout_s=1"]) == 0
    run_dir = only_run_dir(tmp_path)
    assert "data: decoding, 14" in (run_dir / "logs" / "data.log").read_text()
    t = {
        p.name: float(p.read_text())
        for p in [*run_dir.glob("*.started"), *run_dir.glob("*.listening")]
    }
    assert t["data.listening"] < t["learner0.started"]


def test_a_server_gone_silent_is_stopped_runtime_timeout_s_after_its_last_progress(
    tmp_path, fake, capsys
):
    fake({"data": "stall", "ps": "sleep"})  # 3 progress lines, then silent, never listening
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}"), ["runtime.timeout_s=1"]) == 1
    stopped = time.time()
    err = capsys.readouterr().err
    assert "data (pid" in err and "its log has not grown for 1 s (runtime.timeout_s)" in err
    assert "data: decoding, 2" in err  # the tail of its log
    run_dir = only_run_dir(tmp_path)
    assert stopped > float((run_dir / "data.progress").read_text()) + 1
    assert not (run_dir / "learner0.started").exists()


def test_a_failing_learner_is_restarted_max_restarts_times_then_stops_every_process(
    tmp_path, fake, capsys
):
    fake({"learner1": "exit:3", "ps": "sleep", "learner0": "sleep", "learner2": "hang"})
    cfg = write_config(tmp_path, "sync: {learners: 3}")
    start = time.monotonic()
    assert launcher.run(cfg, ["runtime.max_restarts=2"]) == 1
    assert time.monotonic() - start < 8  # 3 failures, 1 s grace for the SIGTERM-ignoring learner2
    err = capsys.readouterr().err
    assert "restarting learner1 (1 of at most 2)" in err and "(2 of at most 2)" in err
    assert "learner1 failed 3 times (runtime.max_restarts=2); stopping the run" in err
    pid = {
        r["role"]: r["pid"]
        for r in json.loads((only_run_dir(tmp_path) / "processes.json").read_text())
    }
    assert f"rudra-zmq: learner1 (pid {pid['learner1']}) exited with code 3" in err
    assert "learner1 failing on purpose" in err  # the tail of its log
    assert all(gone(p) for p in all_pids(tmp_path))


def test_without_restarts_a_failing_learner_is_left_out_and_the_run_goes_on(tmp_path, fake, capsys):
    fake({"learner1": "exit:3"})
    assert (
        launcher.run(write_config(tmp_path, "sync: {learners: 2}"), ["runtime.restart=false"]) == 0
    )
    err = capsys.readouterr().err
    assert "learner1 is left out (runtime.restart is off); the run goes on" in err


def test_a_tree_node_and_learner_failing_after_their_root_finished_end_the_run_not_restarted(
    tmp_path, fake, capsys
):
    """Rudra-adv: the PS finished (ps_final.json says done), then the leaf node1 and learner2
    below it fail for want of their parent (chaos soak seed 9): both have finished, so they
    are not restarted, and the run ends well instead of restarting them until
    runtime.max_restarts stops it (or, at 100, for ever)."""
    fake({"ps": "final:2", "node1": "orphan", "learner2": "orphan", "learner3": "sleep"})
    cfg = write_config(
        tmp_path,
        "sync: {protocol: softsync, n: 1, learners: 4}",
        "architecture: {kind: adv, fanout: 2, depth: 1}",
    )
    assert launcher.run(cfg, ["train.epochs=2", "runtime.max_restarts=2"]) == 0
    err = capsys.readouterr().err
    assert "restarting node1" not in err and "restarting learner2" not in err, err
    assert "node1 failed after training ended for ps (ps_final.json: done at epoch 2.00)" in err
    rows = json.loads((only_run_dir(tmp_path) / "processes.json").read_text())
    assert [r["role"] for r in rows].count("node1") == 1
    assert all(gone(p) for p in all_pids(tmp_path))


def test_a_tree_node_failing_before_its_root_finished_is_still_restarted(tmp_path, fake, capsys):
    """The same failure with ps_final.json not saying done (the PS wrote none): node1 is
    restarted, each time, until runtime.max_restarts stops the run."""
    fake({"ps": "ok", "node1": "orphan", "learner3": "sleep"})
    cfg = write_config(
        tmp_path,
        "sync: {protocol: softsync, n: 1, learners: 4}",
        "architecture: {kind: adv, fanout: 2, depth: 1}",
    )
    assert launcher.run(cfg, ["runtime.max_restarts=2"]) == 1
    err = capsys.readouterr().err
    assert "restarting node1 (2 of at most 2)" in err
    assert "node1 failed 3 times (runtime.max_restarts=2); stopping the run" in err
    assert all(gone(p) for p in all_pids(tmp_path))


def test_a_run_directory_that_holds_a_run_is_refused_without_resume(tmp_path, fake):
    fake({})
    cfg = write_config(tmp_path, "sync: {learners: 1}")
    assert launcher.run(cfg, run_dir=tmp_path / "r") == 0
    with pytest.raises(ConfigError, match="already holds a run .* `rudra-zmq run --resume "):
        launcher.run(cfg, run_dir=tmp_path / "r")


def test_a_child_killed_by_a_signal_is_named_by_it(tmp_path, fake, capsys):
    fake({"ps": "signal:9", "learner0": "sleep"})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}")) == 1
    assert "ps (pid" in (err := capsys.readouterr().err)
    assert "exited with code -9 (SIGKILL)" in err


def test_a_hanging_process_tree_is_killed_grandchildren_included(tmp_path, fake, capsys):
    fake({"data": "hang_tree", "learner0": "exit:1", "ps": "sleep"})
    assert (
        launcher.run(write_config(tmp_path, "sync: {learners: 1}"), ["runtime.restart=false"]) == 1
    )
    run_dir = only_run_dir(tmp_path)
    assert (run_dir / "data.grandchild").exists()
    assert all(gone(p) for p in all_pids(tmp_path))


def test_the_data_server_exiting_during_training_is_a_failure(tmp_path, fake, capsys):
    fake({"data": "exit:0", "ps": "sleep", "learner0": "sleep"})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}")) == 1
    assert "exited before training ended, with code 0" in capsys.readouterr().err


def test_a_stats_server_that_never_finishes_is_stopped(tmp_path, fake, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "STATS_EXIT_TIMEOUT_S", 0.5)
    fake({"stats": "hang"})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}")) == 0  # training was fine
    out, err = capsys.readouterr()
    assert "the stats server did not finish within 0.5 s after training ended" in err
    assert f"run directory: {only_run_dir(tmp_path)}" in out
    assert all(gone(p) for p in all_pids(tmp_path))


@pytest.mark.parametrize("learner", ["ok", "slow:3"])  # gone already / still finishing
def test_a_stats_server_killed_after_the_ps_exited_is_restarted_and_the_run_ends_well(
    tmp_path, fake, capsys, learner
):
    """SIGKILL of the statistics server after training ended, while the launcher waits for it
    (learner ok) or still for a learner (slow:3): restarted, it finishes, the run ends 0."""
    fake({"stats": "killed_after_end", "learner0": learner})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}")) == 0
    err = capsys.readouterr().err
    assert "exited with code -9 (SIGKILL)" in err and "restarting stats (1 of at most" in err
    rows = json.loads((only_run_dir(tmp_path) / "processes.json").read_text())
    assert [r["role"] for r in rows].count("stats") == 2
    assert all(gone(p) for p in all_pids(tmp_path))


def test_processes_json_says_how_each_process_ended_a_killed_one_by_its_signal(tmp_path, fake):
    """A role killed and restarted stays in the run's records (the chaos soak checks every
    kill there): its row keeps its pid with exit -9 and SIGKILL, its successor's its own."""
    fake({"stats": "killed_after_end"})
    assert launcher.run(write_config(tmp_path, "sync: {learners: 1}")) == 0
    rows = json.loads((only_run_dir(tmp_path) / "processes.json").read_text())
    stats = [r for r in rows if r["role"] == "stats"]
    assert [(r["exit"], r.get("signal")) for r in stats] == [(-9, "SIGKILL"), (0, None)]
    assert all("exit" in r for r in rows)  # the end: every process's exit is known


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_everything_and_returns_130(tmp_path, signum):
    """A real launcher process (with the fake roles), stopped like a user would."""
    script = tmp_path / "fake_role.py"
    script.write_text(FAKE_ROLE)
    behaviour = json.dumps({"ps": "sleep", "learner0": "hang"})
    driver = textwrap.dedent(f"""
        import sys
        from rudra_zmq.launch import launcher
        launcher.TERM_GRACE_S = 1.0
        launcher._role_command = lambda role, args: [sys.executable, {str(script)!r},
                                                     {behaviour!r}, role, *args]
        sys.exit(launcher.run({write_config(tmp_path, "sync: {learners: 2}")!r}))
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(all_pids(tmp_path)) < 5:
            time.sleep(0.05)
        time.sleep(0.3)  # let the children get going
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=45)
    finally:
        proc.kill()
        proc.wait()
        pids = all_pids(tmp_path)
        for pid in pids:
            if not gone(pid):
                os.killpg(pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert len(pids) == 5 and all(gone(p) for p in pids)


def test_ipc_endpoints_live_in_the_run_directory(tmp_path):
    cfg = load_config(None, ["runtime.transport=ipc"])
    assert run_plan.endpoints(cfg, pathlib.Path("/r")) == {
        "ps": "ipc:///r/ps.sock",
        "data": "ipc:///r/data.sock",
        "stats": "ipc:///r/stats.sock",
    }
    with pytest.raises(ConfigError, match="longer than 107 bytes"):
        run_plan.endpoints(cfg, pathlib.Path("/" + "x" * 100))


def test_children_get_thread_counts_and_malloc_settings():
    cfg = load_config(
        None, ["sync.learners=1", "runtime.threads_per_learner=2", "runtime.ps_threads=3"]
    )
    assert launcher.role_env(cfg, "learner")["OMP_NUM_THREADS"] == "2"
    assert launcher.role_env(cfg, "ps")["MKL_NUM_THREADS"] == "3"
    env = launcher.role_env(cfg, "stats")
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert env["MALLOC_MMAP_MAX_"] == "0" and env["MALLOC_ARENA_MAX"] == "2"


def test_run_directories_are_unique(tmp_path):
    cfg = load_config(None, [f"runtime.run_dir={tmp_path}"])
    first, second = run_plan.make_run_dir(cfg), run_plan.make_run_dir(cfg)
    assert first != second and (first / "logs").is_dir() and (second / "logs").is_dir()


def test_role_env_gives_the_ps_the_cores_the_learners_leave(monkeypatch):
    from rudra_zmq.config import load_config
    from rudra_zmq.launch.launcher import role_env

    monkeypatch.setattr(devices, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cfg = load_config(None, ["sync.learners=2", "runtime.threads_per_learner=2"])
    env = role_env(cfg, "ps")
    assert env["OMP_NUM_THREADS"] == "4" and env["RUDRA_ZMQ_PS_THREADS"] == "4"
    assert "OMP_WAIT_POLICY" not in env
    busy = load_config(None, ["sync.learners=8"])  # 8 learners x 1 thread on 8 cores
    env = role_env(busy, "ps")
    assert env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert role_env(busy, "learner")["OMP_NUM_THREADS"] == "1"
    pinned = load_config(None, ["sync.learners=8", "runtime.ps_threads=3"])
    assert role_env(pinned, "ps")["OMP_NUM_THREADS"] == "3"
    # a host of a multi-host run: 2 of the 8 learners here share its 8 cores, and a PS alone
    # on its host gets the cap of 4
    assert role_env(busy, "learner", learners_here=2)["OMP_NUM_THREADS"] == "4"
    assert role_env(busy, "learner", learners_here=2)[devices.HOST_LEARNERS_ENV] == "2"
    assert role_env(busy, "ps", learners_here=0)["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize(
    "others, verdict",
    [
        ({"learner0": None}, "left out"),  # another learner still training
        ({"learner0": 0}, "left out"),  # the others were told STOP: the PS only waits for it
        ({"learner0": 1}, "stopped"),  # no learner left to train
    ],
)
def test_a_learner_on_a_lost_host_is_left_out_while_the_run_can_end_without_it(
    others, verdict, capsys
):
    from types import SimpleNamespace

    from rudra_zmq.launch.children import Child
    from rudra_zmq.launch.cluster_launch import SSH_FAILED, ClusterLauncher

    def child(label, rc):
        proc = SimpleNamespace(returncode=rc, poll=lambda: rc)
        return Child(label, "learner", [], pathlib.Path("/dev/null"), proc, ended=rc is not None)

    lost = child("learner3", SSH_FAILED)
    cl = object.__new__(ClusterLauncher)  # only the state _failed reads
    cl.cp = SimpleNamespace(placement={"learner3": "10.77.0.3"})
    cl.via, cl.left_out, cl.stopped = "ssh", set(), False
    cl.children = [child(label, rc) for label, rc in others.items()] + [lost]
    cl._report = lambda c, early=False: None
    cl.stop_all = lambda: setattr(cl, "stopped", True)
    outcome = cl._failed(lost)
    err = capsys.readouterr().err
    assert "lost host 10.77.0.3" in err
    if verdict == "left out":
        assert outcome is None and cl.left_out == {"learner3"} and not cl.stopped
        assert "learner3 is left out; the run goes on without it" in err
    else:
        assert outcome == 1 and cl.stopped and "stopping the run" in err


def test_with_a_server_elsewhere_the_data_server_serves_until_the_stats_server_ends(
    tmp_path, fake, monkeypatch, capsys
):
    """`worker` rank 0 with server 1 on a rank of its own: server 0 finishing is not the end
    of training (server 1 may count a few gradients more); the stats server's end is."""
    fake({"stats": "after_ps:1.5", "data": "mark_term"})
    monkeypatch.setattr(launcher, "ELSEWHERE_FILES_S", 0.2)  # server 1's files never come
    cfg = load_config(write_config(tmp_path, "sync: {learners: 2}"), ["architecture.servers=2"])
    plan = run_plan.make_plan(cfg)
    config_mod.save(cfg, plan.run_dir / "config.yaml")
    ours = launcher.Launcher(plan)
    ours.local = set(plan.endpoints) - {"ps1"} | {"learner0", "learner1"}
    assert ours.run() == 0
    run_dir = plan.run_dir
    assert not (run_dir / "ps1.started").exists()
    finished = float((run_dir / "stats.finished").read_text())
    assert float((run_dir / "data.terminated").read_text()) >= finished
    assert "left their weights on their hosts" in capsys.readouterr().err  # and how to join
