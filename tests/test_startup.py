"""Start-up: each role imports only what it uses, the statistics server and the parameter
server listen before their slow part, and the digits split comes from the cache after the
first load."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cluster import FakeLearner, running, small_config
from rudra_zmq import transport
from rudra_zmq.config import load_config
from rudra_zmq.data import data_order, datasets
from rudra_zmq.launch.children import accepting
from rudra_zmq.server import ps as ps_module
from rudra_zmq.server import start
from rudra_zmq.stats.server import StatsServer
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(60)

HEAVY = (
    "torch",
    "matplotlib",
    "sklearn",
    "scipy",
    "PIL",
    "rudra_zmq.results.compare",
    "rudra_zmq.launch.cluster_launch",
    "rudra_zmq.benchmarks.cli",
)


def heavy_modules(code: str, env=None) -> list[str]:
    """Run ``code`` in a fresh interpreter; the HEAVY modules it imported."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    res = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=50, env=env
    )
    assert res.returncode == 0, res.stderr
    return eval(res.stdout.strip().splitlines()[-1])  # a list of names we printed


def test_a_role_command_line_imports_none_of_the_other_commands():
    code = (
        "import contextlib, io\nfrom rudra_zmq import cli\n"
        "for command in ('ps', 'learner', 'node', 'data', 'stats', 'run'):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.suppress(SystemExit):\n"
        "        cli.main([command, '--help'])"
    )
    assert heavy_modules(code) == []


def test_the_full_parser_still_lists_every_command():
    from rudra_zmq import cli

    text = cli.build_parser().format_help()
    for command in cli.COMMANDS:
        assert f"\n    {command} " in text


def test_the_digits_split_is_cached_and_read_back_without_scikit_learn(tmp_path, monkeypatch):
    monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path))
    first = datasets.load_dataset("digits")
    (cached,) = tmp_path.glob("digits-*.npz")
    again = datasets.load_dataset("digits")
    for key in ("x_train", "y_train", "x_test", "y_test"):
        a, b = getattr(first, key), getattr(again, key)
        assert a.dtype == b.dtype and np.array_equal(a, b), key
    assert (first.classes, first.mean, first.std) == (again.classes, again.mean, again.std)
    # a data server of another process: the split from the cache, no torch, no sklearn
    code = (
        "from rudra_zmq.config import load_config\n"
        "from rudra_zmq.data.server import DataServer\n"
        "s = DataServer(load_config(overrides=['data.dataset=digits']), 'tcp://127.0.0.1:0')\n"
        "s.close()"
    )
    assert heavy_modules(code, env={**os.environ, datasets.CACHE_ENV: str(tmp_path)}) == []


def test_a_damaged_digits_cache_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path))
    datasets.load_dataset("digits")
    (cached,) = tmp_path.glob("digits-*.npz")
    cached.write_bytes(b"not an npz")
    ds = datasets.load_dataset("digits")
    assert len(ds.y_train) == 1797 - datasets.DIGITS_TEST
    assert np.array_equal(datasets.load_dataset("digits").x_test, ds.x_test)


def test_the_stats_server_accepts_connections_before_it_loads_its_data_and_model(
    tmp_path, monkeypatch
):
    cfg = load_config(overrides=["data.dataset=digits", "model.name=digits_cnn"])
    endpoint = transport.free_tcp_endpoint("127.0.0.1")
    real = data_order.load_data
    seen = []

    def load_data(c):
        seen.append(accepting(endpoint))
        return real(c)

    monkeypatch.setattr(data_order, "load_data", load_data)
    server = StatsServer(cfg, endpoint, tmp_path)
    try:
        assert seen == [True]
        assert server.evaluator.x_test.shape[1:] == (1, 8, 8)
    finally:
        server._file.close()
        server.sock.close(linger=0)
        transport.term(server.ctx)


def test_the_ps_accepts_connections_before_it_builds_its_model_and_answers_what_came_meanwhile(
    ctx, monkeypatch
):
    endpoint = transport.free_tcp_endpoint("127.0.0.1")
    real = start.initial_model
    seen, early = [], []

    def initial_model(cfg):
        seen.append(accepting(endpoint))
        built = real(cfg)
        early.append(FakeLearner(ctx, endpoint, 0))  # a HELLO before the state exists
        early[0].send(Kind.HELLO, model=built[2], numel=built[0].size)
        return built

    monkeypatch.setattr(start, "initial_model", initial_model)
    ps = ps_module.ParameterServer(small_config(), endpoint, ctx=ctx)
    assert seen == [True]
    with running(ps) as errors:
        msg = early[0].recv()
        assert msg.kind == Kind.WELCOME
        np.testing.assert_array_equal(np.concatenate(msg.payloads), ps.state.w)
        early[0].close()
    assert not errors


def test_a_resumed_ps_builds_its_state_before_it_binds(ctx, monkeypatch, tmp_path):
    endpoint = transport.free_tcp_endpoint("127.0.0.1")
    real = start.initial_model
    seen = []

    def initial_model(cfg):
        seen.append(accepting(endpoint))
        return real(cfg)

    monkeypatch.setattr(start, "initial_model", initial_model)
    ps = ps_module.ParameterServer(
        small_config(), endpoint, ctx=ctx, run_dir=str(tmp_path), resume=True
    )
    try:
        assert seen == [False] and accepting(endpoint)
    finally:
        ps._finish()


def test_a_ps_process_listens_before_it_imports_torch(tmp_path):
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import time\ntime.sleep(120)\n")  # an import that hangs
    endpoint = transport.free_tcp_endpoint("127.0.0.1")
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rudra_zmq",
            "ps",
            "--bind",
            endpoint,
            "--config",
            "configs/quickstart.yaml",
        ],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        deadline = time.monotonic() + 40  # a generous bound for a loaded machine
        while not accepting(endpoint) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert accepting(endpoint), "the PS does not listen while torch is being imported"
    finally:
        proc.kill()
        proc.wait(10)
        proc.stderr.close()


def test_the_ps_initial_weights_are_cached_bit_identical_and_read_back_without_torch(
    tmp_path, monkeypatch
):
    from rudra_zmq.server import initial_weights

    monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path))
    cfg = load_config(overrides=["data.dataset=digits", "model.name=digits_cnn"])
    built = start.initial_model(cfg)  # built with torch, then cached
    (cached,) = (tmp_path / "initial").glob("digits_cnn-*.npz")
    again = start.initial_model(cfg)
    np.testing.assert_array_equal(again[0], built[0])
    assert again[0].dtype == np.float32 and again[1:] == built[1:]
    # another process: the same weights from the cache, torch never imported
    code = (
        "import numpy as np\nfrom rudra_zmq.config import load_config\n"
        "from rudra_zmq.server.start import initial_model\n"
        "w = initial_model(load_config(overrides=['data.dataset=digits', "
        "'model.name=digits_cnn']))[0]\n"
        f"assert np.array_equal(w, np.load({str(tmp_path / 'w.npy')!r}))"
    )
    np.save(tmp_path / "w.npy", built[0])
    assert heavy_modules(code, env={**os.environ, datasets.CACHE_ENV: str(tmp_path)}) == []
    # what the weights depend on is in the key; a damaged entry is rebuilt
    other = load_config(overrides=["data.dataset=digits", "model.name=digits_cnn", "model.seed=1"])
    assert initial_weights.cache_path(other, built[3]) != cached
    assert initial_weights.read(other, built[3]) is None
    cached.write_bytes(b"not an npz")
    assert initial_weights.read(cfg, built[3]) is None
    np.testing.assert_array_equal(start.initial_model(cfg)[0], built[0])
    assert initial_weights.read(cfg, built[3]) is not None
