"""Deterministic replay (``rudra-zmq replay``): a real run with uneven learners recomputed from
the PS's arrivals log to the same weights, bit for bit on CPU; ``--until``; the refusals."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from fault_runs import ROOT
from rudra_zmq.server import arrival_log
from rudra_zmq.sim.replay import ReplayError, replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
UNEVEN = ["runtime.compute_times=[1,1,1,3]", "train.epochs=2", "train.eval_every_epochs=0"]


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rudra_zmq", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """rudra-zmq run (real processes, two learners each), async, learner 3 three times slower."""
    run_dir = tmp_path_factory.mktemp("replay") / "async"
    sets = [*UNEVEN, "sync.protocol=async", "runtime.learners_per_process=2", "runtime.retry_s=1"]
    out = cli(
        "run",
        str(ROOT / "configs/quickstart.yaml"),
        "--run-dir",
        str(run_dir),
        *[a for s in sets for a in ("--set", s)],
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return run_dir


def test_an_async_run_of_real_processes_replays_to_its_weights_bit_for_bit(async_run):
    out = cli("replay", str(async_run))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the same weights as weights.npy, bit for bit" in out.stdout, out.stdout
    events = arrival_log.read(async_run)
    sigmas = [s for u in _updates(async_run) for s in u["sigmas"]]
    assert max(sigmas) >= 2  # uneven learners: the log is not a round robin
    assert (async_run / "arrivals.bin").stat().st_size == 16 + 16 * len(events)


def test_a_softsync_run_replays_to_its_weights_bit_for_bit(tmp_path):
    from inproc import run_in_threads

    run_dir, _ = run_in_threads(
        ROOT / "configs/quickstart.yaml",
        [*UNEVEN, "sync.protocol=softsync", "sync.n=2", "runtime.retry_s=1"],
        tmp_path / "soft",
    )
    r = replay(run_dir)
    assert np.array_equal(r.weights, np.load(run_dir / "weights.npy"))
    assert r.update.timestamp == r.timestamp and len(r.update.learners) == 2  # c = λ/n


def test_until_stops_at_an_update_and_shows_it(async_run, tmp_path):
    out = cli("replay", str(async_run), "--until", "10", "--out", str(tmp_path / "w10.npy"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "to timestamp 10" in out.stdout and "update 10: learners [" in out.stdout
    w10 = np.load(tmp_path / "w10.npy")
    assert not np.array_equal(w10, np.load(async_run / "weights.npy"))
    r = replay(async_run, until=10)
    assert r.timestamp == 10 and np.array_equal(r.weights, w10)
    with pytest.raises(ReplayError, match="last update made timestamp"):
        replay(async_run, until=10**6)


def test_runs_it_cannot_reproduce_are_refused_with_the_reason(async_run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(async_run, copy)
    log = copy / "arrivals.bin"
    data = log.read_bytes()
    log.write_bytes(data + data[:16] + data[16:48])  # a restarted PS's header and events
    with pytest.raises(ReplayError, match="the PS restarted during the run"):
        replay(copy)
    log.unlink()
    out = cli("replay", str(copy))
    assert out.returncode == 2 and "arrivals.bin does not exist" in out.stderr, out.stderr
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["architecture"]["kind"] = "adv"
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ReplayError, match="architecture.kind=adv"):
        replay(copy)


def _updates(run_dir):
    from fault_runs import records

    return records(run_dir, "update")
