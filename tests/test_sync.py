"""The synchronization protocol engine, driven directly and deterministically."""

import pytest

from rudra_zmq.config import load_config
from rudra_zmq.sync import NOW, LRSchedule, ProtocolViolation, Reply, SyncEngine, check_protocol


def engine(protocol, learners, n=1, lr=0.1, policy="constant", **kw):
    return SyncEngine(protocol, learners, LRSchedule(lr, policy, **kw), n=n)


def run_round_robin(eng, rounds, learners):
    """Equal-speed learners: each pushes on the weights it last pulled, in turn."""
    have = [0] * learners
    updates, arrivals = [], []
    for _ in range(rounds):
        for i in range(learners):
            a = eng.receive(i, have[i])
            arrivals.append(a)
            have[i] = eng.timestamp  # pull whatever is newest after the push
            if a.update:
                updates.append(a.update)
    return updates, arrivals


def test_hardsync_updates_once_every_learner_pushed_with_zero_staleness():
    eng = engine("hardsync", 3)
    assert eng.receive(0, 0).update is None
    assert eng.receive(2, 0).update is None
    a = eng.receive(1, 0)
    assert a.update is not None
    u = a.update
    assert (u.timestamp, u.learners, u.timestamps, u.sigmas) == (1, (0, 2, 1), (0, 0, 0), (0, 0, 0))
    assert u.mean_sigma == 0 and u.g_scale == pytest.approx(1 / 3) and u.lr == 0.1
    assert eng.timestamp == 1


def test_hardsync_refuses_a_second_gradient_from_the_same_learner_and_keeps_state():
    eng = engine("hardsync", 2)
    eng.receive(0, 0)
    with pytest.raises(ProtocolViolation, match="learner 0 pushed twice for timestamp 0"):
        eng.receive(0, 0)
    assert eng.pending == 1 and eng.gradients_received == 1


def test_hardsync_refuses_stale_gradients():
    eng = engine("hardsync", 1)
    eng.receive(0, 0)
    with pytest.raises(ProtocolViolation, match="must pull the new weights"):
        eng.receive(0, 0)


def test_gradients_from_the_future_or_unknown_learners_are_refused():
    eng = engine("async", 2)
    with pytest.raises(ProtocolViolation, match="newer than the server's 0"):
        eng.receive(0, 5)
    with pytest.raises(ProtocolViolation, match="learner id 2 is out of range"):
        eng.receive(2, 0)
    assert eng.gradients_received == 0


@pytest.mark.parametrize(
    "learners,n,c", [(30, 1, 30), (30, 2, 15), (30, 4, 7), (30, 30, 1), (5, 2, 2)]
)
def test_softsync_updates_after_lambda_over_n_gradients(learners, n, c):
    eng = engine("softsync", learners, n=n)
    assert eng.gradients_per_update == c
    got = [eng.receive(i % learners, eng.timestamp).update is not None for i in range(3 * c)]
    assert got == ([False] * (c - 1) + [True]) * 3


def test_softsync_n_out_of_range_is_an_error():
    with pytest.raises(
        ValueError, match="sync.n must be between 1 and sync.learners=4 for softsync, got 5"
    ):
        engine("softsync", 4, n=5)


@pytest.mark.parametrize("learners,n", [(4, 1), (8, 2), (8, 4), (30, 30)])
def test_softsync_with_equal_speed_learners_has_mean_staleness_about_n(learners, n):
    eng = engine("softsync", learners, n=n)
    updates, _ = run_round_robin(eng, 40, learners)
    steady = updates[len(updates) // 2 :]
    mean = sum(u.mean_sigma for u in steady) / len(steady)
    # Between a learner's pull and its next push the other λ-1 gradients arrive, i.e.
    # (λ-1)/c = n(λ-1)/λ updates: ≈ n, as the paper measured.
    assert mean == pytest.approx(n * (learners - 1) / learners, abs=0.05)
    assert mean == pytest.approx(n, rel=0.3)


def test_async_updates_on_every_gradient_with_staleness_about_lambda():
    eng = engine("async", 6)
    updates, arrivals = run_round_robin(eng, 30, 6)
    assert len(updates) == len(arrivals) == 180
    steady = updates[60:]
    assert sum(u.mean_sigma for u in steady) / len(steady) == pytest.approx(5)  # λ-1 ≈ λ


def test_staleness_policy_divides_lr_by_mean_staleness_and_never_raises_it():
    eng = engine("softsync", 4, n=2, lr=0.8, policy="staleness")
    eng.receive(0, 0)
    u = eng.receive(1, 0).update  # <σ> = 0 -> counts as 1
    assert u.lr == pytest.approx(0.8)
    eng.receive(2, 0)  # σ = 1
    u = eng.receive(3, 0).update  # σ = 1 -> <σ> = 1
    assert u.sigmas == (1, 1) and u.lr == pytest.approx(0.8)
    eng.receive(0, 0)  # σ = 2
    u = eng.receive(1, 0).update  # <σ> = 2
    assert u.mean_sigma == 2 and u.lr == pytest.approx(0.4)
    eng.receive(0, 3)  # σ = 0
    u = eng.receive(1, 0).update  # σ = 3, <σ> = 1.5
    assert u.lr == pytest.approx(0.8 / 1.5)


def test_per_gradient_policy_scales_each_gradient_by_inverse_staleness():
    eng = engine("async", 3, lr=0.3, policy="per_gradient")
    assert eng.receive(0, 0).scale == 1.0  # σ=0 -> 1/max(0,1)
    assert eng.receive(1, 0).scale == 1.0  # σ=1
    a = eng.receive(2, 0)  # σ=2
    assert a.sigma == 2 and a.scale == 0.5 and a.update.lr == pytest.approx(0.3)


def test_constant_policy_ignores_staleness():
    eng = engine("async", 3, lr=0.3)
    eng.receive(0, 0), eng.receive(1, 0)
    a = eng.receive(2, 0)
    assert a.scale == 1.0 and a.update.lr == pytest.approx(0.3)


def test_step_schedule_divides_lr_by_ten_at_given_epochs():
    s = LRSchedule(0.001, steps=(120, 130))
    assert [s.base_at(e) for e in (0, 119.9, 120, 129, 130, 139)] == pytest.approx(
        [1e-3, 1e-3, 1e-4, 1e-4, 1e-5, 1e-5]
    )


def test_engine_counts_epochs_from_gradients_and_applies_the_schedule():
    eng = SyncEngine("async", 1, LRSchedule(1.0, steps=(1.0,)), batch_size=25, epoch_size=100)
    lrs = [eng.receive(0, eng.timestamp).update.lr for _ in range(8)]
    # lr is decided with the epoch after this gradient: 0.25 0.5 0.75 1.0(step) ...
    assert lrs == [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.1]
    assert eng.epoch == 2.0


def test_bad_lr_schedule_values_are_named():
    with pytest.raises(ValueError, match="base_lr must be a positive"):
        LRSchedule(0.0)
    with pytest.raises(ValueError, match="policy 'fast'"):
        LRSchedule(0.1, "fast")
    with pytest.raises(ValueError, match="ascending"):
        LRSchedule(0.1, steps=(130, 120))


def test_relayed_sums_count_learner_gradients_toward_c():
    eng = engine("softsync", 8, n=2)  # c = 4 learner gradients
    assert eng.receive_many([(0, 0), (1, 0), (2, 0)]).update is None
    u = eng.receive_many([(3, 0), (4, 0)]).update  # 5 >= 4: update with all 5
    assert u.learners == (0, 1, 2, 3, 4) and u.g_scale == pytest.approx(1 / 5)


def test_hardsync_through_relays_needs_every_learner_once():
    eng = engine("hardsync", 4)
    assert eng.receive_many([(0, 0), (1, 0)]).update is None
    with pytest.raises(ProtocolViolation, match="learner 1 pushed twice"):
        eng.receive_many([(1, 0), (2, 0)])
    assert eng.pending == 2  # the refused relay changed nothing
    u = eng.receive_many([(2, 0), (3, 0)]).update
    assert u.sigmas == (0, 0, 0, 0) and u.timestamp == 1


def test_relayed_staleness_is_per_gradient_and_drives_the_staleness_rate():
    eng = engine("async", 4, lr=0.9, policy="staleness")
    for i in range(3):
        eng.receive(i, eng.timestamp)
    u = eng.receive_many([(3, 0), (0, 3)]).update  # σ = 3 and 0
    assert u.sigmas == (3, 0) and u.mean_sigma == 1.5 and u.lr == pytest.approx(0.6)


def test_relays_refuse_the_per_gradient_policy_and_empty_sums():
    with pytest.raises(ProtocolViolation, match="per_gradient"):
        engine("async", 2, policy="per_gradient").receive_many([(0, 0)])
    with pytest.raises(ProtocolViolation, match="at least one"):
        engine("async", 2).receive_many([])


def test_epoch_at_is_the_epoch_the_engine_reaches_after_that_many_gradients():
    e = SyncEngine("async", 2, LRSchedule(0.1), batch_size=8, epoch_size=100)
    for k in range(1, 30):
        predicted = e.epoch_at(e.gradients_received + 1)
        e.receive(k % 2, e.timestamp)
        assert e.epoch == predicted == k * 8 / 100
    assert SyncEngine("async", 1, LRSchedule(0.1)).epoch_at(5) == 0.0  # no epoch size


# ----------------------------------------------------------------------------- replies
def test_hardsync_holds_each_reply_until_the_update_its_gradient_is_in():
    eng = engine("hardsync", 3)
    first, second = eng.receive(0, 0), eng.receive(2, 0)
    assert first.reply == second.reply == Reply(after=1)
    assert not eng.due(first.reply)
    assert eng.reply([1]) == NOW  # a learner with nothing pending: answered now
    assert eng.reply([0]) == Reply(after=1)  # a pull (or HELLO) from one that is held
    last = eng.receive(1, 0)
    assert last.update is not None and last.reply == NOW
    assert eng.due(first.reply) and eng.due(second.reply)


def test_softsync_and_async_answer_every_gradient_at_once():
    for eng in (engine("softsync", 4, n=1), engine("softsync", 4, n=2), engine("async", 4)):
        for i in range(4):
            a = eng.receive(i, 0)
            assert a.reply == NOW and eng.due(a.reply), (eng.protocol, eng.n, i)
        assert eng.reply([0, 1, 2, 3]) == NOW


def test_a_hardsync_relay_is_held_while_its_learners_are_pending():
    eng = engine("hardsync", 4)
    a = eng.receive_many([(0, 0), (1, 0)])
    assert a.update is None and a.reply == Reply(after=1)
    b = eng.receive_many([(2, 0), (3, 0)])
    assert b.update is not None and b.reply == NOW and eng.due(a.reply)


def test_a_learner_leaving_releases_the_replies_its_barrier_held():
    eng = engine("hardsync", 3)
    held = eng.receive(0, 0).reply
    eng.receive(1, 0)
    assert eng.leave(2) is not None and eng.due(held)


def test_a_protocol_that_holds_replies_cannot_run_where_servers_never_hold_them():
    check_protocol("async", 1, 4, broadcast=True)
    check_protocol("softsync", 2, 4, broadcast=True)
    with pytest.raises(ValueError, match="hardsync is not supported"):
        check_protocol("hardsync", 1, 4, broadcast=True)
    check_protocol("hardsync", 1, 4)


def test_an_engine_of_a_run_config_takes_its_protocol_and_schedule():
    cfg = load_config(
        None,
        [
            "sync.protocol=softsync",
            "sync.n=2",
            "sync.learners=6",
            "sync.batch_size=8",
            "optimizer.lr=0.3",
            "optimizer.lr_policy=staleness",
            "optimizer.lr_steps=[5]",
        ],
    )
    eng = SyncEngine.of(cfg, epoch_size=96)
    assert (eng.protocol, eng.n, eng.n_learners, eng.gradients_per_update) == ("softsync", 2, 6, 3)
    assert eng.lr == LRSchedule(0.3, "staleness", (5.0,), 0.1)
    assert eng.epoch_at(12) == 1.0
