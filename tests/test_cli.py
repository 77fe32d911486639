"""The rudra-zmq command line: help, info, config errors, and how role commands call serve()."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from rudra_zmq import cli, devices, transport
from rudra_zmq.config import load_config
from rudra_zmq.launch import role_process

pytestmark = pytest.mark.timeout(30)


def rudra(*args, timeout=20):
    """Run ``python -m rudra_zmq ARGS`` the way a user would; returns the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "rudra_zmq", *args], capture_output=True, text=True, timeout=timeout
    )


def write_config(tmp_path, text="name: t\nsync: {learners: 2}\n"):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_help_lists_every_command():
    res = rudra("--help")
    assert res.returncode == 0, res.stderr
    for command in ("run", "ps", "learner", "data", "stats", "info"):
        assert f"\n    {command} " in res.stdout


def test_info_prints_the_build_and_versions_without_importing_torch():
    res = rudra("info")
    assert res.returncode == 0, res.stderr
    for key in ("rudra_zmq", "torch", "pyzmq", "libzmq", "numpy", "build.openmp"):
        assert key in res.stdout
    code = (
        "import sys, contextlib, io; from rudra_zmq.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['info'])\n"
        "print('torch' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert res.stdout.strip() == "False", res.stderr


@pytest.mark.parametrize("command", ["run", "ps", "learner", "data", "stats"])
def test_an_unknown_config_key_exits_2_with_the_message_and_no_traceback(tmp_path, command):
    cfg = write_config(tmp_path, "sync: {lerners: 3}\n")
    args = {
        "run": [cfg],
        "ps": ["--config", cfg, "--bind", "tcp://127.0.0.1:1"],
        "learner": ["--config", cfg, "--id", "0", "--ps", "x", "--data", "y"],
        "data": ["--config", cfg, "--bind", "x"],
        "stats": ["--config", cfg, "--bind", "x", "--run-dir", str(tmp_path)],
    }[command]
    res = rudra(command, *args)
    assert res.returncode == 2
    assert res.stderr.startswith(
        f"rudra-zmq: error: {cfg}: unknown key(s) 'lerners' in section 'sync'"
    )  # the file named: a run's saved config.yaml handed back is read the same way
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()


def test_a_bad_override_and_a_missing_file_exit_2(tmp_path):
    res = rudra("run", write_config(tmp_path), "--set", "sync.lerners=3")
    assert (
        res.returncode == 2 and "with --set sync.lerners=3: override 'sync.lerners'" in res.stderr
    )
    res = rudra("run", str(tmp_path / "nope.yaml"))
    assert res.returncode == 2 and "rudra-zmq: error: config file" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "env,sets,message,deep",
    [
        ({"RUDRA_ZMQ_PORTS": "abc"}, [], "$RUDRA_ZMQ_PORTS='abc': give LO-HI", False),
        ({}, ["--set", "runtime.host=192.0.2.1"], "runtime.host '192.0.2.1': cannot bind", False),
        # ipc paths need the directory's name (deep: too long for a socket): the directory
        # made for them is removed again; a leaf's socket is ipc even on tcp
        ({}, ["--set", "runtime.transport=ipc"], "the ipc socket path '", True),
        ({}, ["--set", "architecture.kind=adv", "--set", "architecture.fanout=2"], "the ipc", True),
    ],
)
def test_a_bad_port_range_host_or_ipc_path_exits_2_naming_it_and_makes_no_run_directory(
    tmp_path, env, sets, message, deep
):
    run = tmp_path / ("r" * 100 if deep else "") / "run"
    res = subprocess.run(
        [sys.executable, "-m", "rudra_zmq", "run", write_config(tmp_path), "--run-dir", str(run)]
        + sets,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert res.returncode == 2 and f"rudra-zmq: error: {message}" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not run.exists()


def test_learner_ids_must_be_below_lambda_and_well_formed(tmp_path):
    cfg = write_config(tmp_path)
    res = rudra("learner", "--config", cfg, "--id", "1,2", "--ps", "x", "--data", "y")
    assert res.returncode == 2
    assert "--id 2: learner ids run from 0 to sync.learners-1 = 1" in res.stderr
    res = rudra("learner", "--config", cfg, "--id", "0,a", "--ps", "x", "--data", "y")
    assert res.returncode == 2 and "learner ids separated by commas" in res.stderr


ROLE_MODULES = {  # what each role command runs
    "ps": "rudra_zmq.server.ps",
    "learner": "rudra_zmq.learner.learner",
    "data_server": "rudra_zmq.data.server",
    "stats_server": "rudra_zmq.stats.server",
}


@pytest.fixture
def fake_roles(monkeypatch):
    """Fake role modules whose serve() records its arguments; no torch."""
    calls = {}

    def recorder(name):
        def serve(*args, **kwargs):
            calls[name] = args + tuple(kwargs.values())
            return 0

        return serve

    for name, path in ROLE_MODULES.items():
        module = types.ModuleType(path)
        module.serve = recorder(name)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    threads = []
    monkeypatch.setattr(role_process, "set_threads", lambda n, torch_too: threads.append(n))
    monkeypatch.setattr(transport, "tune_malloc", lambda: calls.update(malloc=True))
    monkeypatch.setattr(role_process.logging, "basicConfig", lambda **kw: None)
    return calls, threads


def test_role_commands_pass_their_endpoints_and_overrides_to_serve(tmp_path, fake_roles):
    calls, threads = fake_roles
    cfg = write_config(tmp_path, "name: t\nsync: {learners: 4}\n")
    common = ["--config", cfg, "--set", "optimizer.lr=0.5", "--set", "runtime.ps_threads=3"]
    assert (
        cli.main(["ps", *common, "--bind", "tcp://h:1", "--stats", "tcp://h:3", "--run-dir", "r"])
        == 0
    )
    assert (
        cli.main(["learner", *common, "--id", "0,2", "--ps", "tcp://h:1", "--data", "tcp://h:2"])
        == 0
    )
    assert cli.main(["data", *common, "--bind", "tcp://h:2"]) == 0
    assert cli.main(["stats", *common, "--bind", "tcp://h:3", "--run-dir", "r"]) == 0

    expected = load_config(cfg, ["optimizer.lr=0.5", "runtime.ps_threads=3"])
    # resume=False, server 0 (the one server of the config's shape)
    assert calls["ps"] == (expected, "tcp://h:1", "tcp://h:3", "r", False, 0)
    # stats None, finished_in None
    assert calls["learner"] == (expected, [0, 2], ["tcp://h:1"], "tcp://h:2", None, None)
    assert calls["data_server"] == (expected, "tcp://h:2")
    assert calls["stats_server"] == (expected, "tcp://h:3", "r", False)
    assert calls["malloc"] is True
    assert threads == [3, devices.learner_threads(expected, 2), 1, 1]  # --id 0,2: 2 here
    # restarted after some servers finished: where their final weights are
    learner = ["learner", *common, "--id", "1", "--ps", "tcp://h:1", "--data", "tcp://h:2"]
    assert cli.main([*learner, "--finished-in", "r"]) == 0
    assert calls["learner"][-1] == "r"


def test_learner_threads_default_to_usable_cores_over_learners_here(monkeypatch):
    monkeypatch.setattr(devices, "usable_cores", lambda: 12)
    monkeypatch.delenv(devices.HOST_LEARNERS_ENV, raising=False)
    cfg = load_config(None, ["sync.learners=64"])
    assert devices.learner_threads(cfg) == 1  # 64 learners here: at least 1
    assert devices.learner_threads(cfg, 3) == 4  # 3 learners on this host
    monkeypatch.setenv(devices.HOST_LEARNERS_ENV, "2")  # what a launcher says
    assert devices.learner_threads(cfg) == 6
    assert devices.host_learners(cfg, default=5) == 2
    monkeypatch.delenv(devices.HOST_LEARNERS_ENV)
    assert devices.host_learners(cfg, default=5) == 5  # a hand-started learner process
    cfg = load_config(None, ["sync.learners=1"])
    assert devices.learner_threads(cfg) == 12
    cfg = load_config(None, ["runtime.threads_per_learner=3"])
    assert devices.learner_threads(cfg) == 3


def test_usable_cores_follow_the_cpu_affinity():
    assert devices.usable_cores() == len(os.sched_getaffinity(0))
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to narrow the affinity")
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from rudra_zmq import devices; print(devices.usable_cores())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "1"


@pytest.mark.timeout(90)
def test_sigterm_stops_a_role_command_with_exit_code_143(tmp_path):
    cfg = write_config(tmp_path)
    ready = tmp_path / "ready"
    driver = textwrap.dedent(f"""
        import sys, time, types
        mod = types.ModuleType({ROLE_MODULES["data_server"]!r})
        def serve(cfg, bind):
            open({str(ready)!r}, "w").close()
            time.sleep(60)
        mod.serve = serve
        sys.modules[mod.__name__] = mod
        from rudra_zmq.cli import main
        sys.exit(main(["data", "--config", {cfg!r}, "--bind", "tcp://127.0.0.1:1"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rudra-zmq data: stopped by SIGTERM" in err and "Traceback" not in err


@pytest.mark.timeout(90)
def test_sigterm_stops_a_process_of_two_learners_without_a_failure_logged(tmp_path):
    """Two learners as threads of one process, both waiting for servers that never answer
    (as learners evicted at a run's end wait): SIGTERM ends the process with exit code 143,
    each thread closing its own sockets (closing them from the main thread aborted libzmq),
    with no "learner N failed" traceback."""
    import zmq

    ctx = zmq.Context()
    servers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    eps = []
    for s in servers:
        port = s.bind_to_random_port("tcp://127.0.0.1")
        eps.append(f"tcp://127.0.0.1:{port}")
    cmd = [sys.executable, "-m", "rudra_zmq", "learner", "--config", write_config(tmp_path)]
    cmd += ["--id", "0,1", "--ps", eps[0], "--data", eps[1]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        poller, heard = zmq.Poller(), set()
        for s in servers:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + 60
        while len(heard) < 2 and proc.poll() is None and time.monotonic() < deadline:
            for s, _ in poller.poll(100):
                heard.add(s.recv_multipart()[0])  # a learner's first request, never answered
        assert len(heard) >= 2, "the two learners never asked their servers"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
        ctx.destroy(linger=0)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "rudra-zmq learner: stopped by SIGTERM" in err, err
    assert "failed" not in err and "Traceback" not in err, err
    assert "sockets were not closed" not in err, err  # each thread closed its own
