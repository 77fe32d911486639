"""Bounded staleness (``sync.max_staleness``, SSP's rule): the engine driven directly, the
simulator with a straggler, the config's refusals, and a real run with a throttled learner."""

from collections import Counter

import numpy as np
import pytest

from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.sim.simulator import simulate
from rudra_zmq.sync import LRSchedule, Rejoin, Reply, SyncEngine, TooStale


def engine(protocol, learners, s, n=1):
    return SyncEngine(protocol, learners, LRSchedule(0.1), n=n, max_staleness=s)


def sim_sigmas(protocol, s, speeds=(1, 1, 1, 5), updates=400):
    over = [f"sync.protocol={protocol}", "sync.learners=4", "train.epochs=3"]
    cfg = load_config(
        "configs/quickstart.yaml", over + ([f"sync.max_staleness={s}"] if s is not None else [])
    )
    res = simulate(cfg, speeds=list(speeds), max_updates=updates)
    return res, [x for u in res.updates for x in u["sigmas"]]


def test_async_holds_the_fast_learners_until_the_slow_ones_gradient_comes():
    eng = engine("async", 2, s=1)  # learner 1 is slow: it computes on timestamp 0
    a = eng.receive(0, 0)  # 0 -> 1: learner 1's gradient would then be 1 old, allowed
    assert a.update is not None and a.reply == Reply(None) and eng.timestamp == 1
    a = eng.receive(0, 1)  # 1 -> 2 would make it 2 old: the update is held back
    assert a.update is None and a.reply == Reply(2) and eng.pending == 1
    assert not eng.due(a.reply)
    b = eng.receive(1, 0)  # σ = 1 <= s: accounted, and now both gradients make the update
    assert b.sigma == 1 and b.update is not None and b.update.learners == (0, 1)
    assert b.update.g_scale == pytest.approx(1 / 2) and eng.due(a.reply)


def test_a_gradient_older_than_the_bound_is_refused_counted_and_never_applied():
    eng = engine("async", 2, s=1)
    eng.receive(0, 0)
    eng.leave(1)  # evicted while computing on timestamp 0: the bound no longer waits for it
    eng.receive(0, 1)
    eng.join(1)  # it rejoins at timestamp 2 ...
    with pytest.raises(TooStale, match=r"σ = 2 > sync.max_staleness=1"):
        eng.receive(1, 0)  # ... and its gradient from before the eviction arrives
    assert eng.too_stale == 1 and eng.pending == 0 and eng.gradients_received == 2
    assert issubclass(TooStale, Rejoin)  # the learner says HELLO again for the current weights
    assert eng.state_dict()["too_stale"] == 1


def test_a_slow_learner_that_leaves_releases_the_update_held_back_for_it():
    eng = engine("async", 3, s=1)
    eng.receive(0, 0)
    a = eng.receive(0, 1)
    assert a.update is None and a.reply == Reply(2)
    assert eng.leave(2) is None  # learner 1, on timestamp 0 too, still holds it back
    u = eng.leave(1)  # the last one behind is evicted: the held update goes
    assert u is not None and u.timestamp == 2 and u.learners == (0,) and eng.due(a.reply)


def test_state_dict_keeps_the_refusals_and_a_restart_starts_the_bound_afresh():
    eng = engine("softsync", 2, s=3)
    eng.too_stale = 4
    other = engine("softsync", 2, s=3)
    other.load_state(eng.state_dict())
    assert other.too_stale == 4 and other._within_bound()


@pytest.mark.parametrize("protocol", ["softsync", "async"])
def test_a_5x_slower_learner_stays_within_the_bound_in_the_simulator(protocol):
    free, free_sig = sim_sigmas(protocol, None)
    bounded, sig = sim_sigmas(protocol, 2)
    assert max(free_sig) > 2  # without the bound the straggler's gradients are older
    assert max(sig) <= 2 and Counter(sig)[2] > 0
    assert len(bounded.updates) == 400
    # SSP's price: the fast learners wait for the slow one
    assert bounded.sim_time > free.sim_time


def test_a_bound_of_zero_makes_every_gradient_fresh():
    _, sig = sim_sigmas("async", 0, updates=100)
    assert set(sig) == {0}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sync.protocol=async", "sync.max_staleness=-1"], "whole number of updates >= 0"),
        (["sync.protocol=async", "sync.max_staleness=1.5"], "got 1.5"),
        (["sync.protocol=hardsync", "sync.max_staleness=2"], "hardsync's σ is always 0"),
        (
            ["sync.protocol=async", "sync.max_staleness=2", "architecture.kind=advstar"],
            "architecture.kind=advstar",
        ),
        (
            ["sync.protocol=softsync", "sync.max_staleness=2", "architecture.kind=adv"],
            "architecture.kind=adv",
        ),
        (["runtime.compute_times=[1,5]"], "each of the 4 learners"),
        (["runtime.compute_times=[1,1,1,0.5]"], "factor >= 1"),
    ],
)
def test_bad_values_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/quickstart.yaml", overrides)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_run_with_a_throttled_learner_never_applies_a_gradient_past_the_bound(tmp_path):
    """The real roles (threads of this process): async, λ = 4, learner 3 takes 5x its compute
    time (``runtime.compute_times``). Every applied gradient has σ <= 2, the fast learners
    waited (updates took more gradients than c), and the counters are recorded."""
    from fault_runs import records
    from inproc import run_in_threads

    run_dir, _ = run_in_threads(
        "configs/quickstart.yaml",
        [
            "sync.protocol=async",
            "sync.max_staleness=2",
            "runtime.compute_times=[1,1,1,5]",
            "train.epochs=2",
            "train.eval_every_epochs=0",
            "runtime.retry_s=1",
        ],
        tmp_path / "ssp",
    )
    updates = records(run_dir, "update")
    sigmas = [s for u in updates for s in u["sigmas"]]
    assert updates and max(sigmas) <= 2, Counter(sigmas)
    assert any(u["n_grads"] > 1 for u in updates)  # held back for the straggler
    done = records(run_dir, "done")
    assert done and done[0]["too_stale"] == 0
    assert np.isfinite(np.load(run_dir / "weights.npy")).all()
