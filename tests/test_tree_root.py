"""Rudra-adv at the root: the parameter server accepting tree nodes and their relayed sums
(hand-driven fake nodes and learners, real ZeroMQ sockets)."""

import time

import numpy as np
import pytest

from cluster import FakeLearner, running, small_config
from rudra_zmq import wire
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.wire import Kind
from test_ps import expected_step
from test_tree import adv, grads

pytestmark = pytest.mark.timeout(60)


def node_hello(ctx, ps, node_id, subtree):
    n = FakeLearner(ctx, ps.endpoint, wire.node_sender(node_id))
    n.send(Kind.HELLO, model=ps.state.signature, numel=ps.state.numel, subtree=subtree)
    msg = n.recv()
    assert msg.kind == Kind.WELCOME, msg.fields
    return n, np.concatenate(msg.payloads)


def test_the_root_averages_relayed_sums_like_flat_hardsync(ctx):
    cfg = adv("sync.protocol=hardsync")
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    with running(ps) as errors:
        (a, w0), (b, _) = node_hello(ctx, ps, 0, [0, 1]), node_hello(ctx, ps, 1, [2, 3])
        g = grads(4, ps.state.numel)
        a.send(Kind.RELAY, 0, [g[0] + g[1]], clock=[[0, 0], [1, 0]])
        assert not a.has_reply(300), "hardsync: the root waits for every learner's gradient"
        b.send(Kind.RELAY, 0, [g[2] + g[3]], clock=[[3, 0], [2, 0]])
        ra, rb = a.recv(), b.recv()
        assert ra.kind == rb.kind == Kind.WEIGHTS and ra.ts == rb.ts == 1
        w1, _ = expected_step(w0, np.zeros_like(w0), g, cfg, ps.state.updater.segments)
        np.testing.assert_allclose(np.concatenate(ra.payloads), w1, rtol=1e-5, atol=1e-6)
        a.close(), b.close()
    assert not errors
    assert ps.state.engine.gradients_received == 4 and ps.state.engine.updates == 1


def test_the_root_refuses_malformed_relays_and_leaves_its_state_bit_identical(ctx):
    cfg = adv("sync.protocol=hardsync")
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    with running(ps):
        a, _ = node_hello(ctx, ps, 0, [0, 1])
        before = ps.state.w.copy(), ps.state.updater.v.copy(), ps.state.updater.acc.copy()
        good = np.ones(ps.state.numel, np.float32)
        seqs = iter(range(10**6, 2 * 10**6))  # after the HELLO's: each one is new

        def relay(clock, ts=0, g=good, s=-100):
            return wire.encode(Kind.RELAY, s, next(seqs), ts, 0, [g], clock=clock)

        cases = [
            (relay([[2, 0]]), "protocol", "learner 2, which is not below it"),
            (relay([[0, 0], [0, 0]]), "protocol", "two gradients of learner 0"),
            (relay([[9, 0]]), "bad_clock", "outside 0..3"),
            (relay([[0, 0]], g=good[:-4]), "bad_length", "the model has"),
            (relay([[0, 1]], ts=1), "protocol", "newer than the server's"),
            (
                wire.encode(Kind.PUSHPULL, -100, 1, 0, 0, [good]),
                "protocol",
                "tree nodes send their gradient sums as RELAY",
            ),
            (relay([[2, 0]], s=-101), "rejoin", "tree node 1 has not said HELLO"),
            (
                wire.encode(Kind.HELLO, 0, 1, model=ps.state.signature, numel=ps.state.numel),
                "protocol",
                "belongs under tree node 0",
            ),
            (
                wire.encode(
                    Kind.HELLO, -101, 1, model=ps.state.signature, numel=ps.state.numel, subtree=[2]
                ),
                "protocol",
                "places learners [2, 3] below it",
            ),
            (
                wire.encode(
                    Kind.HELLO, -107, 1, model=ps.state.signature, numel=ps.state.numel, subtree=[2]
                ),
                "protocol",
                "tree node 7 is not a child of the root",
            ),
        ]
        for frames, code, text in cases:
            a.send_raw(frames)
            r = a.recv()
            assert r.kind == Kind.ERROR and r.fields["code"] == code, (code, r.fields)
            assert text in r.fields["error"], r.fields["error"]
        for arr, ref in zip((ps.state.w, ps.state.updater.v, ps.state.updater.acc), before):
            assert arr.tobytes() == ref.tobytes()
        assert ps.state.engine.gradients_received == 0 and ps.state.engine.timestamp == 0
        a.close()


def test_a_stop_to_a_node_counts_for_every_learner_below_it(ctx):
    cfg = adv("sync.protocol=async", "train.epochs=0.022")  # 4 gradients of 8 samples
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    with running(ps):
        (a, _), (b, _) = node_hello(ctx, ps, 0, [0, 1]), node_hello(ctx, ps, 1, [2, 3])
        g = np.zeros(ps.state.numel, np.float32)
        a.send(Kind.RELAY, 0, [g], clock=[[0, 0], [1, 0]])
        assert a.recv().kind == Kind.WEIGHTS
        b.send(Kind.RELAY, 0, [g], clock=[[2, 0], [3, 0]])
        assert b.recv().kind == Kind.STOP
        assert ps.state.stopped == {2, 3}
        a.send(Kind.RELAY, 1, [g], clock=[[0, 1]])
        assert a.recv().kind == Kind.STOP
        deadline = time.time() + 5
        while ps.sock and not ps.sock.closed and time.time() < deadline:
            time.sleep(0.05)  # the server returns by itself
        assert ps.sock.closed and ps.state.stopped == {0, 1, 2, 3}
        a.close(), b.close()


# ----------------------------------------------------------------------------- tree nodes
def test_a_base_parameter_server_refuses_tree_nodes(ctx):
    ps = ParameterServer(small_config(), "tcp://127.0.0.1:0", ctx=ctx)
    with running(ps):
        n = FakeLearner(ctx, ps.endpoint, wire.node_sender(0))
        n.send(Kind.HELLO, model=ps.state.signature, numel=ps.state.numel, subtree=[0, 1])
        r = n.recv()
        assert r.kind == Kind.ERROR and "runs architecture.kind=base" in r.fields["error"]
        n.close()
