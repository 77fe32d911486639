"""Who may change the weights, end the run or name its result (``security/auth.py``, ``security/keys.py``).

What it proves, each against the real role in this process and real ZeroMQ sockets:

1. CURVE on a live parameter server: a plaintext client, a key that is not allow-listed and a
   key revoked while connected (and on a new connection) get no WELCOME and move no weight; a
   key made for learner 1 cannot speak as learner 0 ("forbidden"); the allow-listed key of
   learner 0 is welcomed and its gradient applied. On a live data server, learner 1's key
   gets learner 1's minibatches and is refused learner 0's ("forbidden").
2. Plaintext: a second connection cannot take a live learner's id ("in_use"), nor impersonate
   its unpredictable routing id, nor pull as it ("rejoin", no weights); once the learner's
   connection is gone, a new one takes the id back (a restart).
3. The statistics server (run token in the environment): "done" without the token, from a
   learner, or "eval" records from anyone are refused and do not end the run; with the token
   "done" is taken.
4. Size limits: a frame over ``max_bytes`` disconnects its sender and delivers nothing; a
   10,000-frame message leaves the PS up, answering, and its RSS within 50 MiB.
5. The result line reads where the PS says training ended, not a later (forged) eval record.
6. After training, STOP goes only to registered senders: an outsider speaking as a learner not
   yet told (PULL, BYE, HELLO) cannot mark it stopped, at the PS or at a tree node, and the
   real learner is still told.
"""

import io
import itertools
import json
import time

import msgpack
import numpy as np
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from cluster import running, small_config
from rudra_zmq import transport, wire
from rudra_zmq.channel import Channel
from rudra_zmq.data.data_order import load_data
from rudra_zmq.data.server import DataServer
from rudra_zmq.results import compare
from rudra_zmq.results.compare import result_line
from rudra_zmq.security import auth, keys
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.stats.run_end import DONE_QUIET_S
from rudra_zmq.stats.server import StatsServer
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(90)
N, SIG, TOKEN = 16, "sig", "0123456789abcdef"
GRAD = np.ones(N, np.float32)
_seq = itertools.count(time.time_ns())  # newer than any Channel's (µs clock) seq


def make_ps(ctx):
    """An async λ=2 parameter server of N floats, bound on a random loopback port."""
    model = (np.linspace(-1, 1, N, dtype=np.float32), [(0, N, 1.0, 1.0)], SIG)
    return ParameterServer(
        small_config("sync.protocol=async"), "tcp://127.0.0.1:0", ctx=ctx, model=model
    )


def dealer(ctx, endpoint, curve=None):
    """A raw DEALER (libzmq's routing id, linger 0); ``curve``: (server key, (public, secret))."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    # a refused handshake drops the connection's pipe: a send would then block forever
    s.sndtimeo = 5000
    if curve is not None:
        s.curve_serverkey, (s.curve_publickey, s.curve_secretkey) = curve
    s.connect(endpoint)
    return s


def send(sock, kind, sender, ts=0, payloads=(), **fields):
    sock.send_multipart(wire.encode(kind, sender, next(_seq), ts, 0, payloads, **fields))


def hello(sock, sender):
    send(sock, Kind.HELLO, sender, model=SIG, numel=N)


def reply(sock, timeout_ms=5000):
    """The next message, decoded, or None when none comes within ``timeout_ms``."""
    return wire.decode(sock.recv_multipart()) if sock.poll(timeout_ms) else None


def attack(sock, sender, quiet_ms=1000):
    """HELLO and a gradient as ``sender`` without waiting; the replies until ``quiet_ms`` of
    silence. Without any check at the server this registers and moves the weights. A send
    that cannot go (the server refused the handshake and no connection is left) gets none."""
    try:
        hello(sock, sender)
        send(sock, Kind.PUSH, sender, 0, [GRAD])
    except zmq.Again:
        return []
    got = []
    while (r := reply(sock, quiet_ms)) is not None:
        got.append(r)
    return got


def codes(msgs):
    return [(m.kind, m.fields.get("code")) for m in msgs]


# ------------------------------------------------------------------ 1. CURVE
@pytest.fixture
def curve_ps(tmp_path):
    """(key dir, ctx, PS) with CURVE on; set_security and the ZAP handler undone after."""
    d = tmp_path / "keys"
    keys.make_run_keys(d, ["learner-0", "learner-1"])
    curve, ctx = auth.Curve(d), zmq.Context()
    transport.set_security(curve)
    try:
        yield d, ctx, make_ps(ctx)
    finally:
        transport.set_security(None)
        curve.release(ctx)
        ctx.destroy(linger=0)


def test_curve_admits_only_allow_listed_keys_speaking_as_their_own_learner(curve_ps):
    d, ctx, ps = curve_ps
    spub = keys.server_keys(d, secret=False)[0]
    as_1, as_0 = ((spub, keys.client_keys(d, n)) for n in ("learner-1", "learner-0"))
    w0 = ps.state.w.copy()
    with running(ps) as errors:
        # (a) plaintext and (b) a key not in the allow-list: no handshake, nothing comes back
        assert attack(dealer(ctx, ps.endpoint), 0) == []
        assert attack(dealer(ctx, ps.endpoint, (spub, zmq.curve_keypair())), 0) == []
        assert np.array_equal(ps.state.w, w0)
        # (d) learner 1's key speaking as learner 0
        one = dealer(ctx, ps.endpoint, as_1)
        assert codes(attack(one, 0)) == [(Kind.ERROR, "forbidden")] * 2
        assert 0 not in ps.state.identities and np.array_equal(ps.state.w, w0)
        hello(one, 1)  # as itself it is welcome ...
        assert reply(one).kind == Kind.WELCOME
        # (c) ... until revoked: its open connection is refused, a new one not admitted
        keys.revoke(d, "learner-1")
        time.sleep(auth.RELOAD_S + 0.5)
        send(one, Kind.PUSH, 1, 0, [GRAD])
        assert codes([reply(one)]) == [(Kind.ERROR, "forbidden")]
        assert attack(dealer(ctx, ps.endpoint, as_1), 1) == []
        assert np.array_equal(ps.state.w, w0) and ps.state.engine.timestamp == 0
        # (e) learner 0's own key: welcomed, and its gradient moves the weights
        zero = dealer(ctx, ps.endpoint, as_0)
        hello(zero, 0)
        welcome = reply(zero)
        assert welcome.kind == Kind.WELCOME
        assert np.array_equal(np.concatenate(welcome.payloads), w0)
        send(zero, Kind.PUSH, 0, welcome.ts, [GRAD])
        assert reply(zero).kind == Kind.ACK
        assert ps.state.engine.timestamp == 1 and not np.array_equal(ps.state.w, w0)
    assert not errors


def test_with_curve_the_data_server_gives_a_key_only_its_own_learners_minibatches(tmp_path):
    d = tmp_path / "keys"
    keys.make_run_keys(d, ["learner-0", "learner-1"])
    curve, ctx = auth.Curve(d), zmq.Context()
    transport.set_security(curve)
    try:
        cfg = small_config(
            "data.dataset=synthetic",
            "data.synthetic_shape=[1,4,4]",
            "data.synthetic_train=64",
            "data.synthetic_test=8",
        )
        server = DataServer(cfg, "tcp://127.0.0.1:0", ctx)
        spub = keys.server_keys(d, secret=False)[0]
        with running(server) as errors:
            one = dealer(ctx, server.endpoint, (spub, keys.client_keys(d, "learner-1")))
            send(one, Kind.BATCH_REQ, 0, step=0)  # learner 1's key asking as learner 0
            assert codes([reply(one)]) == [(Kind.ERROR, "forbidden")]
            send(one, Kind.BATCH_REQ, 1, step=0)  # ... and as itself
            own = reply(one)
            assert own.kind == Kind.BATCH and own.fields["step"] == 0
            plain = dealer(ctx, server.endpoint)  # no key: no handshake, no data
            send(plain, Kind.BATCH_REQ, 0, step=0)
            assert reply(plain, 1000) is None
        assert not errors
        assert (server.batches_served, server.invalid) == (1, 1)
    finally:
        transport.set_security(None)
        curve.release(ctx)
        ctx.destroy(linger=0)


# ------------------------------------------------------------------ 2. ids without CURVE
def test_a_live_learner_keeps_its_id_until_its_connection_is_gone(ctx):
    ps = make_ps(ctx)
    with running(ps) as errors:
        live = Channel(ctx, ps.endpoint, 0, timeout_ms=5000)
        rid = live.sock.getsockopt(zmq.ROUTING_ID)
        other = Channel(ctx, ps.endpoint, 1, timeout_ms=5000)
        assert len(rid) == 16 and rid[:1] == b"r" and rid != other.sock.getsockopt(zmq.ROUTING_ID)
        other.close()
        live.send(Kind.HELLO, model=SIG, numel=N)  # request(numel=) is the reply's size
        live.recv({Kind.WELCOME})
        # (a) a second HELLO for learner 0 from another connection
        rival = dealer(ctx, ps.endpoint)
        hello(rival, 0)
        assert codes([reply(rival)]) == [(Kind.ERROR, "in_use")]
        assert ps.state.identities[0] == rid
        assert live.request(Kind.PUSH, 0, [GRAD], reply_kinds={Kind.ACK}).kind == Kind.ACK
        w1 = ps.state.w.copy()
        # (c) a PULL as learner 0 from that connection: refused, no weights (ts 0 < 1: it
        # would get them if it were learner 0)
        send(rival, Kind.PULL, 0, 0)
        r = reply(rival)
        assert codes([r]) == [(Kind.ERROR, "rejoin")] and r.payloads == []
        # ... nor from a socket that copies the live learner's routing id
        twin = ctx.socket(zmq.DEALER)
        twin.linger, twin.routing_id = 0, rid
        twin.connect(ps.endpoint)
        for _ in range(2):
            send(twin, Kind.PULL, 0, 0)
        while (r := reply(twin, 500)) is not None:
            assert r.kind == Kind.ERROR and not r.payloads
        assert live.request(Kind.PULL, 0, reply_kinds={Kind.WEIGHTS}).ts == 1
        assert np.array_equal(ps.state.w, w1)
        # (b) the live learner's connection closes: a new connection takes learner 0 back
        live.close()
        deadline = time.monotonic() + 10
        while (r := (hello(rival, 0), reply(rival))[1]).kind != Kind.WELCOME:
            assert codes([r]) == [(Kind.ERROR, "in_use")] and time.monotonic() < deadline
            time.sleep(0.1)
        assert ps.state.identities[0] != rid
        send(rival, Kind.PUSH, 0, r.ts, [GRAD])
        assert reply(rival).kind == Kind.ACK and not np.array_equal(ps.state.w, w1)
    assert not errors


# ------------------------------------------------------------------ 3. statistics server
@pytest.fixture
def stats(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv(auth.RUN_TOKEN_ENV, TOKEN)
    cfg = small_config()
    server = StatsServer(
        cfg, "tcp://127.0.0.1:0", tmp_path / "run", ctx, dataset=load_data(cfg), out=io.StringIO()
    )
    yield server
    server._file.close()
    server.sock.close(linger=0)


def metric(sender, record, **token):
    return wire.encode(Kind.METRIC, sender, next(_seq), metric=record, **token)


def test_only_the_ps_with_the_run_token_ends_the_recording(stats):
    done = {"type": "done", "t": time.time(), "evals_sent": 0}
    forged = [
        metric(wire.SENDER_PS, done),
        metric(wire.SENDER_PS, done, token="x" * 16),
        metric(wire.SENDER_PS, {"type": "batch", "items": [done]}),
        metric(0, done),
        metric(0, done, token=TOKEN),
        metric(
            wire.SENDER_PS,
            {"type": "eval", "ts": 99, "epoch": 50.0, "test_error": 0.0},
            token=TOKEN,
        ),
        metric(3, {"type": "eval", "ts": 99, "epoch": 50.0, "test_error": 0.0}),
        wire.encode(
            Kind.EVAL,
            wire.SENDER_PS,
            next(_seq),
            99,
            0,
            [np.zeros(stats.flat.numel, np.float32)],
            epoch=50.0,
        ),
    ]
    for i, frames in enumerate(forged, 1):
        stats.handle(frames)
        assert stats.invalid == i, i
    time.sleep(DONE_QUIET_S + 0.1)
    assert stats.end.done is None and stats._pending is None and not stats._finished()
    stats.handle(metric(wire.SENDER_PS, done, token=TOKEN))
    assert stats.invalid == len(forged) and stats.end.done is not None
    time.sleep(DONE_QUIET_S + 0.1)
    assert stats._finished()
    stats._file.flush()
    lines = stats.metrics_path.read_text().splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["start", "done"]


# ------------------------------------------------------------------ 4. size limits
def test_a_frame_over_max_bytes_disconnects_its_sender_and_delivers_nothing(ctx):
    router = transport.make_socket(ctx, zmq.ROUTER, max_bytes=transport.frame_limit(1024))
    endpoint = transport.bind(router, "tcp://127.0.0.1:0")
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big = dealer(ctx, endpoint)
    big.send(bytes(8 << 20))
    assert monitor.poll(5000), "the sender of an 8 MiB frame was not disconnected"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    assert not router.poll(500)
    small = dealer(ctx, endpoint)
    small.send(bytes(1024))  # what the limit allows still comes through
    assert router.poll(5000) and router.recv_multipart()[1:] == [bytes(1024)]
    router.disable_monitor()


def test_a_10000_frame_message_leaves_the_ps_up_and_its_memory_bounded(ctx):
    ps = make_ps(ctx)
    proc = psutil.Process()
    with running(ps) as errors:
        learner = dealer(ctx, ps.endpoint)
        hello(learner, 0)
        assert reply(learner).kind == Kind.WELCOME
        w0, rss0 = ps.state.w.copy(), proc.memory_info().rss
        header = msgpack.packb(
            {
                "v": wire.PROTOCOL_VERSION,
                "k": int(Kind.PUSH),
                "s": 0,
                "q": next(_seq),
                "ts": 0,
                "inc": 0,
                "p": [["f4", N]] * 10_000,
                "x": {},
            }
        )
        learner.send_multipart([header, *[bytes(1024)] * 10_000])
        assert reply(learner, 10_000).kind == Kind.ERROR
        assert np.array_equal(ps.state.w, w0)
        send(learner, Kind.PUSH, 0, 0, [GRAD])
        assert reply(learner).kind == Kind.ACK and ps.state.engine.timestamp == 1
        grown = proc.memory_info().rss - rss0
        assert grown < 50 << 20, f"RSS grew by {grown / 2**20:.1f} MiB"
    assert not errors


# ------------------------------------------------------------------ 5. the result line
def forged_run(tmp_path):
    """A run directory whose last eval record lies past where the PS says it ended (ts 10,
    epoch 2): a forged EVAL at ts 99, epoch 50, of someone else's 1%-error weights."""
    run = tmp_path / "run"
    run.mkdir()
    recs = [
        {"type": "start", "t": 0.0, "unix": 1e9},
        {"type": "eval", "ts": 0, "t": 1.0, "epoch": 0.0, "test_error": 0.9},
        {"type": "eval", "ts": 10, "t": 5.0, "epoch": 2.0, "test_error": 0.3},
        {"type": "eval", "ts": 99, "t": 6.0, "epoch": 50.0, "test_error": 0.01},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "ps_final.json").write_text(
        json.dumps({"timestamp": 10, "epoch": 2.0, "updates": 10, "done": True, "incarnation": 1})
    )
    return run


def test_the_result_line_reports_where_the_ps_ended(tmp_path):
    run = forged_run(tmp_path)
    r = compare.run_summary(run)
    assert (r["epochs"], r["final_error"]) == (2.0, 0.3)
    assert result_line(run).startswith("result: test error 30.00% (best ")
    assert "after 2.00 epochs" in result_line(run)


def test_the_best_error_ignores_evals_past_where_the_ps_ended(tmp_path):
    r = compare.run_summary(forged_run(tmp_path))
    assert r["best_error"] == 0.3, f"best error {r['best_error']} comes from a forged eval"


# ------------------------------------------------------------------ 6. STOP after training
def outsider_speaks_as(ctx, endpoint, sender, stopped):
    """A new connection speaks as ``sender`` (not yet told STOP) after training: PULL and
    BYE are refused ("rejoin"), HELLO too ("in_use": the real one is connected); none of it
    marks ``sender`` stopped (``stopped()``: the server's set)."""
    outsider = dealer(ctx, endpoint)
    send(outsider, Kind.PULL, sender, 0)
    send(outsider, Kind.BYE, sender)
    hello(outsider, sender)
    got = [reply(outsider) for _ in range(3)]
    assert codes(got) == [(Kind.ERROR, "rejoin")] * 2 + [(Kind.ERROR, "in_use")], codes(got)
    assert sender not in stopped()
    outsider.close()


def test_after_training_an_outsider_cannot_mark_a_learner_stopped_at_the_ps(ctx):
    model = (np.zeros(N, np.float32), [(0, N, 1.0, 1.0)], SIG)
    ps = ParameterServer(
        small_config("sync.protocol=async", "train.epochs=0.01"),
        "tcp://127.0.0.1:0",
        ctx=ctx,
        model=model,
    )
    with running(ps) as errors:
        zero, one = dealer(ctx, ps.endpoint), dealer(ctx, ps.endpoint)
        for sock, i in ((zero, 0), (one, 1)):
            hello(sock, i)
            assert reply(sock).kind == Kind.WELCOME
        for _ in range(10):  # learner 0 pushes until training ends
            send(zero, Kind.PUSH, 0, 0, [GRAD])
            if reply(zero).kind == Kind.STOP:
                break
        assert ps.state.done and ps.state.stopped == {0}
        outsider_speaks_as(ctx, ps.endpoint, 1, lambda: ps.state.stopped)
        assert not ps.state.all_stopped
        send(one, Kind.PULL, 1, 0)  # the real learner 1 is told
        while (r := reply(one)).fields.get("code") == "probe":  # the in_use check's
            pass
        assert r.kind == Kind.STOP and ps.state.all_stopped
    assert not errors


def test_after_training_an_outsider_cannot_mark_a_learner_stopped_at_a_tree_node(ctx):
    from test_tree import adv, stop_after_one_push, welcome_leaf

    parent, node, (l0, l1) = welcome_leaf(ctx, adv("sync.protocol=async"))
    with running(node) as errors:
        stop_after_one_push(parent, l0, l1)
        outsider_speaks_as(ctx, node.endpoint, 1, lambda: node.state.stopped)
        assert not node.state.finished
        l1.send(Kind.PULL, 0)  # the real learner 1 is told
        while (r := l1.recv()).fields.get("code") == "probe":  # the in_use check's
            pass
        assert r.kind == Kind.STOP and node.state.finished
        l0.close(), l1.close()
    assert not errors
