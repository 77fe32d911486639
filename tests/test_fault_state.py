"""Failures at the level of the state objects (no sockets): eviction and rejoining (elastic
λ), at-most-once gradients, and a checkpoint's snapshot/restore."""

import numpy as np
import pytest

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server import checkpoint
from rudra_zmq.server.state import ServerState
from rudra_zmq.sync import LRSchedule, ProtocolViolation, Rejoin, SyncEngine
from rudra_zmq.wire import Kind

N, SIG = 12, "sig"


def message(kind, sender, seq, ts=0, payloads=(), **fields):
    return wire.decode(wire.encode(kind, sender, seq, ts, 0, list(payloads), **fields))


def state(*overrides):
    cfg = small_config(*overrides)
    w0 = np.linspace(-1, 1, N, dtype=np.float32)
    return ServerState(cfg, w0, [(0, N, 1.0, 1.0)], SIG, epoch_size=64)


def hello(st, learner, seq=1, **fields):
    st.register(
        str(learner).encode(), message(Kind.HELLO, learner, seq, model=SIG, numel=N, **fields)
    )


def g(value):
    return np.full(N, value, np.float32)


def test_a_learner_leaving_completes_the_hardsync_barrier_for_the_others():
    eng = SyncEngine("hardsync", 3, LRSchedule(0.1))
    assert eng.receive(0, 0).update is None and eng.receive(1, 0).update is None
    update = eng.leave(2)  # learner 2 died: 0 and 1 are the barrier
    assert update is not None and update.learners == (0, 1) and eng.timestamp == 1
    assert eng.gradients_per_update == 2
    with pytest.raises(Rejoin, match="not a member"):
        eng.receive(2, 1)
    eng.join(2)
    assert eng.gradients_per_update == 3 and eng.receive(2, 1).update is None


@pytest.mark.parametrize(
    "learners, n, alive, c", [(4, 1, 3, 3), (4, 2, 3, 1), (4, 2, 2, 1), (8, 2, 6, 3), (4, 4, 1, 1)]
)
def test_softsync_c_is_recomputed_from_the_learners_alive(learners, n, alive, c):
    eng = SyncEngine("softsync", learners, LRSchedule(0.1), n=n)
    for i in range(alive, learners):
        eng.leave(i)
    assert eng.gradients_per_update == c == max(alive // n, 1)


def test_a_gradient_sent_again_is_answered_and_applied_once_and_a_replay_is_refused():
    st = state("sync.protocol=async")
    hello(st, 0, seq=10)
    push = message(Kind.PUSHPULL, 0, 11, 0, [g(1.0)])
    assert not st.is_duplicate(push)
    st.push(push)
    w1 = st.w.copy()
    for _ in range(3):  # the same message three times: applied once
        assert st.is_duplicate(push)
    assert st.engine.timestamp == 1 and st.counters.duplicates == 3
    np.testing.assert_array_equal(st.w, w1)
    with pytest.raises(ProtocolViolation, match="replayed"):
        st.is_duplicate(message(Kind.PUSHPULL, 0, 10, 0, [g(1.0)]))
    hello(st, 0, seq=10)  # a late copy of the first HELLO
    assert st.is_duplicate(push)  # does not reopen the window
    with pytest.raises(ProtocolViolation, match="replayed"):  # from before a new HELLO
        hello(st, 0, seq=20)
        st.is_duplicate(push)


def test_silent_members_are_found_but_not_those_owed_a_reply_or_told_to_stop():
    st = state("sync.protocol=hardsync", "sync.learners=3")
    for i in range(3):
        hello(st, i)
        st.join(i, now=100.0)
    st.last_heard[2] = 130.0
    assert st.silent(now=140.0, timeout_s=30) == [0, 1]
    assert st.silent(now=140.0, timeout_s=30, waiting={0}) == [1]
    del st.last_heard[1]  # as if learner 1 had never said HELLO
    assert st.silent(now=140.0, timeout_s=30) == [0]
    assert st.silent(now=140.0, timeout_s=30, never_by=139.0) == [0, 1]
    st.stopped.add(0)  # said BYE during training: evicted as usual
    assert st.silent(now=140.0, timeout_s=30, never_by=139.0) == [0, 1]
    st.done = True  # told STOP at the end: finished, not lost
    assert st.silent(now=140.0, timeout_s=30, never_by=139.0) == [1]
    st.stopped.discard(0)
    st.done = False
    st.join(1, now=100.0)
    st.push(message(Kind.PUSHPULL, 0, 2, 0, [g(1.0)]))
    st.push(message(Kind.PUSHPULL, 2, 2, 0, [g(3.0)]))
    update = st.evict(1)  # the barrier completes without learner 1
    assert update is not None and st.engine.timestamp == 1 and 1 not in st.identities
    assert st.counters.evictions == 1 and st.engine.members == {0, 2}
    assert st.join(1, now=150.0) and st.engine.members == {0, 1, 2}


def test_a_hardsync_learner_saying_hello_again_is_welcomed_after_the_update_it_is_in():
    st = state("sync.protocol=hardsync", "sync.learners=2")
    hello(st, 0), hello(st, 1)
    assert st.admit(b"0", 0, 1) and st.where(0) == {"step": 0}
    st.push(message(Kind.PUSH, 0, 2, 0, [g(1.0)]))
    hello(st, 0, seq=3)  # restarted with its gradient pending
    assert not st.admit(b"0", 0, 3) and st.welcomes_due() == []
    st.push(message(Kind.PUSH, 1, 2, 0, [g(2.0)]))
    assert st.engine.timestamp == 1 and st.welcomes_due() == [(b"0", 0, 3)]
    assert st.welcomes_due() == [] and st.where(0) == {"step": 1}
    st.push(message(Kind.PUSH, 0, 4, 1, [g(1.0)]))
    assert not st.admit(b"0", 0, 5)
    st.done = True  # training over: every held one is let go
    assert st.welcomes_due() == [(b"0", 0, 5)]


def test_a_snapshot_restored_through_a_checkpoint_continues_identically(tmp_path):
    a = state("sync.protocol=softsync", "sync.learners=2", "sync.n=1")
    hello(a, 0), hello(a, 1)
    for seq, (learner, value) in enumerate([(0, 1.0), (1, 2.0), (0, 0.5)], start=2):
        a.push(message(Kind.PUSHPULL, learner, seq, a.engine.timestamp, [g(value)]))
    arrays, meta = a.snapshot()
    checkpoint.save(tmp_path, arrays, meta)
    b = state("sync.protocol=softsync", "sync.learners=2", "sync.n=1")
    ck = checkpoint.load_latest(tmp_path)
    b.restore(ck.arrays, ck.meta)
    assert b.incarnations == a.incarnations + [b.incarnation] and b.restored_ts == 1
    assert b.engine.state_dict() == a.engine.state_dict() and b.steps == a.steps == {0: 2, 1: 1}
    for name in ("w", "v", "acc"):
        np.testing.assert_array_equal(arrays[name], ck.arrays[name])
    # the same next gradient gives the same weights on both
    for st in (a, b):
        hello(st, 1, seq=10)
        st.push(message(Kind.PUSHPULL, 1, 11, 1, [g(-1.0)]))
    np.testing.assert_array_equal(a.w, b.w)
    assert b.applied[1] == a.applied[1]


def test_updates_lost_in_a_restart_are_counted_from_what_rejoining_learners_saw(tmp_path):
    a = state("sync.protocol=async", "sync.learners=2")
    hello(a, 0)
    checkpoint.save(tmp_path, *a.snapshot())  # at timestamp 0
    b = state("sync.protocol=async", "sync.learners=2")
    ck = checkpoint.load_latest(tmp_path)
    b.restore(ck.arrays, ck.meta)
    hello(b, 0, seq=5, had=7)
    hello(b, 1, seq=5, had=4)
    assert b.counters.lost_updates == 7


def test_a_finished_run_restored_with_more_epochs_goes_on(tmp_path):
    a = state("sync.protocol=async", "train.epochs=1")  # 8 gradients of µ=8 in an epoch of 64
    hello(a, 0)
    for seq in range(2, 10):
        a.push(message(Kind.PUSH, 0, seq, a.engine.timestamp, [g(1.0)]))
    a.mark_stopped(0), a.mark_stopped(1)
    assert a.done and a.all_stopped
    checkpoint.save(tmp_path, *a.snapshot())
    ck = checkpoint.load_latest(tmp_path)
    b = state("sync.protocol=async", "train.epochs=2")
    b.restore(ck.arrays, ck.meta)
    assert not b.done and b.stopped == set() and b.engine.timestamp == 8
    c = state("sync.protocol=async", "train.epochs=1")
    c.restore(ck.arrays, ck.meta)
    assert c.done and not c.all_stopped  # learners are told STOP when they say HELLO


def test_a_checkpoint_of_another_model_is_refused_naming_both():
    a = state("sync.protocol=async")
    arrays, meta = a.snapshot()
    meta = {**meta, "numel": N + 1}
    with pytest.raises(ValueError, match="13 parameters .* 12"):
        state("sync.protocol=async").restore(arrays, meta)


def test_a_tree_node_hands_each_learner_its_data_step_from_the_root_plus_its_own():
    from rudra_zmq.tree.state import NodeState

    cfg = small_config(
        "sync.protocol=softsync",
        "sync.learners=4",
        "sync.n=1",
        "architecture.kind=adv",
        "architecture.fanout=2",
    )
    st = NodeState(cfg, 0)  # the leaf of learners 0 and 1
    for i in (0, 1):
        st.register(str(i).encode(), message(Kind.HELLO, i, 1, model=SIG, numel=N))
    st.welcomed(
        {
            "learners": 4,
            "protocol": "softsync",
            "steps": [[0, 7], [1, 5], [2, 99], [1, -3], "junk"],
        },
        [],
        0,
    )  # 2: not below it
    assert st.welcome == {"learners": 4, "protocol": "softsync"} and st.steps == {0: 7, 1: 5}
    st.add(b"0", message(Kind.PUSHPULL, 0, 2, 0, [g(1.0)]), [(0, 0)], [g(1.0)])
    assert st.where(0) == {"step": 8} and st.where(1) == {"step": 5}
