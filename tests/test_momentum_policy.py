"""The staleness-aware momentum option (``optimizer.momentum_policy: staleness``, beyond the
paper): each update's momentum is m − ⟨σ⟩/(⟨σ⟩ + 1), at least 0, in the engine's update, the
records and the PS's step; ``constant`` (the paper's) leaves everything as it was."""

import numpy as np
import pytest

from rudra_zmq.config import ConfigError, OptimizerConfig, load_config
from rudra_zmq.sync import LRSchedule, SyncEngine
from rudra_zmq.update import Updater


def test_the_rule_gives_up_the_momentum_asynchrony_adds():
    s = LRSchedule(0.1, momentum_policy="staleness", momentum=0.9)
    assert s.momentum_at(0.0) == 0.9  # hardsync keeps m
    assert s.momentum_at(1.0) == pytest.approx(0.4)  # 1-softsync: asynchrony's 0.5 given up
    assert s.momentum_at(30.0) == 0.0  # 30-softsync: none left
    assert LRSchedule(0.1, momentum=0.9).momentum_at(1.0) is None  # constant: the optimizer's
    with pytest.raises(ValueError, match="momentum policy 'fast'"):
        LRSchedule(0.1, momentum_policy="fast")


def test_the_engine_puts_it_in_each_update_and_its_record():
    cfg = load_config(
        None,
        ["sync.protocol=async", "sync.learners=2", "optimizer.momentum_policy=staleness"],
    )
    eng = SyncEngine.of(cfg)
    eng.receive(0, 0)
    u = eng.receive(1, 0).update  # σ = 1
    assert u.momentum == pytest.approx(cfg.optimizer.momentum - 0.5)
    assert u.record(2.0)["momentum"] == u.momentum
    plain = SyncEngine.of(load_config(None, ["sync.protocol=async", "sync.learners=2"]))
    u = plain.receive(0, 0).update
    assert u.momentum is None and "momentum" not in u.record(2.0)


def test_the_ps_steps_with_the_updates_momentum():
    """Two updates from the same gradients: with the update's momentum 0.4, v and w are those
    of the optimizer configured with 0.4, not 0.9 (NumPy oracle, Caffe semantics)."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(1000).astype(np.float32)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]
    opt = OptimizerConfig(lr=0.1, momentum=0.9, weight_decay=0.004)
    eng = SyncEngine.of(
        load_config(None, ["sync.protocol=async", "sync.learners=1", "optimizer.lr=0.1"])
    )
    up = Updater(w0.copy(), [(0, 1000, 1.0, 1.0)], opt)
    w, v = w0.astype(np.float64), np.zeros(1000)
    for g in grads:
        u = eng.receive(0, eng.timestamp).update
        u = type(u)(**{**u.__dict__, "momentum": 0.4})
        up.receive([g], 1.0, u)
        v = 0.4 * v + 0.1 * (g + 0.004 * w)
        w = w - v
    np.testing.assert_allclose(up.w, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(up.v, v, rtol=1e-5, atol=1e-6)


def test_a_bad_policy_is_refused_naming_it():
    with pytest.raises(ConfigError, match="optimizer.momentum_policy"):
        load_config(None, ["optimizer.momentum_policy=stale"])
