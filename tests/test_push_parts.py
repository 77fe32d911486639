"""Gradients pushed in parts (GPART..., PUSHPULL x{parts}): cut-through and store-and-forward
updates through a real parameter server, against the same gradients pushed whole."""
import numpy as np
import pytest

from cluster import FakeLearner, running, small_config
from rudra_zmq import transport, wire
from rudra_zmq.roles import push_parts
from rudra_zmq.roles.ps import ParameterServer
from rudra_zmq.wire import Kind

N, PART = 600_000, 200_000
pytestmark = pytest.mark.timeout(60)


def synthetic_ps(ctx, *overrides):
    cfg = small_config("sync.learners=2", *overrides)
    w0 = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    return ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx,
                           model=(w0, [(0, N // 3, 1.0, 1.0), (N // 3, N, 2.0, 0.0)], "synth"))


def channel(ctx, ps, learner):
    ch = transport.Channel(ctx, ps.endpoint, learner, timeout_ms=5000)
    ch.send(Kind.HELLO, model=ps.signature, numel=N)
    ch.recv({Kind.WELCOME}, numel=N)
    return ch


def state(ps):
    return ps.w.copy(), ps.v.copy(), ps.acc.copy(), ps.engine.timestamp


def assert_same_state(a, b):
    for x, y in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(x, y)
    assert a[3] == b[3]


def send_parts(learner, g, ts, part=PART, kind=Kind.PUSHPULL, **final):
    """GPARTs of ``part`` floats, then the final message (fields overridable)."""
    starts = list(range(0, N, part))
    for lo in starts[:-1]:
        learner.send(Kind.GPART, ts, [g[lo:lo + part]], offset=lo, pull=kind == Kind.PUSHPULL)
    fields = {"parts": len(starts) - 1, **({"wait": False} if kind == Kind.PUSHPULL else {}),
              **final}
    learner.send(kind, ts, [g[starts[-1]:]], **fields)


def replies_until_final(learner):
    msgs = [learner.recv()]
    while msgs[-1].kind == Kind.WPART:
        msgs.append(learner.recv())
    return msgs


@pytest.mark.parametrize("protocol,overrides", [
    ("async", []),                                   # cut-through: every gradient updates
    ("softsync", ["sync.n=1"]),                      # c = 2: store-and-forward
    ("async", ["optimizer.lr_policy=staleness"]),    # cut-through with α0/⟨σ⟩
    ("async", ["optimizer.momentum=0"]),             # plain SGD
])
def test_a_gradient_in_parts_updates_exactly_like_the_whole_gradient(ctx, protocol, overrides):
    """Two servers, the same gradients (some stale): one gets them whole, the other in parts
    through Channel.send_gradient (the learner's call). Replies, weights, momentum and
    timestamps agree bit for bit after every push."""
    sets = [f"sync.protocol={protocol}", *overrides]
    whole, parted = synthetic_ps(ctx, *sets), synthetic_ps(ctx, *sets)
    with running(whole) as e1, running(parted) as e2:
        chans = {(ps, i): channel(ctx, ps, i) for ps in (whole, parted) for i in (0, 1)}
        rng = np.random.default_rng(3)
        for learner, lag in [(0, 0), (1, 1), (0, 0), (1, 2), (0, 1), (1, 0), (0, 0)]:
            ts = max(0, whole.engine.timestamp - lag)   # some stale, as learners' are
            g = rng.standard_normal(N).astype(np.float32)
            got = []
            for ps, part in ((whole, N), (parted, PART)):
                ch = chans[(ps, learner)]
                ch.send_gradient(Kind.PUSHPULL, ts, g, part, wait=False)
                got.append(ch.recv({Kind.WEIGHTS, Kind.UPTODATE}, N))
            assert (got[0].kind, got[0].ts, got[0].fields.get("sigma")) == \
                (got[1].kind, got[1].ts, got[1].fields.get("sigma"))
            if got[0].kind == Kind.WEIGHTS:
                np.testing.assert_array_equal(np.concatenate(got[0].payloads),
                                              np.concatenate(got[1].payloads))
            assert_same_state(state(whole), state(parted))
        assert parted.invalid == 0 and not parted._parts and parted._cut is None
        for ch in chans.values():
            ch.close()
    assert not e1 and not e2


def test_cut_through_streams_each_weight_part_as_its_gradient_part_arrives(ctx):
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, N)
        g = np.ones(N, np.float32)
        a.send(Kind.GPART, 0, [g[:PART]], offset=0, pull=True)
        first = a.recv()            # before the rest of the gradient was even sent
        assert (first.kind, first.ts, first.fields) == (Kind.WPART, 1, {"offset": 0})
        assert ps.engine.timestamp == 0   # nothing adopted yet
        a.send(Kind.GPART, 0, [g[PART:2 * PART]], offset=PART, pull=True)
        a.send(Kind.PUSHPULL, 0, [g[2 * PART:]], wait=False, parts=2)
        msgs = [first, *replies_until_final(a)]
        assert [m.kind for m in msgs] == [Kind.WPART, Kind.WPART, Kind.WEIGHTS]
        reply = wire.assemble(msgs[:-1], msgs[-1], N)
        np.testing.assert_array_equal(np.concatenate(reply.payloads), ps.w)
        assert ps.engine.timestamp == 1
        a.close()
    assert not errors


def _bad_sequences(g):
    """(name, the messages a learner sends) that a server must refuse."""
    p0 = (Kind.GPART, 0, [g[:PART]], dict(offset=0, pull=True))
    p1 = (Kind.GPART, 0, [g[PART:2 * PART]], dict(offset=PART, pull=True))
    end = (Kind.PUSHPULL, 0, [g[2 * PART:]], dict(wait=False, parts=2))
    return [
        ("a gap between parts", [p0, (Kind.GPART, 0, [g[:PART]], dict(offset=2 * PART,
                                                                      pull=True)), end]),
        ("a part of another timestamp", [p0, (Kind.GPART, 1, p1[2], p1[3]), end]),
        ("the final message miscounts the parts", [p0, p1, (*end[:3], dict(wait=False,
                                                                          parts=3))]),
        ("the parts fall short of the model", [p0, p1, (Kind.PUSHPULL, 0, [g[2 * PART:-1]],
                                                        end[3])]),
        ("a PULL in the middle", [p0, p1, (Kind.PULL, 0, [], dict(wait=False))]),
        ("a PUSH ends a pulling sequence", [p0, p1, (Kind.PUSH, 0, [g[2 * PART:]],
                                                     dict(parts=2))]),
        ("no first part", [p1, end]),
        ("a final message with no parts before it", [end]),
        ("a gradient newer than the server", [(Kind.GPART, 5, p0[2], p0[3]), p1, end]),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_bad_sequence_is_refused_once_and_leaves_the_server_bit_identical(ctx, case):
    """Whether the server took the first parts cut-through (async) or not, a sequence that
    goes wrong anywhere is answered with one ERROR (after any weight parts already sent),
    the rest of it is dropped silently, and weights, momentum, sum and timestamp are exactly
    as before. The learner's next, correct, gradient is then taken as usual."""
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, N)
        g = np.random.default_rng(4).standard_normal(N).astype(np.float32)
        send_parts(a, g, 0)                          # a first update, so v is not zero
        replies_until_final(a)
        before = state(ps)
        name, seq = _bad_sequences(g)[case]
        for kind, ts, payloads, fields in seq:
            a.send(kind, ts, payloads, **fields)
        msgs = replies_until_final(a)
        assert msgs[-1].kind == Kind.ERROR, (name, [m.kind for m in msgs])
        assert all(m.kind == Kind.WPART for m in msgs[:-1]), name
        assert not a.has_reply(300), f"{name}: more than one answer"
        assert_same_state(before, state(ps))
        assert ps._cut is None and not ps._parts
        send_parts(a, g, 1)
        assert replies_until_final(a)[-1].kind == Kind.WEIGHTS
        assert ps.engine.timestamp == 2
        a.close()
    assert not errors


def test_a_channel_raises_the_error_that_follows_weight_parts(ctx):
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        ch = channel(ctx, ps, 0)
        g = np.zeros(N, np.float32)
        ch.send(Kind.GPART, 0, [g[:PART]], offset=0, pull=True)
        ch.send(Kind.PUSHPULL, 0, [g[PART:-5]], wait=False, parts=1)   # 5 floats short
        with pytest.raises(transport.ServerError, match="add up to 599,995"):
            ch.recv({Kind.WEIGHTS}, N)
        ch.close()
    assert not errors


def test_other_learners_wait_behind_a_cut_through_update_and_see_its_result(ctx):
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        a.hello(ps.signature, N), b.hello(ps.signature, N)
        g = np.ones(N, np.float32)
        a.send(Kind.GPART, 0, [g[:PART]], offset=0, pull=True)
        assert a.recv().kind == Kind.WPART
        b.send(Kind.PULL, 0, wait=False)
        b.send(Kind.PUSHPULL, 0, [g], wait=False)
        assert not b.has_reply(300), "B must wait until A's update is adopted"
        a.send(Kind.GPART, 0, [g[PART:2 * PART]], offset=PART, pull=True)
        a.send(Kind.PUSHPULL, 0, [g[2 * PART:]], wait=False, parts=2)
        assert replies_until_final(a)[-1].ts == 1
        pulled, pushed = b.recv(), replies_until_final(b)[-1]   # (B's reply may be streamed)
        assert (pulled.kind, pulled.ts) == (Kind.WEIGHTS, 1)     # A's update, in order
        assert (pushed.kind, pushed.ts, pushed.fields["sigma"]) == (Kind.WEIGHTS, 2, 1)
        a.close(), b.close()
    assert not errors


def half_sent_with_a_pull_held(ctx, ps):
    """Learner 0 opens a cut-through update with its first part only; learner 1's PULL is then
    held behind it. Returns (learner 0, learner 1, the server's state before)."""
    a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
    a.hello(ps.signature, N), b.hello(ps.signature, N)
    before = state(ps)
    a.send(Kind.GPART, 0, [np.ones(PART, np.float32)], offset=0, pull=True)
    assert a.recv().kind == Kind.WPART
    b.send(Kind.PULL, 0, wait=False)
    assert not b.has_reply(200), "the PULL must wait behind the open cut-through"
    return a, b, before


def test_a_learner_that_stops_mid_gradient_is_dropped_and_the_others_go_on(ctx, monkeypatch):
    monkeypatch.setattr(push_parts, "PART_GAP_S", 0.5)
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        a, b, before = half_sent_with_a_pull_held(ctx, ps)
        err = a.recv()
        assert (err.kind, err.fields["code"]) == (Kind.ERROR, "parts_timeout")
        assert b.recv().kind == Kind.UPTODATE
        assert_same_state(before, state(ps))
        a.close(), b.close()
    assert not errors


def test_training_end_answers_a_gradient_in_parts_with_one_stop(ctx):
    """The final update is never cut through (its answer is STOP), and once training is done
    the parts of a gradient get no answer of their own: one STOP for the sequence."""
    ps = synthetic_ps(ctx, "sync.protocol=async", "train.epochs=0.01")   # digits: 1797/8 ...
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, N)
        g = np.ones(N, np.float32)
        kinds = []
        for _ in range(20):
            send_parts(a, g, ps.engine.timestamp)
            kinds.append(replies_until_final(a)[-1].kind)
            if kinds[-1] == Kind.STOP:
                break
        assert kinds[-1] == Kind.STOP and set(kinds[:-1]) == {Kind.WEIGHTS}
        send_parts(a, g, ps.engine.timestamp)     # after the end: one STOP, nothing else
        assert a.recv().kind == Kind.STOP and not a.has_reply(300)
        a.close()
    assert not errors


def test_a_tree_node_may_not_push_parts_and_decode_refuses_parts_unless_asked():
    g = np.zeros(10, np.float32)
    frames = wire.encode(Kind.PUSHPULL, 0, 1, 0, 0, [g], wait=False, parts=1)
    with pytest.raises(wire.WireError, match="goes only to the parameter server"):
        wire.decode(frames, numel=20)
    assert wire.decode(frames, numel=20, gradient_parts=True).payload_numel == 10
    part = wire.encode(Kind.GPART, 0, 1, 0, 0, [g], offset=15, pull=True)
    with pytest.raises(wire.WireError, match=r"GPART \[15, 25\) is not a non-empty part"):
        wire.decode(part, numel=20)
    with pytest.raises(wire.WireError, match="parts must be 0..4096"):
        wire.decode(wire.encode(Kind.PUSH, 0, 1, 0, 0, [g], parts=-1), gradient_parts=True)


def test_a_learner_that_says_hello_again_starts_its_gradients_afresh(ctx):
    """A restarted learner (same id) abandons the sequence its old self left half sent; the
    held messages of others go on, and its new gradient is taken."""
    ps = synthetic_ps(ctx, "sync.protocol=async")
    with running(ps) as errors:
        a, b, before = half_sent_with_a_pull_held(ctx, ps)
        a.close()
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, N)
        assert b.recv().kind == Kind.UPTODATE
        assert_same_state(before, state(ps))
        send_parts(a, np.ones(N, np.float32), 0)
        assert replies_until_final(a)[-1].kind == Kind.WEIGHTS and ps.engine.timestamp == 1
        a.close(), b.close()
    assert not errors


def test_a_gradient_half_sent_when_training_ends_gets_one_stop_and_is_forgotten(ctx):
    """Async, and the very first update ends training: learner 0's parts (not cut through:
    the final update answers STOP) are still arriving when learner 1's whole gradient makes
    that update. The rest of learner 0's parts get no answer, its final message one STOP, and
    the server keeps nothing of the sequence (no later parts_timeout ERROR)."""
    ps = synthetic_ps(ctx, "sync.protocol=async", "train.epochs=0.001")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        a.hello(ps.signature, N), b.hello(ps.signature, N)
        g = np.ones(N, np.float32)
        a.send(Kind.GPART, 0, [g[:PART]], offset=0, pull=True)
        assert not a.has_reply(200)                     # stored, not cut through
        b.send(Kind.PUSHPULL, 0, [g], wait=False)
        assert b.recv().kind == Kind.STOP and ps.done
        a.send(Kind.GPART, 0, [g[PART:2 * PART]], offset=PART, pull=True)
        a.send(Kind.PUSHPULL, 0, [g[2 * PART:]], wait=False, parts=2)
        assert a.recv().kind == Kind.STOP and not a.has_reply(300)
        assert not ps._parts and ps.engine.timestamp == 1
        a.close(), b.close()
    assert not errors
