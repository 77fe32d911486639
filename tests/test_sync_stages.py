"""Protocols that change during a run: ``sync.schedule`` (protocols by epoch) and
``sync.target_staleness`` (n chosen to hold ⟨σ⟩ near a target), in the engine, the simulator
and the real roles."""

from collections import Counter

import numpy as np
import pytest

from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.sim.simulator import simulate
from rudra_zmq.sync import LRSchedule, Rejoin, SyncEngine
from rudra_zmq.sync.stages import ADAPT_EVERY, Stage, parse_schedule


def test_a_schedule_is_read_checked_and_refused_naming_the_entry():
    assert parse_schedule(["12 softsync 4", "13 hardsync", "14 async"], 30) == (
        Stage(12.0, "softsync", 4),
        Stage(13.0, "hardsync", 1),
        Stage(14.0, "async", 30),
    )
    for bad, message in (
        (["12 softsync 4", "12 hardsync"], r"sync.schedule\[1\].*must ascend"),
        (["0 hardsync"], "epoch > 0"),
        (["3 hardsnc"], "one of hardsync, softsync, async"),
        (["3"], "expected 'EPOCH PROTOCOL"),
        (["3 softsync 40"], "sync.n must be between 1 and sync.learners=30"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_schedule(bad, 30)


def test_the_engine_switches_after_the_update_that_reaches_the_epoch():
    eng = SyncEngine(
        "async",
        2,
        LRSchedule(0.1),
        batch_size=1,
        epoch_size=4,
        schedule=parse_schedule(["1 hardsync"], 2),
    )
    u = [eng.receive(i % 2, eng.timestamp).update for i in range(3)]
    assert [x.protocol for x in u] == ["async"] * 3 and eng.protocol == "async"
    u = eng.receive(0, 1).update  # σ = 2: the 4th gradient, epoch 1: the switch follows it
    assert u.protocol == "async" and u.sigmas == (2,) and eng.protocol == "hardsync"
    assert u.record(0.0)["protocol"] == "async"
    with pytest.raises(Rejoin, match="before sync.schedule switched to hardsync at 4"):
        eng.receive(1, 2)  # computed before the switch: HELLO again, not a failure
    eng.receive(0, 4)
    u = eng.receive(1, 4).update
    assert u.protocol == "hardsync" and u.sigmas == (0, 0)
    other = SyncEngine("async", 2, LRSchedule(0.1), schedule=parse_schedule(["1 hardsync"], 2))
    other.load_state(eng.state_dict())  # a restarted PS goes on under the stage it was in
    assert (other.protocol, other.n) == ("hardsync", 1)


def test_a_schedule_runs_in_the_simulator_with_the_protocols_staleness_in_each_stage():
    cfg = load_config(
        "configs/quickstart.yaml",
        ["sync.protocol=async", "sync.learners=8", "train.epochs=4"]
        + ["sync.schedule=['1 softsync 2', '2 hardsync']"],
    )
    res = simulate(cfg, jitter=0.3)
    labels = [u["protocol"] for u in res.updates]
    assert list(dict.fromkeys(labels)) == ["async", "softsync n=2", "hardsync"]
    sig = {
        lab: [s for u in res.updates if u["protocol"] == lab for s in u["sigmas"]] for lab in labels
    }
    assert np.mean(sig["async"]) > 4 and 1 < np.mean(sig["softsync n=2"]) < 3
    assert set(sig["hardsync"]) == {0}


def test_target_staleness_moves_n_until_the_mean_staleness_nears_the_target():
    cfg = load_config(
        "configs/quickstart.yaml",
        ["sync.protocol=softsync", "sync.learners=8", "train.epochs=6", "sync.target_staleness=3"],
    )
    res = simulate(cfg, jitter=0.3, speeds=[1] * 7 + [3])
    k = len(res.updates)
    first, last = res.updates[:ADAPT_EVERY], res.updates[-k // 4 :]
    assert {u["protocol"] for u in first} == {"softsync n=1"}  # sync.n, for the first window
    mean = np.mean([s for u in last for s in u["sigmas"]])
    assert 2.0 <= mean <= 4.0, (mean, Counter(u["protocol"] for u in last))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sync.protocol=hardsync", "sync.target_staleness=2"], "set sync.protocol=softsync"),
        (["sync.protocol=softsync", "sync.target_staleness=9"], "above λ=4"),
        (["sync.protocol=softsync", "sync.target_staleness=0"], "a number > 0"),
        (
            ["sync.protocol=softsync", "sync.target_staleness=2", "sync.schedule=['1 hardsync']"],
            "give one",
        ),
        (["sync.schedule=['1 hardsync']", "architecture.kind=adv"], "use architecture.kind=base"),
        (["sync.schedule=['2 async', '1 hardsync']"], "must ascend"),
    ],
)
def test_bad_values_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/quickstart.yaml", overrides)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_run_switches_from_async_to_hardsync_and_its_learners_follow(tmp_path):
    """The real roles (threads of this process): async for the first epoch, then hardsync. The
    learners whose gradients were computed before the switch say HELLO again and go on; every
    update after it has σ = 0; the plot draws the switch."""
    from fault_runs import records
    from inproc import run_in_threads
    from rudra_zmq.results import plots

    run_dir, _ = run_in_threads(
        "configs/quickstart.yaml",
        ["sync.protocol=async", "sync.schedule=['1 hardsync']", "train.epochs=2"]
        + ["train.eval_every_epochs=1", "runtime.retry_s=1"],
        tmp_path / "switch",
    )
    ups = records(run_dir, "update")
    labels = [u["protocol"] for u in ups]
    assert labels[0] == "async" and labels[-1] == "hardsync" and labels.count("hardsync") > 5
    after = labels.index("hardsync")
    assert all(u["sigmas"] == [0] * 4 for u in ups[after:])  # one fresh gradient per learner
    assert ups[after - 1]["epoch"] >= 1.0
    assert any(p.name == "test_error_vs_epoch.png" for p in plots.plot_run(run_dir, tmp_path))
