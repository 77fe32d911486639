"""Rudra-adv PS tree: the plan, the relay clock, RELAY on the wire, and tree nodes driven by
hand (fake learners, a fake or real parent). The root's side: tests/test_tree_root.py."""

import time

import msgpack
import numpy as np
import pytest
import zmq

from cluster import FakeLearner, running, small_config
from rudra_zmq import topology, wire
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.sync import NOW, ProtocolViolation, Reply
from rudra_zmq.sync.relay_clock import RelayClock
from rudra_zmq.tree.node import TreeNode
from rudra_zmq.wire import Kind, WireError
from test_ps import expected_step

pytestmark = pytest.mark.timeout(60)
SIG, NUMEL = "feedface", 12


def adv(*overrides, learners=4, fanout=2, depth=1):
    return small_config(
        "architecture.kind=adv",
        f"architecture.fanout={fanout}",
        f"architecture.depth={depth}",
        f"sync.learners={learners}",
        *overrides,
    )


class FakeParent:
    """A raw ROUTER standing in for a node's parent, to see exactly what the node relays."""

    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "the node sent nothing to its parent"
        ident, *frames = self.sock.recv_multipart()
        return ident, wire.decode(frames)

    def reply(self, ident, kind, ts=0, payloads=(), **fields):
        self.seq += 1
        self.sock.send_multipart(
            [ident, *wire.encode(kind, wire.SENDER_PS, self.seq, ts, 7, payloads, **fields)]
        )

    def quiet(self, timeout_ms=300):
        return not self.sock.poll(timeout_ms)


def grads(k, n=NUMEL, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(k)]


def welcome_leaf(ctx, cfg, node_id=0, learner_ids=(0, 1)):
    """A running leaf under a FakeParent, its learners welcomed; returns the pieces."""
    parent = FakeParent(ctx)
    node = TreeNode(cfg, node_id, "tcp://127.0.0.1:0", parent.endpoint, ctx=ctx)
    learners = [FakeLearner(ctx, node.endpoint, i) for i in learner_ids]
    learners[0].send(Kind.HELLO, model=SIG, numel=NUMEL)
    return parent, node, learners


def both_welcomed(parent, l1, ts: int, protocol: str) -> bytes:
    """The leaf's HELLO upstream answered (WELCOME at ``ts``) once learner 1 said HELLO too;
    returns the leaf's identity at the parent (each learner's WELCOME is left to read)."""
    ident, _ = parent.recv()
    l1.send(Kind.HELLO, model=SIG, numel=NUMEL)
    weights = [np.zeros(NUMEL, np.float32)]
    parent.reply(ident, Kind.WELCOME, ts, weights, learners=4, protocol=protocol)
    return ident


# ----------------------------------------------------------------------------- the plan
def test_the_plan_groups_learners_into_leaves_and_leaves_into_levels():
    t = topology.plan(adv(learners=5, fanout=2, depth=2))
    assert [n.learners for n in t.leaves] == [(0, 1), (2, 3), (4,)]
    assert [(n.id, n.children, n.parent) for n in t.nodes[3:]] == [
        (3, (0, 1), None),
        (4, (2,), None),
    ]
    assert [n.parent for n in t.leaves] == [3, 3, 4] and t.leaf_of(4).id == 2
    assert t.nodes[3].subtree == {0, 1, 2, 3}
    t = topology.plan(adv("architecture.leaves=[[0,3],[1,2]]", learners=4))
    assert [n.learners for n in t.leaves] == [(0, 3), (1, 2)]
    assert topology.learner_groups(t, 1) == [[0], [3], [1], [2]]
    assert topology.learner_groups(t, 2) == [[0, 3], [1, 2]]


def test_tree_of_is_the_plan_for_adv_and_advstar_and_none_for_base():
    assert topology.tree_of(small_config("sync.learners=4")) is None
    for kind in ("adv", "advstar"):
        cfg = small_config(
            f"architecture.kind={kind}",
            "architecture.fanout=2",
            "sync.learners=4",
            "sync.protocol=softsync",
            "sync.n=1",
        )
        assert topology.tree_of(cfg) == topology.plan(cfg)


# ----------------------------------------------------------------------------- relay clock
def test_hardsync_relays_once_every_learner_below_contributed_exactly_once():
    c = RelayClock("hardsync", frozenset({0, 1, 2}), timestamp=3)
    c.add([(0, 3)])
    c.add([(2, 3), (1, 3)])
    assert c.ready and c.take() == [(0, 3), (2, 3), (1, 3)] and not c.ready
    assert c.answered(4) == [(0, 3), (2, 3), (1, 3)] and c.timestamp == 4
    c.add([(1, 4)])
    assert not c.ready  # 0 and 2 still missing


def test_gather_relays_only_once_every_learner_below_has_a_gradient_pending():
    c = RelayClock("softsync", frozenset({0, 1, 2}), timestamp=5, gather=True)
    c.add([(2, 5)])
    c.add([(0, 3)])  # timestamps may differ (softsync)
    assert not c.ready
    c.add([(1, 4)])
    assert c.ready and sorted(c.take()) == [(0, 3), (1, 4), (2, 5)]


def test_softsync_relays_what_is_pending_whenever_no_relay_is_in_flight():
    c = RelayClock("softsync", frozenset({0, 1}), timestamp=5)
    c.add([(0, 4)])
    assert c.ready and c.take() == [(0, 4)]
    c.add([(1, 5)])
    assert not c.ready  # one relay at a time
    c.answered(7)
    assert c.ready and c.take() == [(1, 5)]


def _simulated_staleness(
    tree: bool, relay_s: float, learners=4, n=2, steps=400, seed=0, gather=False, counts=None
):
    """Mean σ of an equal-speed n-softsync run, event by event, with no sockets or clocks:
    flat (every learner talks to the root) or through leaves of 2 whose relay round trip to
    the root takes ``relay_s`` (compute takes 1.0 ± 5 %). The same SyncEngine and RelayClock
    as the parameter server and the tree nodes."""
    import heapq

    from rudra_zmq.sync import LRSchedule, SyncEngine

    rng = np.random.default_rng(seed)
    eng = SyncEngine(
        "softsync", learners, LRSchedule(0.1, "staleness"), n=n, batch_size=1, epoch_size=10**9
    )
    leaves = [
        RelayClock("softsync", frozenset({2 * k, 2 * k + 1}), timestamp=0, gather=gather)
        for k in range(learners // 2)
    ]
    sigmas, ts_of = [], [0] * learners
    events = [(rng.uniform(0.95, 1.05), "push", i) for i in range(learners)]
    heapq.heapify(events)

    def compute(t, i, ts):
        ts_of[i] = ts
        heapq.heappush(events, (t + rng.uniform(0.95, 1.05), "push", i))

    while len(sigmas) < steps:
        t, what, who = heapq.heappop(events)
        if what == "push" and not tree:
            a = eng.receive(who, ts_of[who])
            sigmas.append(a.sigma)
            compute(t, who, eng.timestamp)
        elif what == "push":
            leaf = leaves[who // 2]
            leaf.add([(who, ts_of[who])])
            what, who = "relay?", who // 2
        if what == "relay?" and leaves[who].ready:
            heapq.heappush(events, (t + relay_s / 2, "root", who))
            leaves[who].take()
        elif what == "root":
            if counts is not None:
                counts.append(len(leaves[who]._in_flight))
            a = eng.receive_many(leaves[who]._in_flight)
            sigmas += [
                eng.timestamp - (1 if a.update else 0) - ts for _, ts in leaves[who]._in_flight
            ]
            heapq.heappush(events, (t + relay_s / 2, "answer", (who, eng.timestamp)))
        elif what == "answer":
            k, ts = who
            for learner, _ in leaves[k].answered(ts):
                compute(t, learner, ts)
            heapq.heappush(events, (t, "relay?", k))
    return float(np.mean(sigmas))


def test_softsync_staleness_through_a_tree_is_that_of_flat():
    """c counts learner gradients and each gradient keeps its own timestamp through the
    relay, so for equal-speed learners the root sees flat's ⟨σ⟩ = n(λ-1)/λ = 1.5, whether the
    leaf-root round trip is negligible or nearly a whole compute step."""
    flat = _simulated_staleness(tree=False, relay_s=0.0)
    assert flat == pytest.approx(1.5, abs=0.15)
    for relay_s in (0.001, 0.3, 0.9):
        assert _simulated_staleness(tree=True, relay_s=relay_s) == pytest.approx(flat, abs=0.1)


def test_gather_makes_every_relay_carry_the_subtree_and_keeps_softsync_staleness_bounded():
    """architecture.relay: gather — the root gets one message per leaf of 2 gradients (its
    ingress halves with fan-out 2), and ⟨σ⟩ stays at most flat's (updates hold whole leaves)."""
    counts = []
    flat = _simulated_staleness(tree=False, relay_s=0.0)
    gathered = _simulated_staleness(tree=True, relay_s=0.3, gather=True, counts=counts)
    assert counts and set(counts) == {2}
    assert 0 <= gathered <= flat + 0.1


@pytest.mark.parametrize(
    "entries, match",
    [
        ([(3, 0)], "learner 3 is not below"),
        ([(0, 2), (0, 2)], "previous one was not answered"),
        ([(1, 2)], "previous one was not answered"),  # 1 is pending already
        ([(0, 9)], "only served weights up to 2"),
        ([(0, 1)], "hardsync: learner 0 pushed a gradient of timestamp 1"),
        ([], "at least one"),
    ],
)
def test_the_relay_clock_refuses_bad_gradients_and_stays_unchanged(entries, match):
    c = RelayClock("hardsync", frozenset({0, 1, 2}), timestamp=2)
    c.add([(1, 2)])
    with pytest.raises(ProtocolViolation, match=match):
        c.add(entries)
    assert c.pending == 1 and not c.in_flight


def test_a_relay_clock_holds_a_pull_only_from_a_hardsync_learner_whose_gradient_it_holds():
    c = RelayClock("hardsync", frozenset({0, 1}), timestamp=3)
    c.add([(0, 3)])
    assert c.reply(1) == NOW and c.reply(0) == Reply(after=4) and not c.due(c.reply(0))
    c.add([(1, 3)])
    c.take()
    held = c.reply(0)  # its gradient is in the relay in flight
    assert held == Reply(after=4) and not c.due(held)
    c.answered(4)
    assert c.due(held) and c.reply(0) == NOW
    s = RelayClock("softsync", frozenset({0, 1}), timestamp=3)
    s.add([(0, 3)])
    assert s.reply(0) == NOW


# ----------------------------------------------------------------------------- wire
def test_relay_roundtrip_carries_the_sum_and_its_vector_clock():
    g = np.arange(6, dtype=np.float32)
    frames = wire.encode(Kind.RELAY, wire.node_sender(2), 1, 4, 0, [g], clock=[[0, 4], [3, 2]])
    msg = wire.decode([bytes(memoryview(f)) for f in frames], numel=6, learners=4)
    assert msg.clock == [(0, 4), (3, 2)] and wire.node_id(msg.sender) == 2
    assert wire.sender_name(msg.sender) == "tree node 2"
    np.testing.assert_array_equal(msg.payloads[0], g)


@pytest.mark.parametrize(
    "clock, match",
    [
        ([], "0 entries"),
        ([[0, 1, 2]], "not a \\[learner, timestamp\\] pair"),
        ([[0, 1.5]], "not a \\[learner, timestamp\\] pair"),
        ([[0, -1]], "negative timestamp"),
        ([[4, 0]], "names learner 4, outside 0..3"),
        ([[-1, 0]], "names learner -1"),
        ([[0, 0]] * 5, "5 entries; expected 1..4"),
        ("0,0", "field 'clock' has type str"),
    ],
)
def test_malformed_relay_clocks_are_refused_by_the_wire(clock, match):
    hdr = msgpack.packb(
        {
            "v": wire.PROTOCOL_VERSION,
            "k": int(Kind.RELAY),
            "s": -100,
            "q": 1,
            "ts": 0,
            "inc": 0,
            "p": [["f4", 2]],
            "x": {"clock": clock},
        }
    )
    with pytest.raises(WireError, match=match):
        wire.decode([hdr, np.zeros(2, np.float32).tobytes()], numel=2, learners=4)


# ----------------------------------------------------------------------------- the root
def test_a_leaf_says_hello_upstream_with_its_learners_and_its_range_and_welcomes_its_children(
    ctx,
):
    parent, node, (l0, l1) = welcome_leaf(ctx, adv())
    with running(node) as errors:
        ident, hello = parent.recv()
        assert (hello.kind, hello.sender, hello.fields) == (
            Kind.HELLO,
            -100,  # its range: the plan's for one server, the whole vector
            {"model": SIG, "numel": NUMEL, "range": [0, NUMEL], "subtree": [0, 1]},
        )
        l1.send(Kind.HELLO, model=SIG, numel=NUMEL)
        w = np.arange(NUMEL, dtype=np.float32)
        parent.reply(ident, Kind.WELCOME, 3, [w], learners=4, protocol="hardsync")
        for learner in (l0, l1):
            msg = learner.recv()
            assert msg.kind == Kind.WELCOME and msg.ts == 3 and msg.fields["learners"] == 4
            np.testing.assert_array_equal(msg.payloads[0], w)
        l2 = FakeLearner(ctx, node.endpoint, 2)
        l2.send(Kind.HELLO, model=SIG, numel=NUMEL)
        assert "belongs under tree node 1" in l2.recv().fields["error"]
        l0.close(), l1.close(), l2.close()
    assert not errors


def test_a_leaf_of_range_1s_tree_relays_only_that_range_and_refuses_another(ctx):
    """architecture.servers=2: the tree of server 1's range carries [6, 12) of the 12 floats;
    it says that range upstream, sums 6 floats, and refuses a learner sending range 0."""
    cfg = adv("architecture.servers=2", "sync.protocol=hardsync")
    parent = FakeParent(ctx)
    node = TreeNode(cfg, 0, "tcp://127.0.0.1:0", parent.endpoint, ctx=ctx, server=1)
    l0, l1 = (FakeLearner(ctx, node.endpoint, i) for i in (0, 1))
    l0.send(Kind.HELLO, model=SIG, numel=NUMEL, range=[6, 12])
    with running(node) as errors:
        ident, hello = parent.recv()
        assert hello.fields == {"model": SIG, "numel": NUMEL, "subtree": [0, 1], "range": [6, 12]}
        l1.send(Kind.HELLO, model=SIG, numel=NUMEL, range=[0, 6])
        assert "tree node 0 relays range [6, 12] (server 1)" in l1.recv().fields["error"]
        l1.send(Kind.HELLO, model=SIG, numel=NUMEL, range=[6, 12])
        parent.reply(
            ident, Kind.WELCOME, 0, [np.zeros(6, np.float32)], learners=4, protocol="hardsync"
        )
        assert l0.recv().kind == Kind.WELCOME and l1.recv().kind == Kind.WELCOME
        g = grads(2, 6)
        for learner, gi in zip((l0, l1), g):
            learner.send(Kind.PUSHPULL, 0, [gi])
        _, relay = parent.recv()
        assert relay.kind == Kind.RELAY
        np.testing.assert_allclose(relay.payloads[0], g[0] + g[1], rtol=1e-6)
        l0.close(), l1.close()
    assert not errors


def test_a_hardsync_leaf_relays_the_sum_with_its_clock_and_parks_children_until_answered(ctx):
    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=hardsync"))
    with running(node) as errors:
        ident = both_welcomed(parent, l1, 0, "hardsync")
        l0.recv(), l1.recv()
        for step in range(2):  # the buffers swap each round
            g0, g1 = grads(2, seed=step)
            l1.send(Kind.PUSHPULL, step, [g1])
            assert parent.quiet(), "a hardsync leaf waits for every learner below it"
            l0.send(Kind.PUSHPULL, step, [g0])
            _, relay = parent.recv()
            assert relay.kind == Kind.RELAY and relay.fields == {"clock": relay.fields["clock"]}
            assert relay.clock == [(1, step), (0, step)] and relay.ts == step
            np.testing.assert_array_equal(relay.payloads[0], g1 + g0)
            assert not l0.has_reply(200) and not l1.has_reply(0), "children wait for the root"
            w = np.full(NUMEL, step + 1, np.float32)
            parent.reply(ident, Kind.WEIGHTS, step + 1, [w])
            for learner in (l0, l1):
                msg = learner.recv()
                assert msg.kind == Kind.WEIGHTS and msg.ts == step + 1
                np.testing.assert_array_equal(msg.payloads[0], w)
        l0.close(), l1.close()
    assert not errors and node.state.relays == 2 and node.state.gradients == 4


def test_a_softsync_leaf_relays_at_once_and_sends_what_arrived_meanwhile_next(ctx):
    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=softsync", "sync.n=2"))
    with running(node):
        ident = both_welcomed(parent, l1, 4, "softsync")
        l0.recv(), l1.recv()
        g0, g1 = grads(2)
        l0.send(Kind.PUSHPULL, 4, [g0])
        _, first = parent.recv()
        assert first.clock == [(0, 4)] and set(first.fields) == {"clock"}
        l1.send(Kind.PUSHPULL, 3, [g1])  # arrives during the relay
        assert parent.quiet() and not l0.has_reply(0)
        parent.reply(ident, Kind.UPTODATE, 4)
        assert l0.recv().kind == Kind.UPTODATE  # l0 holds ts 4 already
        _, second = parent.recv()
        assert second.clock == [(1, 3)]
        np.testing.assert_array_equal(second.payloads[0], g1)
        parent.reply(ident, Kind.WEIGHTS, 6, [np.ones(NUMEL, np.float32)])
        assert l1.recv().ts == 6
        l0.send(Kind.PULL, 4)  # a pull is served from cache
        msg = l0.recv()
        assert (msg.kind, msg.ts) == (Kind.WEIGHTS, 6) and parent.quiet()
        l0.close(), l1.close()


def test_a_leaf_refuses_bad_gradients_and_its_sum_stays_unchanged(ctx):
    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=softsync", "sync.n=1"))
    with running(node):
        ident, _ = parent.recv()
        parent.reply(
            ident, Kind.WELCOME, 2, [np.zeros(NUMEL, np.float32)], learners=4, protocol="softsync"
        )
        l0.recv()
        g = np.ones(NUMEL, np.float32)
        cases = [
            (l1, wire.encode(Kind.PUSHPULL, 1, 1, 2, 0, [g]), "has not said HELLO"),
            (l0, wire.encode(Kind.PUSHPULL, 0, 1, 5, 0, [g]), "up to 2"),
            (l0, wire.encode(Kind.PUSHPULL, 0, 1, 2, 0, [g[:-1]]), "the model has"),
            (
                l0,
                wire.encode(Kind.RELAY, 0, 1, 2, 0, [g], clock=[[0, 2]]),
                "learners push gradients",
            ),
            (l0, wire.encode(Kind.HELLO, 0, 1, model="other", numel=NUMEL), "another model"),
        ]
        for who, frames, text in cases:
            who.send_raw(frames)
            r = who.recv()
            assert r.kind == Kind.ERROR and text in r.fields["error"], r.fields
        assert parent.quiet(100) and node.state.clock.pending == 0 and node.state.gradients == 0
        assert node.state.invalid == len(cases)
        l0.close(), l1.close()


def stop_after_one_push(parent, l0, l1):
    """In a running async leaf (:func:`welcome_leaf`): welcome both learners, relay one push
    of learner 0's, then the parent says STOP, which learner 0 is told at once."""
    ident = both_welcomed(parent, l1, 0, "async")
    l0.recv(), l1.recv()
    l0.send(Kind.PUSHPULL, 0, [np.ones(NUMEL, np.float32)])
    parent.recv()
    parent.reply(ident, Kind.STOP, reason="training finished")
    assert l0.recv().kind == Kind.STOP


def test_a_stop_from_the_parent_reaches_every_child_and_the_node_returns(ctx):
    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=async"))
    with running(node) as errors:
        stop_after_one_push(parent, l0, l1)
        l1.send(Kind.PUSHPULL, 0, [np.ones(NUMEL, np.float32)])
        assert l1.recv().fields["reason"] == "training finished"
        deadline = time.time() + 5
        while not node.sock.closed and time.time() < deadline:
            time.sleep(0.05)
        assert node.sock.closed, "the node returns once every learner below was told"
        l0.close(), l1.close()
    assert not errors


def test_a_silent_parent_is_an_error_naming_it_not_a_hang(ctx):
    parent, node, _ = welcome_leaf(ctx, adv("runtime.timeout_s=1"))
    t0 = time.time()
    with pytest.raises(TimeoutError, match=r"tree node 0: no reply from its parent \(the root\)"):
        node.serve_forever()
    assert time.time() - t0 < 5


def test_a_depth_two_tree_gives_the_flat_hardsync_update(ctx):
    cfg = adv("sync.protocol=hardsync", depth=2)
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    inner = TreeNode(cfg, 2, "tcp://127.0.0.1:0", ps.endpoint, ctx=ctx)
    leaves = [TreeNode(cfg, k, "tcp://127.0.0.1:0", inner.endpoint, ctx=ctx) for k in (0, 1)]
    with (
        running(ps) as e0,
        running(inner) as e1,
        running(leaves[0]) as e2,
        running(leaves[1]) as e3,
    ):
        ls = [FakeLearner(ctx, leaves[i // 2].endpoint, i) for i in range(4)]
        w0 = [learner.hello(ps.state.signature, ps.state.numel)[0] for learner in ls][0]
        g = grads(4, ps.state.numel)
        for i in (3, 0, 2, 1):
            ls[i].send(Kind.PUSHPULL, 0, [g[i]])
        w1, _ = expected_step(w0, np.zeros_like(w0), g, cfg, ps.state.updater.segments)
        for learner in ls:
            msg = learner.recv()
            assert msg.kind == Kind.WEIGHTS and msg.ts == 1
            np.testing.assert_allclose(np.concatenate(msg.payloads), w1, rtol=1e-5, atol=1e-6)
        assert ps.state.engine.updates == 1 and ps.state.engine.gradients_received == 4
        for learner in ls:
            learner.close()
    assert not (e0 or e1 or e2 or e3)


def test_a_reply_a_leaf_could_not_queue_is_asked_for_again_and_relayed_once(ctx):
    """A leaf's answer to learner 0 dropped (its queue full, EAGAIN): the learner's CHECK hears
    "not got", the copy it sends again is answered as before and not relayed again."""
    from test_ps import drop_first_answer

    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=softsync", "sync.n=2"))
    dropped = drop_first_answer(node.sock, 2)
    with running(node):
        ident = both_welcomed(parent, l1, 4, "softsync")
        l0.recv(), l1.recv()
        push = wire.encode(Kind.PUSHPULL, 0, 2, 4, 0, [grads(1)[0]])
        l0.send_raw(push)
        parent.recv()
        parent.reply(ident, Kind.UPTODATE, 4)
        deadline = time.monotonic() + 10  # the leaf answers once it reads the parent's reply
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped == [2] and not l0.has_reply(0)
        l0.send_raw(wire.encode(Kind.CHECK, 0, 2, 0, 0))
        assert l0.recv().fields == {"re": 2, "got": False}
        l0.send_raw(push)  # Channel.resend: the same request
        assert (msg := l0.recv()).kind == Kind.UPTODATE and msg.fields["re"] == 2
        assert parent.quiet()  # not relayed twice
        l0.close(), l1.close()


def test_a_last_stop_a_leaf_could_not_queue_is_told_again_before_it_returns(ctx):
    """The STOP to the last learner below finds its queue full (EAGAIN): the leaf stays
    runtime.retry_s + 1 s for that learner's CHECK ("not got") and tells it STOP again when
    it sends again (before, the leaf returned at once and the learner waited out its
    timeout)."""
    from test_ps import drop_first_answer

    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=async", "runtime.retry_s=1"))
    dropped = drop_first_answer(node.sock, 2, to=b"1")
    with running(node) as errors:
        stop_after_one_push(parent, l0, l1)
        push = wire.encode(Kind.PUSHPULL, 1, 2, 0, 0, [np.ones(NUMEL, np.float32)])
        l1.send_raw(push)
        deadline = time.monotonic() + 10
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped == [2]
        l1.send_raw(wire.encode(Kind.CHECK, 1, 2, 0, 0))
        assert l1.recv().fields == {"re": 2, "got": False}
        l1.send_raw(push)
        assert (msg := l1.recv()).kind == Kind.STOP and msg.fields["re"] == 2
        l0.close(), l1.close()
    assert not errors
