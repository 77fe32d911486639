"""The in-process simulator: deterministic staleness and training without sockets."""
import numpy as np
import pytest

from rudra_zmq.config import load_config
from rudra_zmq.simulator import simulate, write_run


def cfg(*overrides):
    return load_config(None, ["model.name=digits_cnn", "data.dataset=digits",
                              "train.eval_every_epochs=1", *overrides])


def test_hardsync_has_zero_staleness_and_one_gradient_per_learner():
    res = simulate(cfg("sync.protocol=hardsync", "sync.learners=5"), jitter=0.3, max_updates=50)
    assert len(res.updates) == 50
    for u in res.updates:
        assert u["sigmas"] == [0] * 5


@pytest.mark.parametrize("learners,n", [(30, 1), (30, 2), (30, 10), (30, 30), (8, 4)])
def test_equal_speed_softsync_staleness_is_n_times_lambda_minus_one_over_lambda(learners, n):
    res = simulate(cfg("sync.protocol=softsync", f"sync.learners={learners}", f"sync.n={n}"),
                   max_updates=40 * n)
    steady = res.updates[len(res.updates) // 2:]
    mean = np.mean([u["mean_sigma"] for u in steady])
    assert mean == pytest.approx(n * (learners - 1) / learners, abs=0.05)


def test_a_slow_learner_pushes_staler_gradients_under_async():
    res = simulate(cfg("sync.protocol=async", "sync.learners=4"), speeds=[1, 1, 1, 4],
                   max_updates=400)
    # one gradient per async update: the fast learners' gradients see ~2-3 other updates, the
    # slow learner's see the ~9 updates the fast ones made while it computed
    sigmas = [u["sigmas"][0] for u in res.updates]
    assert len(sigmas) == 400
    assert max(sigmas) >= 9 and min(sigmas) <= 3


def test_simulation_is_deterministic_for_a_seed():
    c = cfg("sync.protocol=softsync", "sync.learners=6", "sync.n=2")
    a = simulate(c, jitter=0.5, seed=3, max_updates=100)
    b = simulate(c, jitter=0.5, seed=3, max_updates=100)
    d = simulate(c, jitter=0.5, seed=4, max_updates=100)
    assert a.updates == b.updates and a.updates != d.updates


def test_simulated_training_learns_digits_and_writes_a_run_directory(tmp_path):
    c = cfg("sync.protocol=softsync", "sync.learners=4", "sync.batch_size=16", "train.epochs=6",
            "optimizer.lr=0.05", "optimizer.lr_policy=staleness")
    res = simulate(c, train=True, jitter=0.2)
    assert res.evals[0]["test_error"] > 0.5 and res.evals[-1]["test_error"] < 0.1
    out = write_run(c, res, tmp_path / "sim")
    assert (out / "metrics.jsonl").is_file() and (out / "test_error_vs_epoch.png").is_file()


def test_bad_speeds_are_named():
    with pytest.raises(ValueError, match="each of the 2 learners"):
        simulate(cfg("sync.learners=2"), speeds=[1.0])


@pytest.mark.parametrize("overrides", [("sync.protocol=softsync", "sync.learners=4", "sync.n=2"),
                                       ("sync.protocol=hardsync", "sync.learners=3")])
def test_gradients_computed_ahead_on_worker_threads_change_nothing(overrides):
    import torch

    c = cfg(*overrides, "train.epochs=0.5", "sync.batch_size=8")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)          # one gradient at a time, one thread
        alone = simulate(c, train=True, jitter=0.3, workers=1)
        torch.set_num_threads(2)          # two workers of one thread each
        ahead = simulate(c, train=True, jitter=0.3, workers=2)
        assert torch.get_num_threads() == 2   # given back after the run
    finally:
        torch.set_num_threads(threads)
    assert alone.updates == ahead.updates and alone.evals == ahead.evals
    np.testing.assert_array_equal(alone.weights, ahead.weights)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        simulate(c, train=True, workers=0)
