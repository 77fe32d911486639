"""The parameter server's hot request (roles/ps_hot.py, fastio.HotPS) against its general
path: the same messages must give bit-identical weights, momentum and replies."""
import numpy as np
import pytest

from cluster import FakeLearner, running, small_config
from rudra_zmq import transport, wire
from rudra_zmq.roles.ps import ParameterServer
from rudra_zmq.wire import Kind

N = 3000


def _ps(ctx, *overrides, hot=True):
    cfg = small_config("sync.protocol=async", f"runtime.hot_path={str(hot).lower()}",
                       *overrides)
    w0 = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx, model=(
        w0, [(0, 1000, 1.0, 1.0), (1000, 2500, 2.0, 0.0), (2500, N, 0.5, 3.0)], "hot-test"))
    return ps


def _script(ps, ctx):
    """One fixed exchange: stale and fresh gradients of two learners, a pull, refused
    messages in between; returns every reply as comparable tuples."""
    rng = np.random.default_rng(5)
    a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
    out = []
    try:
        a.hello(ps.signature, ps.numel)
        b.hello(ps.signature, ps.numel)

        def push(who, ts):
            who.send(Kind.PUSHPULL, ts, [rng.standard_normal(N).astype(np.float32)],
                     wait=False)
            msgs = [who.recv()]
            while msgs[-1].kind == Kind.WPART:      # a streamed reply: its parts, in order
                msgs.append(who.recv())
            for r in msgs:
                out.append((r.kind, r.ts, dict(r.fields), [p.copy() for p in r.payloads]))
            return msgs[-1].ts

        ts_a = push(a, 0)
        push(b, 0)                            # σ = 1
        b.send(Kind.PULL, 0, wait=False)      # the general path in between
        r = b.recv()
        out.append((r.kind, r.ts, dict(r.fields), [p.copy() for p in r.payloads]))
        a.send(Kind.PUSHPULL, 0, [np.zeros(N - 1, np.float32)], wait=False)   # wrong size
        out.append((a.recv().kind,))
        a.send(Kind.PUSHPULL, 99, [np.zeros(N, np.float32)], wait=False)      # future ts
        out.append((a.recv().kind,))
        a.send_raw([b"\x93garbage", np.zeros(N, np.float32).tobytes()])
        out.append((a.recv().kind,))
        ts_b = r.ts
        for i in range(6):
            ts_a = push(a, ts_a if i % 2 else 0)   # sometimes very stale
            ts_b = push(b, ts_b)
    finally:
        a.close(), b.close()
    return out


def _same(x, y):
    """Replies equal: kind, timestamp, fields, and every payload bit for bit."""
    def payloads(r):
        return r[3] if len(r) > 3 else []
    return len(x) == len(y) and all(
        p[:3] == q[:3] and len(payloads(p)) == len(payloads(q))
        and all(np.array_equal(u, v) for u, v in zip(payloads(p), payloads(q)))
        for p, q in zip(x, y))


@pytest.fixture
def streamed(request, monkeypatch):
    """Replies streamed in parts of 1 KiB (the minimum part lowered to that)."""
    if request.param:
        import rudra_zmq.update as update_mod
        monkeypatch.setattr(update_mod, "STREAM_MIN_PART_BYTES", 1 << 10)
    return request.param


@pytest.mark.parametrize("streamed", [False, True], indirect=True)
@pytest.mark.parametrize("policy", ["constant", "staleness", "per_gradient"])
def test_the_hot_path_gives_the_general_paths_weights_bit_for_bit(ctx, policy, streamed):
    over = (f"optimizer.lr_policy={policy}", "optimizer.lr_steps=[0.03]", "sync.learners=2")
    results = []
    for hot in (True, False):
        ps = _ps(ctx, *over, hot=hot)
        with running(ps) as errors:
            replies = _script(ps, ctx)
        assert not errors
        results.append((ps, replies))
    (hot_ps, hot_replies), (ref_ps, ref_replies) = results
    assert hot_ps.hot_updates == 14 and ref_ps.hot is None      # every update but none refused
    parts = -(-N // hot_ps.part_floats)
    assert (parts > 4) == streamed
    assert [r[0] for r in hot_replies].count(Kind.WPART) == 14 * (parts - 1)   # (PULL: whole)
    assert [r[0] for r in hot_replies].count(Kind.ERROR) == 3
    assert _same(hot_replies, ref_replies)
    assert np.array_equal(hot_ps.w, ref_ps.w) and np.array_equal(hot_ps.v, ref_ps.v)
    assert hot_ps.engine.timestamp == ref_ps.engine.timestamp == 14
    assert hot_ps.engine.lr.base_at(hot_ps.engine.epoch) < hot_ps.cfg.optimizer.lr  # stepped
    assert hot_ps.invalid == ref_ps.invalid == 3


def test_the_update_that_ends_training_takes_the_general_path(ctx):
    ps = _ps(ctx, "train.epochs=0.011")          # 2 gradients of 8 digits images
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, ps.numel)
        a.send(Kind.PUSHPULL, 0, [np.ones(N, np.float32)], wait=False)
        assert a.recv().kind == Kind.WEIGHTS
        a.send(Kind.PUSHPULL, 1, [np.ones(N, np.float32)], wait=False)
        assert a.recv().kind == Kind.STOP
        a.close()
    assert ps.hot_updates == 1 and ps.engine.updates == 2 and ps.done


@pytest.mark.parametrize("overrides", [
    ("sync.protocol=hardsync",), ("sync.protocol=softsync", "sync.n=1"),
    ("optimizer.momentum=0",), ("runtime.hot_path=false",),
])
def test_no_hot_path_where_an_update_is_not_one_whole_momentum_step(ctx, overrides):
    ps = _ps(ctx, *overrides)
    assert ps.hot is None
    ps.io.close(linger=0)


def test_a_model_larger_than_one_reply_frame_is_served_the_general_way(ctx):
    cfg = small_config("sync.protocol=async", "runtime.chunk_mib=1", "runtime.stream_parts=1")
    n = (1 << 20) // 4 + 1                      # one float over a 1 MiB frame
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx,
                         model=(np.zeros(n, np.float32), [(0, n, 1.0, 1.0)], "big"))
    assert ps.hot is None
    ps.io.close(linger=0)


@pytest.mark.parametrize("chunk", [8 << 20, 4096])
@pytest.mark.parametrize("streamed", [False, True], indirect=True)
def test_a_channel_pushpull_matches_send_and_recv(ctx, streamed, chunk):
    """Channel.pushpull (one compiled call) returns what send_gradient + recv return, for
    gradients in one frame or several (``chunk`` bytes) and replies in one message or
    streamed in parts."""
    got = []
    for fast in (True, False):
        ps = _ps(ctx)
        with running(ps):
            ch = transport.Channel(ctx, ps.endpoint, 0, name="ps", timeout_ms=5000)
            ch.send(Kind.HELLO, model=ps.signature, numel=ps.numel)
            ts = ch.recv({Kind.WELCOME}, numel=ps.numel).ts
            g = np.linspace(-1, 1, N, dtype=np.float32)
            for _ in range(3):
                if fast:
                    m = ch.pushpull(ts, g, N, chunk, wait=False, kinds={Kind.WEIGHTS}, numel=N)
                else:
                    ch.send_gradient(Kind.PUSHPULL, ts, g, N, chunk, wait=False)
                    m = ch.recv({Kind.WEIGHTS}, N)
                assert (len(m.payloads) > 4) == streamed
                got.append((fast, m.kind, m.ts, m.fields, np.concatenate(m.payloads).copy()))
                ts = m.ts
            assert ch.inc == ps.inc
            ch.close()
    for (_, *a), (_, *b) in zip(got[:3], got[3:]):
        assert a[:3] == b[:3] and np.array_equal(a[3], b[3])


def test_a_channel_pushpull_raises_the_servers_refusal(ctx):
    ps = _ps(ctx)
    with running(ps):
        ch = transport.Channel(ctx, ps.endpoint, 0, name="ps", timeout_ms=5000)
        ch.send(Kind.HELLO, model=ps.signature, numel=ps.numel)
        ch.recv({Kind.WELCOME}, numel=ps.numel)
        with pytest.raises(transport.ServerError, match="newer than"):
            ch.pushpull(5, np.zeros(N, np.float32), N, wait=False, numel=N)
        with pytest.raises(wire.WireError):          # the reply is checked against numel
            ch.pushpull(0, np.zeros(N, np.float32), N, wait=False, numel=N + 1)
        ch.close()
