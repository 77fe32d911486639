"""The parameter server against hand-driven fake learners (real ZeroMQ sockets)."""

import time

import msgpack
import numpy as np

import oracles
from cluster import FakeLearner, running, small_config
from rudra_zmq import wire
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.server.state import ServerState
from rudra_zmq.server.weights import ReplyWeights
from rudra_zmq.sync import NOW, Reply
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
        oracles.sgd_momentum_step(
            w[a:b], v[a:b], g[a:b], (lr or o.lr) * lm, o.momentum, o.weight_decay * dm
        )
    return w, v


def test_hardsync_answers_both_learners_after_the_second_gradient(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=hardsync")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        w0, ts = a.hello(ps.state.signature, ps.state.numel)
        b.hello(ps.state.signature, ps.state.numel)
        rng = np.random.default_rng(0)
        ga, gb = (rng.standard_normal(ps.state.numel).astype(np.float32) for _ in range(2))
        a.send(Kind.PUSHPULL, ts, [ga])
        assert not a.has_reply(300), "hardsync must wait for every learner"
        b.send(Kind.PUSHPULL, ts, [gb])
        ra, rb = a.recv(), b.recv()
        assert ra.kind == rb.kind == Kind.WEIGHTS and ra.ts == rb.ts == 1
        w1, _ = expected_step(w0, np.zeros_like(w0), [ga, gb], cfg, ps.state.updater.segments)
        np.testing.assert_allclose(np.concatenate(ra.payloads), w1, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.concatenate(ra.payloads), np.concatenate(rb.payloads))
        a.close(), b.close()
    assert not errors


def test_async_reports_staleness_and_returns_newer_weights_at_once(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=async")
    with running(ps):
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        _, ts = a.hello(ps.state.signature, ps.state.numel)
        b.hello(ps.state.signature, ps.state.numel)
        g = np.ones(ps.state.numel, np.float32)
        a.send(Kind.PUSHPULL, ts, [g])
        r = a.recv()
        assert (r.kind, r.ts, r.fields["sigma"]) == (Kind.WEIGHTS, 1, 0)
        b.send(Kind.PUSHPULL, 0, [g])  # computed on ts 0, arrives at ts 1
        r = b.recv()
        assert (r.kind, r.ts, r.fields["sigma"]) == (Kind.WEIGHTS, 2, 1)
        b.send(Kind.PULL, 2)
        assert b.recv().kind == Kind.UPTODATE
        a.close(), b.close()


def test_hardsync_holds_a_pull_after_a_push_until_the_update_and_answers_others_at_once(ctx):
    _, ps = make_ps(ctx, "sync.protocol=hardsync")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        _, ts = a.hello(ps.state.signature, ps.state.numel)
        b.hello(ps.state.signature, ps.state.numel)
        g = np.ones(ps.state.numel, np.float32)
        a.send(Kind.PUSH, ts, [g])
        assert a.recv().kind == Kind.ACK
        a.send(Kind.PULL, ts)  # its gradient is pending: the engine holds it
        b.send(Kind.PULL, ts)  # nothing pending: answered at once
        assert b.recv().kind == Kind.UPTODATE and not a.has_reply(300)
        b.send(Kind.PUSHPULL, ts, [g])
        ra, rb = a.recv(), b.recv()
        assert (ra.kind, ra.ts, rb.kind, rb.ts) == (Kind.WEIGHTS, 1, Kind.WEIGHTS, 1)
        a.close(), b.close()
    assert not errors


def test_the_server_parks_a_reply_the_engine_holds_and_sends_it_when_the_engine_says():
    """No sockets: ReplyWeights with the PS's state. The engine is given a rule no protocol
    has (learner 0 held until timestamp 2): the server follows the engine's word."""
    cfg = small_config("sync.protocol=async")
    n = 8
    st = ServerState(cfg, np.zeros(n, np.float32), [(0, n, 1.0, 1.0)], "sig", epoch_size=10**6)
    sent = []
    out = ReplyWeights(st, lambda ident, kind, payloads=(), **f: sent.append((ident, kind)))
    st.engine.reply = lambda learners: Reply(after=2) if 0 in set(learners) else NOW

    def message(kind, sender, ts, payloads=()):
        return wire.decode(wire.encode(kind, sender, 1, ts, 0, list(payloads)))

    out.pull(b"L0", message(Kind.PULL, 0, 0))
    out.pull(b"L1", message(Kind.PULL, 1, 0))
    assert sent == [(b"L1", Kind.UPTODATE)] and out.waiting == {0}
    for ts in (0, 1):
        arrival = st.push(message(Kind.PUSHPULL, 1, ts, [np.ones(n, np.float32)]))
        assert arrival.update is not None
        out.release(stop=None)
        assert out.waiting == ({0} if ts == 0 else set())
    assert sent[1:] == [(b"L0", Kind.WEIGHTS)]


def test_the_ps_holds_a_gradient_reply_as_long_as_the_engine_says(ctx):
    _, ps = make_ps(ctx, "sync.protocol=async")
    eng = ps.state.engine  # a rule no protocol has: learner 0's gradient waits for timestamp 3
    eng.reply = lambda learners: Reply(3) if 0 in set(learners) and eng.gradients_received else NOW
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        _, ts = a.hello(ps.state.signature, ps.state.numel)
        b.hello(ps.state.signature, ps.state.numel)
        g = np.ones(ps.state.numel, np.float32)
        a.send(Kind.PUSHPULL, ts, [g])  # update 1, held
        for t in (1, 2):  # updates 2 and 3
            assert not a.has_reply(200)
            b.send(Kind.PUSHPULL, t, [g])
            assert b.recv().ts == t + 1
        r = a.recv()
        assert (r.kind, r.ts) == (Kind.WEIGHTS, 3) and ps.weights_out.waiting == set()
        a.close(), b.close()
    assert not errors


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
        _, ts = a.hello(ps.state.signature, ps.state.numel)
        before = ps.state.w.copy(), ps.state.updater.v.copy(), ps.state.updater.acc.copy()
        good = np.ones(ps.state.numel, np.float32)

        def hdr(**kw):
            return msgpack.packb(
                {
                    "v": wire.PROTOCOL_VERSION,
                    "k": int(Kind.PUSH),
                    "s": 0,
                    "q": 9,
                    "ts": 0,
                    "inc": 0,
                    "p": [["f4", ps.state.numel]],
                    "x": {},
                    **kw,
                }
            )

        cases = [
            ([b"\x93\xff\x00garbage", good.tobytes()], "bad_header"),
            (wire.encode(Kind.BATCH_REQ, 0, 1, step=0), "unexpected_kind"),
            ([hdr(), good.tobytes()[:-4]], "bad_length"),
            ([hdr(p=[["u1", ps.state.numel * 4]]), good.tobytes()], "bad_dtype"),
            (wire.encode(Kind.PUSH, 0, 1, 0, 0, [good[:-8]]), "bad_length"),
            (wire.encode(Kind.PUSH, 0, 1, 5, 0, [good]), "protocol"),  # from the future
            (wire.encode(Kind.PUSH, 7, 1, 0, 0, [good]), "rejoin"),  # unknown learner
            (wire.encode(Kind.HELLO, 1, 1, model="deadbeef", numel=ps.state.numel), "protocol"),
            (
                wire.encode(Kind.HELLO, 1, 1, model=ps.state.signature, numel=ps.state.numel - 8),
                "protocol",
            ),
        ]
        for frames, code in cases:
            a.send_raw(frames)
            r = a.recv()
            assert r.kind == Kind.ERROR and r.fields["code"] == code, (code, r.fields)
        assert ps.state.counters.invalid == len(cases)
        for arr, ref in zip((ps.state.w, ps.state.updater.v, ps.state.updater.acc), before):
            assert arr.tobytes() == ref.tobytes()
        assert ps.state.engine.timestamp == 0 and ps.state.engine.gradients_received == 0
        # and a valid push still works afterwards
        a.send(Kind.PUSH, 0, [good])
        assert a.recv().kind == Kind.ACK and ps.state.engine.timestamp == 1
        a.close()


def test_hello_from_another_model_names_both_sizes(ctx):
    cfg, ps = make_ps(ctx)
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 1)
        a.send(Kind.HELLO, model="0123456789abcdef", numel=89_570)
        r = a.recv()
        assert r.kind == Kind.ERROR
        assert (
            "89,570 parameters" in r.fields["error"] and f"{ps.state.numel:,}" in r.fields["error"]
        )
        a.close()


def test_push_before_hello_is_refused(ctx):
    cfg, ps = make_ps(ctx)
    with running(ps):
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.send(Kind.PUSH, 0, [np.zeros(ps.state.numel, np.float32)])
        r = a.recv()
        assert r.kind == Kind.ERROR and "has not said HELLO" in r.fields["error"]
        a.close()


def test_training_end_answers_stop_to_every_learner_and_the_server_returns(ctx):
    cfg, ps = make_ps(ctx, "sync.protocol=async", "train.epochs=0.011")  # 2 gradients of 8
    with running(ps):
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        a.hello(ps.state.signature, ps.state.numel), b.hello(ps.state.signature, ps.state.numel)
        g = np.zeros(ps.state.numel, np.float32)
        a.send(Kind.PUSHPULL, 0, [g])
        assert a.recv().kind == Kind.WEIGHTS
        b.send(Kind.PUSHPULL, 1, [g])
        assert b.recv().kind == Kind.STOP  # this gradient reached train.epochs
        a.send(Kind.PUSHPULL, 1, [g])
        assert a.recv().kind == Kind.STOP
        a.close(), b.close()
    assert ps.state.done and ps.state.stopped == {0, 1}


def drop_first_answer(sock, seq: int, to: bytes | None = None) -> list:
    """Make the first answer ``sock`` (a server's ROUTER) sends to request ``seq`` (of the
    peer ``to``, or any) find its queue full (EAGAIN), on the socket itself (a stand-in
    object would break a Poller); returns a list that gets an item when it drops it."""
    import zmq

    real, dropped = sock.send_multipart, []

    def send_multipart(frames, *args, **kwargs):
        if (
            not dropped
            and to in (None, bytes(frames[0]))
            and wire.decode(frames[1:]).fields.get("re") == seq
        ):
            dropped.append(seq)
            raise zmq.Again()
        return real(frames, *args, **kwargs)

    sock.send_multipart = send_multipart
    return dropped


def test_a_reply_the_server_could_not_queue_is_asked_for_again_not_waited_for(ctx):
    """A reply dropped at the PS (its queue to that learner full): the learner's CHECK hears
    "not got", it sends the gradient again, and that copy is answered as before and not
    applied twice (before, the CHECK heard "got" and the learner waited for its timeout)."""
    cfg, ps = make_ps(ctx, "sync.protocol=softsync", "sync.n=1")
    dropped = drop_first_answer(ps.sock, 2)
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.state.signature, ps.state.numel)
        g = np.ones(ps.state.numel, np.float32)
        push = wire.encode(Kind.PUSHPULL, 0, 2, 0, 0, [g])
        a.send_raw(push)
        assert not a.has_reply(500)  # dropped
        a.send_raw(wire.encode(Kind.CHECK, 0, 2, 0, 0))
        assert a.recv().fields == {"re": 2, "got": False}
        a.send_raw(push)  # Channel.resend: the same request
        reply = a.recv()  # UPTODATE: c = 2 gradients make an update
        assert (reply.kind, reply.fields["re"]) == (Kind.UPTODATE, 2)
        a.send_raw(wire.encode(Kind.CHECK, 0, 2, 0, 0))  # heard once: "got" again after
        assert a.recv().fields == {"re": 2, "got": True}
        a.close()
    assert not errors and dropped == [2]
    c = ps.state.counters
    # applied once: c = 2, so a second copy applied would have made update 1
    assert (ps.state.engine.timestamp, c.duplicates, c.undelivered) == (0, 1, 1)


def test_a_last_stop_the_server_could_not_queue_is_told_again_before_it_ends(ctx):
    """The gradient that ends training is answered STOP, and that STOP finds the learner's
    queue full (EAGAIN): the PS stays runtime.retry_s + 1 s for the learner's CHECK ("not
    got") and tells it STOP again when it sends the gradient again (before, the PS ended at
    once and the learner waited out its timeout)."""
    cfg, ps = make_ps(ctx, "sync.learners=1", "train.epochs=0.001", "runtime.retry_s=1")
    dropped = drop_first_answer(ps.sock, 2)
    with running(ps) as errors:
        a = FakeLearner(ctx, ps.endpoint, 0)
        a.hello(ps.state.signature, ps.state.numel)
        push = wire.encode(Kind.PUSHPULL, 0, 2, 0, 0, [np.ones(ps.state.numel, np.float32)])
        a.send_raw(push)
        deadline = time.monotonic() + 10
        while not dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dropped == [2] and ps.state.done  # the last update; its STOP dropped
        a.send_raw(wire.encode(Kind.CHECK, 0, 2, 0, 0))
        assert a.recv().fields == {"re": 2, "got": False}
        a.send_raw(push)
        stop = a.recv()
        assert (stop.kind, stop.fields["re"]) == (Kind.STOP, 2)
        a.close()
    assert not errors and dropped == [2]
