"""The parameter server against hand-driven fake learners (real ZeroMQ sockets)."""
import numpy as np
import pytest

import oracles
from cluster import FakeLearner, running, small_config
from rudra_zmq.roles.ps import ParameterServer
from rudra_zmq import wire
from rudra_zmq.wire import Kind


def make_ps(ctx, *overrides):
    cfg = small_config(*overrides)
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx)
    return cfg, ps


def expected_step(w, v, grads, cfg, segments, lr=None):
    """One update with the NumPy oracle, segment by segment (Caffe multipliers)."""
    w, v = w.copy(), v.copy()
    g = np.mean(grads, axis=0, dtype=np.float64).astype(np.float32)
    o = cfg.optimizer
    for a, b, lm, dm in segments:
        oracles.sgd_momentum_step(w[a:b], v[a:b], g[a:b], (lr or o.lr) * lm, o.momentum,
                                  o.weight_decay * dm)
    return w, v


def test_hardsync_answers_both_learners_after_the_second_gradient(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=hardsync")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        w0, ts = a.hello(ps.signature, ps.numel)
        b.hello(ps.signature, ps.numel)
        rng = np.random.default_rng(0)
        ga, gb = (rng.standard_normal(ps.numel).astype(np.float32) for _ in range(2))
        a.send(Kind.PUSHPULL, ts, [ga], wait=True)
        assert not a.has_reply(300), "hardsync must wait for every learner"
        b.send(Kind.PUSHPULL, ts, [gb], wait=True)
        ra, rb = a.recv(), b.recv()
        assert ra.kind == rb.kind == Kind.WEIGHTS and ra.ts == rb.ts == 1
        w1, _ = expected_step(w0, np.zeros_like(w0), [ga, gb], cfg, ps.segments)
        np.testing.assert_allclose(np.concatenate(ra.payloads), w1, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.concatenate(ra.payloads), np.concatenate(rb.payloads))
        a.close(), b.close()
    assert not errors


def test_async_reports_staleness_and_returns_newer_weights_at_once(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=async")
    with running(ps):
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        _, ts = a.hello(ps.signature, ps.numel)
        b.hello(ps.signature, ps.numel)
        g = np.ones(ps.numel, np.float32)
        a.send(Kind.PUSHPULL, ts, [g], wait=False)
        r = a.recv()
        assert (r.kind, r.ts, r.fields["sigma"]) == (Kind.WEIGHTS, 1, 0)
        b.send(Kind.PUSHPULL, 0, [g], wait=False)   # computed on ts 0, arrives at ts 1
        r = b.recv()
        assert (r.kind, r.ts, r.fields["sigma"]) == (Kind.WEIGHTS, 2, 1)
        b.send(Kind.PULL, 2, wait=False)
        assert b.recv().kind == Kind.UPTODATE
        a.close(), b.close()


def _bad_messages(ps, numel):
    good = np.zeros(numel, np.float32)
    return [
        ("garbage bytes", [b"\x93\xff\x00garbage", good.tobytes()], "bad_header"),
        ("wrong kind", None, "unexpected_kind"),
        ("wrong length", "short", "bad_length"),
        ("wrong dtype", "f8", "bad_payload"),
    ]


def test_malformed_and_mismatched_messages_are_refused_and_leave_weights_bit_identical(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=async")
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 0)
        _, ts = a.hello(ps.signature, ps.numel)
        before = ps.w.copy(), ps.v.copy(), ps.acc.copy()
        from rudra_zmq import wire
        import msgpack
        good = np.ones(ps.numel, np.float32)
        hdr = lambda **kw: msgpack.packb({"v": 1, "k": int(Kind.PUSH), "s": 0, "q": 9, "ts": 0,
                                          "inc": 0, "p": [["f4", ps.numel]], "x": {}, **kw})
        cases = [
            ([b"\x93\xff\x00garbage", good.tobytes()], "bad_header"),
            (wire.encode(Kind.BATCH_REQ, 0, 1, step=0), "unexpected_kind"),
            ([hdr(), good.tobytes()[:-4]], "bad_length"),
            ([hdr(p=[["u1", ps.numel * 4]]), good.tobytes()], "bad_dtype"),
            (wire.encode(Kind.PUSH, 0, 1, 0, 0, [good[:-8]]), "bad_length"),
            (wire.encode(Kind.PUSH, 0, 1, 5, 0, [good]), "protocol"),        # from the future
            (wire.encode(Kind.PUSH, 7, 1, 0, 0, [good]), "protocol"),        # unknown learner
            (wire.encode(Kind.HELLO, 1, 1, model="deadbeef", numel=ps.numel), "protocol"),
            (wire.encode(Kind.HELLO, 1, 1, model=ps.signature, numel=ps.numel - 8), "protocol"),
        ]
        for frames, code in cases:
            a.send_raw(frames)
            r = a.recv()
            assert r.kind == Kind.ERROR and r.fields["code"] == code, (code, r.fields)
        assert ps.invalid == len(cases)
        for arr, ref in zip((ps.w, ps.v, ps.acc), before):
            assert arr.tobytes() == ref.tobytes()
        assert ps.engine.timestamp == 0 and ps.engine.gradients_received == 0
        # and a valid push still works afterwards
        a.send(Kind.PUSH, 0, [good])
        assert a.recv().kind == Kind.ACK and ps.engine.timestamp == 1
        a.close()


def test_hello_from_another_model_names_both_sizes(ctx):
    cfg, ps = make_ps(ctx)
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 1)
        a.send(Kind.HELLO, model="0123456789abcdef", numel=89_570)
        r = a.recv()
        assert r.kind == Kind.ERROR
        assert "89,570 parameters" in r.fields["error"] and f"{ps.numel:,}" in r.fields["error"]
        a.close()


def test_push_before_hello_is_refused(ctx):
    cfg, ps = make_ps(ctx)
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.send(Kind.PUSH, 0, [np.zeros(ps.numel, np.float32)])
        r = a.recv()
        assert r.kind == Kind.ERROR and "has not said HELLO" in r.fields["error"]
        a.close()


def test_training_end_answers_stop_to_every_learner_and_the_server_returns(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=async", "train.epochs=0.011")  # 2 gradients of 8
    with running(ps):
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        a.hello(ps.signature, ps.numel), b.hello(ps.signature, ps.numel)
        g = np.zeros(ps.numel, np.float32)
        a.send(Kind.PUSHPULL, 0, [g], wait=False)
        assert a.recv().kind == Kind.WEIGHTS
        b.send(Kind.PUSHPULL, 1, [g], wait=False)
        assert b.recv().kind == Kind.STOP       # this gradient reached train.epochs
        a.send(Kind.PUSHPULL, 1, [g], wait=False)
        assert a.recv().kind == Kind.STOP
        a.close(), b.close()
    assert ps.done and ps.stopped == {0, 1}


@pytest.fixture
def small_parts(monkeypatch):
    """Stream in parts of 1 MiB (default 4 MiB), so a 2.4 MiB test model is streamed."""
    import rudra_zmq.update as update_mod

    monkeypatch.setattr(update_mod, "STREAM_MIN_PART_BYTES", 1 << 20)


def _synthetic_ps(ctx, n, *overrides):
    cfg = small_config("sync.learners=2", *overrides)
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(n).astype(np.float32)
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx,
                         model=(w0, [(0, n // 3, 1.0, 1.0), (n // 3, n, 2.0, 0.0)], "synth"))
    return cfg, ps, w0


def _kinds_until_weights(learner):
    """Receive one streamed reply raw: the kinds in order, and the assembled message."""
    msgs = []
    while not msgs or msgs[-1].kind == Kind.WPART:
        msgs.append(learner.recv())
    return [m.kind for m in msgs], wire.assemble(msgs[:-1], msgs[-1])


@pytest.mark.parametrize("protocol", ["async", "hardsync"])
def test_weights_after_an_update_stream_in_parts_that_assemble_to_the_update(ctx, protocol,
                                                                          small_parts):
    """A 2.4 MiB model with stream_parts=8 goes out as 1 MiB parts (the minimum part size,
    lowered from 4 MiB for the test) (WPART, WPART, WEIGHTS) to
    the sender and to every parked learner; the parts join into exactly the updated weights."""
    n = 600_000
    cfg, ps, w0 = _synthetic_ps(ctx, n, f"sync.protocol={protocol}", "runtime.stream_parts=8")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        a.hello(ps.signature, ps.numel), b.hello(ps.signature, ps.numel)
        rng = np.random.default_rng(2)
        ga, gb = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        if protocol == "hardsync":
            a.send(Kind.PUSHPULL, 0, [ga], wait=True)
            assert not a.has_reply(300)
            b.send(Kind.PUSHPULL, 0, [gb], wait=True)
            grads, replies = [ga, gb], [_kinds_until_weights(x) for x in (a, b)]
        else:
            a.send(Kind.PUSHPULL, 0, [ga], wait=False)
            grads, replies = [ga], [_kinds_until_weights(a)]
        w1, _ = expected_step(w0, np.zeros_like(w0), grads, cfg, ps.segments)
        for kinds, msg in replies:
            assert kinds == [Kind.WPART, Kind.WPART, Kind.WEIGHTS], kinds
            assert msg.ts == 1 and msg.fields["parts"] == 2
            assert [p.shape[0] for p in msg.payloads] == [262_144, 262_144, n - 524_288]
            np.testing.assert_allclose(np.concatenate(msg.payloads), w1, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.concatenate(replies[-1][1].payloads), ps.w)
        a.close(), b.close()
    assert not errors


def test_stream_parts_1_sends_one_weights_message(ctx, small_parts):
    n = 600_000
    _, ps, _ = _synthetic_ps(ctx, n, "sync.protocol=async", "runtime.stream_parts=1")
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.signature, ps.numel)
        a.send(Kind.PUSHPULL, 0, [np.ones(n, np.float32)], wait=False)
        kinds, msg = _kinds_until_weights(a)
        assert kinds == [Kind.WEIGHTS] and "parts" not in msg.fields
        a.close()
    assert not errors


def test_a_channel_receives_a_streamed_reply_as_one_validated_message(ctx, small_parts):
    from rudra_zmq import transport

    n = 600_000
    _, ps, w0 = _synthetic_ps(ctx, n, "sync.protocol=async")
    with running(ps) as errors:
        ch = transport.Channel(ctx, ps.endpoint, 0, timeout_ms=5000)
        ch.send(Kind.HELLO, model=ps.signature, numel=n)
        assert ch.recv({Kind.WELCOME}, numel=n).payload_numel == n
        reply = ch.request(Kind.PUSHPULL, 0, [np.zeros(n, np.float32)],
                           reply_kinds={Kind.WEIGHTS}, numel=n, wait=False)
        assert reply.kind == Kind.WEIGHTS and reply.fields["parts"] == 2
        np.testing.assert_array_equal(np.concatenate(reply.payloads), ps.w)
        ch.close()
    assert not errors


def test_stream_part_sizes_respect_the_minimum_the_chunk_and_the_count():
    from rudra_zmq.update import STREAM_MIN_PART_BYTES, stream_part_floats

    lo = STREAM_MIN_PART_BYTES // 4
    assert stream_part_floats(10_000_000, 8 << 20, 8) == 1_250_000      # 8 parts of 4.8 MiB
    assert stream_part_floats(10_000_000, 2 << 20, 8) == (2 << 20) // 4  # capped by the chunk
    assert stream_part_floats(1_000_000, 8 << 20, 8) == 1_000_000        # < 2 parts: off
    assert stream_part_floats(3 * lo, 64 << 20, 8) == lo                 # at least the minimum
    assert stream_part_floats(10_000_000, 8 << 20, 1) == 10_000_000      # 1 = off
