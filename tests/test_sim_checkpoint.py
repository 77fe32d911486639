"""The simulator's checkpoints (``sim/sim_checkpoint.py``): a simulation stopped after an
evaluation (or between two: ``EVERY_S``) and resumed ends with the uninterrupted one's
updates, evaluations and weights, bit for bit (one worker thread: the same computations in
the same order); a checkpoint of other settings is refused; ``simulate`` and ``sweep
--simulate`` continue through it."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rudra_zmq.config import load_config
from rudra_zmq.launch import sweep as sweep_mod
from rudra_zmq.run_files import SWEEP_LOG, sim_checkpoint_path
from rudra_zmq.sim import sim_checkpoint
from rudra_zmq.sim.simulator import main_simulate, simulate


def cfg(*overrides):
    return load_config(
        None,
        [
            "model.name=digits_cnn",
            "data.dataset=digits",
            "train.epochs=1",
            "train.eval_every_epochs=0.25",
            "sync.batch_size=8",
            *overrides,
        ],
    )


class Stop(Exception):
    pass


def stopping_at(n_lines):
    """A progress callback that interrupts the run at its n-th line (an evaluation)."""
    seen = []

    def progress(line):
        seen.append(line)
        if len(seen) == n_lines:
            raise Stop(line)

    return progress


@pytest.mark.parametrize(
    "overrides,path",
    [
        (("sync.protocol=hardsync", "sync.learners=4"), "per-gradient"),
        (("sync.protocol=hardsync", "sync.learners=4"), "batched"),
        (("sync.protocol=softsync", "sync.learners=6", "sync.n=2"), "batched"),
        (("sync.protocol=async", "sync.learners=4"), "per-gradient"),
    ],
    ids=["hardsync-per-gradient", "hardsync-batched", "2-softsync-batched", "async"],
)
def test_a_resumed_simulation_ends_as_the_uninterrupted_one(tmp_path, overrides, path):
    import torch

    c = cfg(*overrides)
    ckpt = tmp_path / "sim_checkpoint.npz"
    kw = dict(train=True, jitter=0.3, seed=1, gradients=path, workers=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = simulate(c, **kw)
        with pytest.raises(Stop):  # lines: start, 0.25, 0.5 (interrupted there)
            simulate(c, checkpoint=ckpt, progress=stopping_at(3), **kw)
        state = sim_checkpoint.load(ckpt, _print(c, path))
        assert 0.25 <= state.epoch < 0.5 and len(state.evals) == 2  # the one at 0.25
        lines = []
        resumed = simulate(c, checkpoint=ckpt, progress=lines.append, **kw)
    finally:
        torch.set_num_threads(threads)
    assert lines[0].startswith(f"resumed from {ckpt}: update {state.ts}")
    assert resumed.updates == whole.updates and len(whole.updates) > 2 * state.ts
    assert resumed.evals == whole.evals and len(whole.evals) == 5
    np.testing.assert_array_equal(resumed.weights, whole.weights)
    assert not np.array_equal(state.w, whole.weights)  # it did train after the checkpoint


@pytest.mark.parametrize("path", ["per-gradient", "batched"])
def test_a_checkpoint_between_evaluations_resumes_as_well(tmp_path, monkeypatch, path):
    """EVERY_S = 0: a checkpoint after every update; the run stopped at update 13 (no
    evaluation there) resumes to the uninterrupted run's end."""
    import torch

    c = cfg("sync.protocol=softsync", "sync.learners=6", "sync.n=2")
    ckpt = tmp_path / "sim_checkpoint.npz"
    kw = dict(train=True, jitter=0.3, seed=1, gradients=path, workers=1)
    monkeypatch.setattr(sim_checkpoint, "EVERY_S", 0.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = simulate(c, **kw)
        simulate(c, checkpoint=ckpt, max_updates=13, **kw)
        state = sim_checkpoint.load(ckpt, _print(c, path))
        assert state.ts == 13 and state.ts not in [e["ts"] for e in whole.evals]
        resumed = simulate(c, checkpoint=ckpt, **kw)
    finally:
        torch.set_num_threads(threads)
    assert resumed.updates == whole.updates and resumed.evals == whole.evals
    np.testing.assert_array_equal(resumed.weights, whole.weights)


def _print(c, path):
    return sim_checkpoint.fingerprint(
        c, seed=1, jitter=0.3, speeds=[1.0] * c.sync.learners, path=path
    )


def test_a_checkpoint_of_other_settings_or_a_torn_file_is_refused(tmp_path):
    c = cfg("sync.protocol=hardsync", "sync.learners=4")
    ckpt = tmp_path / "sim_checkpoint.npz"
    kw = dict(train=True, jitter=0.3, gradients="batched", workers=1)
    with pytest.raises(Stop):
        simulate(c, seed=1, checkpoint=ckpt, progress=stopping_at(3), **kw)
    assert ckpt.exists()
    with pytest.raises(sim_checkpoint.CheckpointError, match="other settings.*--seed"):
        simulate(c, seed=2, checkpoint=ckpt, **kw)
    other = cfg("sync.protocol=hardsync", "sync.learners=4", "optimizer.lr=0.5")
    with pytest.raises(sim_checkpoint.CheckpointError, match="other settings"):
        simulate(other, seed=1, checkpoint=ckpt, **kw)
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    with pytest.raises(sim_checkpoint.CheckpointError, match="cannot be read"):
        simulate(c, seed=1, checkpoint=ckpt, **kw)


def test_a_checkpoint_written_before_a_config_key_went_still_resumes():
    """The fingerprint cffc958 (which had optimizer.momentum_policy) gave this config and
    timing; a checkpoint it wrote must resume now. A new config field changes every
    fingerprint, and so fails this test: checkpoints of the simulations then running would no
    longer resume (leave it out at its default, config.ADDED_DEFAULTS, as KEPT_VALUES counts
    a removed key at its)."""
    cfg = load_config(None, ["sync.protocol=softsync", "sync.learners=4", "sync.n=2"])
    got = sim_checkpoint.fingerprint(cfg, seed=0, jitter=0.1, speeds=[1.0] * 4, path="batched")
    assert got == "fa8f2e0b15ba0e4f05e32f1f4ae2506dff4fec74f9be52c285ff6cd1b1bcc432"


def test_simulate_refuses_a_checkpoint_without_resume_and_removes_it_when_done(tmp_path):
    c = cfg("sync.protocol=hardsync", "sync.learners=2", "train.epochs=0.5")
    run = tmp_path / "run"
    kw = dict(jitter=0.0, speeds=None, seed=0, train=True)
    with pytest.raises(ValueError, match="holds no simulator checkpoint"):
        main_simulate(c, run, resume=True, **kw)
    run.mkdir()
    sim_checkpoint_path(run).write_bytes(b"x")
    with pytest.raises(ValueError, match="unfinished simulation's checkpoint.*--resume"):
        main_simulate(c, run, **kw)
    sim_checkpoint_path(run).unlink()
    assert main_simulate(c, run, **kw) == 0
    assert (run / "metrics.jsonl").exists() and not sim_checkpoint_path(run).exists()


def test_a_sweep_resumes_an_interrupted_simulated_point(tmp_path, monkeypatch):
    grid = sweep_mod.Grid("g", Path("configs/quickstart.yaml"), None, [], [])
    point = sweep_mod.Point("p", ("sync.learners=2",))
    run_dir = tmp_path / "p"
    run_dir.mkdir()
    sim_checkpoint_path(run_dir).write_bytes(b"ckpt")
    (run_dir / SWEEP_LOG).write_text("epoch 1 ...\n")
    (run_dir / "metrics.jsonl").write_text("stale\n")
    commands = []

    class Child:
        def __init__(self, cmd, **kw):
            commands.append(cmd)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Child)
    status = sweep_mod.run_point(grid, point, tmp_path, simulate=True, jitter=0.0)
    assert "--resume" in commands[0] and status["resumed"] is True
    assert sim_checkpoint_path(run_dir).read_bytes() == b"ckpt"
    assert not (run_dir / "metrics.jsonl").exists()  # the interrupted attempt's rest
    log = (run_dir / SWEEP_LOG).read_text()
    assert log.startswith("epoch 1 ...\n") and "resumes this point from its checkpoint" in log
    sim_checkpoint_path(run_dir).unlink()  # a real run: removed when done
    sweep_mod.run_point(grid, point, tmp_path, simulate=True, jitter=0.0)
    assert "--resume" not in commands[1]
    assert json.loads((run_dir / "point.json").read_text())["resumed"] is False
