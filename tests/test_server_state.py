"""The servers' state objects on their own: no sockets, messages built with wire.encode."""

import numpy as np
import pytest

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server.state import ServerState
from rudra_zmq.sync import NOW, ProtocolViolation, Reply
from rudra_zmq.tree.state import NodeState
from rudra_zmq.wire import Kind
from test_ps import expected_step

N, SIG = 12, "sig"


def message(kind, sender, ts=0, payloads=(), **fields):
    return wire.decode(wire.encode(kind, sender, 1, ts, 0, list(payloads), **fields))


def state(*overrides):
    cfg = small_config(*overrides)
    w0 = np.linspace(-1, 1, N, dtype=np.float32)
    return cfg, ServerState(cfg, w0, [(0, N, 1.0, 1.0)], SIG, epoch_size=64), w0


def hello(st, learner, ident=None, **fields):
    st.register(
        ident or str(learner).encode(), message(Kind.HELLO, learner, model=SIG, numel=N, **fields)
    )


def test_hardsync_updates_once_every_learner_pushed_and_matches_the_oracle():
    cfg, st, w0 = state("sync.protocol=hardsync")
    hello(st, 0), hello(st, 1)
    g = [np.full(N, 0.5, np.float32), np.arange(N, dtype=np.float32)]
    first = st.push(message(Kind.PUSHPULL, 0, 0, [g[0]]))
    assert (first.sigma, first.update) == (0, None) and st.engine.timestamp == 0
    assert first.reply == Reply(after=1) and st.reply(0) == Reply(after=1) and st.reply(1) == NOW
    last = st.push(message(Kind.PUSHPULL, 1, 0, [g[1]]))
    assert last.sigma == 0 and last.update.timestamp == 1 and st.engine.timestamp == 1
    assert last.reply == NOW and st.engine.due(first.reply)
    w1, _ = expected_step(w0, np.zeros_like(w0), g, cfg, [(0, N, 1.0, 1.0)])
    np.testing.assert_allclose(st.w, w1, rtol=1e-6)


def test_refused_messages_leave_the_state_as_it_was():
    _, st, w0 = state("sync.protocol=hardsync")
    with pytest.raises(ProtocolViolation, match="another model config"):
        st.register(b"0", message(Kind.HELLO, 0, model="other", numel=N))
    with pytest.raises(ProtocolViolation, match="out of range"):
        hello(st, 5)
    with pytest.raises(ProtocolViolation, match="as a tree node"):
        hello(st, wire.node_sender(0), subtree=[0, 1])
    assert st.identities == {}
    hello(st, 0)
    push = message(Kind.PUSH, 0, 0, [np.ones(N, np.float32)])
    with pytest.raises(ProtocolViolation, match="has not said HELLO on this connection"):
        st.check_sender(b"elsewhere", push)
    with pytest.raises(ProtocolViolation):  # from the future
        st.push(message(Kind.PUSH, 0, 3, [np.ones(N, np.float32)]))
    np.testing.assert_array_equal(st.w, w0)
    assert st.engine.gradients_received == 0 and not st.updater.acc.any()


def test_training_ends_at_train_epochs_and_stops_count_learners():
    _, st, _ = state("sync.protocol=async", "train.epochs=2")  # 16 gradients of µ=8, epoch 64
    hello(st, 0), hello(st, 1)
    for i in range(16):
        assert not st.done
        st.push(message(Kind.PUSH, i % 2, st.engine.timestamp, [np.ones(N, np.float32)]))
    assert st.done and not st.all_stopped
    st.mark_stopped(0), st.mark_stopped(1)
    assert st.all_stopped


def test_a_root_state_accounts_a_relayed_sum_gradient_by_gradient():
    _, st, _ = state(
        "sync.protocol=softsync",
        "sync.learners=4",
        "sync.n=1",
        "architecture.kind=adv",
        "architecture.fanout=2",
    )
    node = wire.node_sender(0)
    hello(st, node, subtree=[0, 1])
    assert st.subtrees[node] == frozenset({0, 1})
    arrival = st.relay(
        message(Kind.RELAY, node, 0, [np.ones(N, np.float32)], clock=[[0, 0], [1, 0]])
    )
    assert st.engine.gradients_received == 2 and arrival.reply == NOW
    with pytest.raises(ProtocolViolation):
        st.check_sender(
            b"-100", message(Kind.RELAY, node, 0, [np.ones(N, np.float32)], clock=[[2, 0]])
        )  # 2 is not below node 0
    st.mark_stopped(node)
    assert st.stopped == {0, 1}


def test_a_node_state_sums_children_and_hands_out_one_relay_at_a_time():
    cfg = small_config(
        "sync.protocol=hardsync",
        "sync.learners=4",
        "architecture.kind=adv",
        "architecture.fanout=2",
    )
    st = NodeState(cfg, 0)
    for i in (0, 1):
        first = st.register(str(i).encode(), message(Kind.HELLO, i, model=SIG, numel=N))
        assert first == (i == 0)
    assert st.welcomed({"learners": 4, "protocol": "hardsync"}, [], 0) == []
    a, b = np.full(N, 2.0, np.float32), np.full(N, 3.0, np.float32)
    for i, g in ((0, a), (1, b)):
        msg = message(Kind.PUSHPULL, i, 0, [g])
        assert st.take_relay() is None
        st.add(str(i).encode(), msg, st.entries(msg), msg.payloads)
    buf, clock = st.take_relay()
    np.testing.assert_array_equal(buf, a + b)
    assert sorted(clock) == [(0, 0), (1, 0)] and st.take_relay() is None
    flight = st.answered(1, weights=[np.zeros(N, np.float32)])
    assert [f[1] for f in flight] == [0, 1] and st.ts == 1 and len(st.weights) == 1


def test_a_node_state_holds_hellos_rejoins_and_pulls_until_the_parent_answers():
    cfg = small_config(
        "sync.protocol=hardsync",
        "sync.learners=4",
        "architecture.kind=adv",
        "architecture.fanout=2",
    )
    st = NodeState(cfg, 0)
    for i in (0, 1):
        st.register(str(i).encode(), message(Kind.HELLO, i, model=SIG, numel=N))
    assert not st.admit(b"0", 0, 5)  # before the parent's WELCOME: it waits
    w0 = [np.zeros(N, np.float32)]
    assert st.welcomed({"learners": 4, "protocol": "hardsync"}, w0, 0) == [(b"0", 0, 5)]
    assert st.ts == 0 and st.weights is w0 and st.admit(b"1", 1, 6)
    for i in (0, 1):
        msg = message(Kind.PUSHPULL, i, 0, [np.ones(N, np.float32)])
        st.add(str(i).encode(), msg, st.entries(msg), msg.payloads)
    assert not st.admit(b"0b", 0, 7)  # restarted with its gradient in the sum
    reply = st.clock.reply(1)  # hardsync: its pull waits for the update
    assert not st.clock.due(reply)
    st.park(b"1", message(Kind.PULL, 1, 0), reply)
    assert st.rejoins_due() == [] and st.pulls_due() == []
    st.take_relay()
    assert st.rejoins_due() == [] and st.pulls_due() == []  # in flight: still held
    st.answered(1, weights=[np.ones(N, np.float32)])
    assert st.rejoins_due() == [(b"0b", 0, 7)] and st.rejoins_due() == []
    assert st.pulls_due() == [(b"1", 1, 0, 1)] and st.pulls_due() == []
