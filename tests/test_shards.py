"""Sharded parameter servers (issue 24, item 1; the core, in one process): K servers each
serving one range of the flat vector (``shape.ClusterShape``), learners pushing each its slice
and loading each server's weights into that range (``learner/exchange.py``'s PushPull, which
takes one server as a set of one).

- hardsync with K = 2 and 3 servers ends with the one server's weights (each element's
  update is the same; only the gradient sums' float order may differ), every server at the
  same timestamp with σ = 0; so do one and two servers with their ranges in parts;
- 2-softsync with K = 2: each server keeps its own timestamp and staleness;
- a learner that expects another range is refused at HELLO, naming both; a learner given
  another number of endpoints than the shape has servers is refused up front;
- the exchange alone (scripted replies, no sockets): a server that says ``rejoin`` gets a
  HELLO alone while the others' replies are taken (one server too); STOP from any server
  ends the learner.
"""

import dataclasses
import threading

import numpy as np
import pytest
import zmq

from cluster import small_config
from rudra_zmq import transport
from rudra_zmq.channel import Channel, ServerError
from rudra_zmq.data.server import DataServer
from rudra_zmq.learner.learner import Learner
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.shape import ClusterShape, split
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(180)


def with_servers(cfg, k):
    """``cfg`` with ``architecture.servers`` = ``k``."""
    return dataclasses.replace(cfg, architecture=dataclasses.replace(cfg.architecture, servers=k))


def run_sharded(cfg, k, ctx):
    """Train ``cfg`` with ``k`` servers (k = 1: one server, the whole vector) and its learners
    as threads; returns the servers once every role ended. Blocks."""
    cfg = with_servers(cfg, k)
    data = DataServer(cfg, "tcp://127.0.0.1:0", ctx)
    stop_data, failed, errors = threading.Event(), threading.Event(), []
    threads = [threading.Thread(target=data.serve_forever, args=(stop_data,), daemon=True)]
    servers = [ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx, server=i) for i in range(k)]
    endpoints = [s.endpoint for s in servers]

    def guard(fn):
        try:
            fn()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            failed.set()

    threads += [
        threading.Thread(target=guard, args=(lambda s=s: s.serve_forever(failed),), daemon=True)
        for s in servers
    ]
    threads += [
        threading.Thread(
            target=guard,
            args=(
                lambda i=i: Learner(cfg, i, endpoints, data.endpoint, None, ctx).run(
                    stop_event=failed
                ),
            ),
            daemon=True,
        )
        for i in range(cfg.sync.learners)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join(120)
            assert not t.is_alive(), "a role did not end"
    finally:
        failed.set()
        stop_data.set()
        threads[0].join(10)
    assert not errors, errors
    return servers


def initial_weights(cfg):
    from rudra_zmq.server.start import initial_model

    return initial_model(cfg)[0]


def _numel(cfg):
    return initial_weights(cfg).size


def weights_of(servers):
    """The whole flat vector of the servers' weights (their stripes put in place)."""
    return servers[0].shape.join([s.state.w for s in servers])


@pytest.mark.parametrize("k, parts", [(2, 1), (3, 1), (1, 4), (2, 4)])
def test_sharded_hardsync_ends_with_the_one_servers_weights(ctx, k, parts):
    """... and so do K servers with their ranges in parts (wire.parts), one server's too."""
    cfg = small_config("sync.protocol=hardsync", "train.epochs=0.25")
    one = run_sharded(cfg, 1, ctx)
    many = run_sharded(
        small_config("sync.protocol=hardsync", "train.epochs=0.25", f"wire.parts={parts}"), k, ctx
    )
    for s in many if parts > 1 else ():  # every part but the last went ahead of its update
        assert s.state.parts.stepped_ahead == (parts - 1) * s.state.engine.updates
    ts = {s.state.engine.timestamp for s in many}
    assert ts == {one[0].state.engine.timestamp} and ts.pop() > 10
    shares = [s.share for s in ClusterShape(k, parts).sized(_numel(cfg)).servers]
    assert [s.state.share for s in many] == shares
    if k == 1 or parts == 1:  # ranges: the split of the vector
        assert [x.numel for x in shares] == [x.numel for x in split(_numel(cfg), k)]
    for s in many:  # hardsync per server: every gradient at staleness 0
        assert s.state.engine.gradients_received == one[0].state.engine.gradients_received
    w1, wk = weights_of(one), weights_of(many)
    assert not np.array_equal(wk, initial_weights(cfg))  # it trained
    np.testing.assert_allclose(wk, w1, rtol=0, atol=1e-5 * np.abs(w1).max())


def test_sharded_softsync_keeps_a_timestamp_and_staleness_per_server(ctx):
    cfg = small_config("sync.protocol=softsync", "sync.n=2", "sync.learners=4", "train.epochs=0.25")
    servers = run_sharded(cfg, 2, ctx)
    for s in servers:
        eng = s.state.engine
        assert eng.updates == eng.timestamp > 5 and eng.gradients_received >= 2 * eng.updates
        # every learner left by STOP or BYE: none waited for (the gradient that ends a
        # server may be another learner's on each)
        assert s.state.counters.evictions == 0 and s.state.all_stopped
    assert np.isfinite(weights_of(servers)).all()


def test_a_learner_expecting_another_range_is_refused_at_hello(ctx):
    cfg = small_config("sync.protocol=async", "architecture.servers=2")
    numel = _numel(cfg)
    a, b = split(numel, 2)
    ps = ParameterServer(cfg, "tcp://127.0.0.1:0", ctx=ctx, server=1)
    stop = threading.Event()
    t = threading.Thread(target=ps.serve_forever, args=(stop,), daemon=True)
    t.start()
    ch = Channel(ctx, ps.endpoint, 0, timeout_ms=10_000)
    try:
        for fields in ({"range": [a.lo, a.hi]}, {}):  # another range; none (the whole)
            ch.send(Kind.HELLO, model=ps.state.signature, numel=numel, **fields)
            with pytest.raises(ServerError, match=r"expects range \[.*serves \["):
                ch.recv({Kind.WELCOME}, numel=b.numel)
        ch.send(Kind.HELLO, model=ps.state.signature, numel=numel, range=[b.lo, b.hi])
        welcome = ch.recv({Kind.WELCOME}, numel=b.numel)
        assert welcome.kind == Kind.WELCOME  # its range of the initial weights
        got = np.concatenate([np.asarray(p) for p in welcome.payloads])
        np.testing.assert_array_equal(got, initial_weights(cfg)[b.lo : b.hi])
    finally:
        ch.close()
        stop.set()
        t.join(10)


def test_a_learner_given_another_number_of_servers_than_the_shape_has_is_refused(ctx):
    adv = small_config("architecture.kind=advstar", "sync.protocol=softsync")
    eps = [transport.free_tcp_endpoint(), transport.free_tcp_endpoint()]
    with pytest.raises(ValueError, match="2 parameter server endpoints for the 1 servers"):
        Learner(adv, 0, eps, transport.free_tcp_endpoint(), None, ctx)
    with pytest.raises(ValueError, match="1 parameter server endpoints for the 3 servers"):
        Learner(with_servers(small_config(), 3), 0, eps[:1], transport.free_tcp_endpoint())


@pytest.mark.parametrize("servers", [1, 2])
def test_a_learner_that_fails_half_built_closes_the_sockets_it_made(monkeypatch, servers):
    """The exchange fails after the server, data and statistics sockets exist: the learner
    closes them, so its (shared) context's term() returns instead of waiting forever."""
    from rudra_zmq.learner import learner

    def broken(*args, **kwargs):
        raise OSError("address already in use (made up)")

    monkeypatch.setattr(learner, "make_exchange", broken)
    c = zmq.Context()
    eps = [transport.free_tcp_endpoint() for _ in range(servers)]
    stats = transport.free_tcp_endpoint()
    cfg = with_servers(small_config(), servers)
    # the error kept, as learner.serve keeps it to report: its traceback holds the learner
    with pytest.raises(OSError, match="made up") as failed:
        Learner(cfg, 0, eps, transport.free_tcp_endpoint(), stats, c)
    ender = threading.Thread(target=c.term, daemon=True)
    ender.start()
    ender.join(20)
    if ender.is_alive():  # sockets left open: end the context here, not at interpreter exit
        c.destroy(linger=0)
    assert not ender.is_alive(), f"the half-built learner left sockets open ({failed.value})"


class ScriptedLinks:
    """``learner.links.ServerLinks`` without sockets: records what is sent to which server and
    answers ``gather`` from a script (one dict of replies per call)."""

    def __init__(self, shape, script):
        self.script, self.sent = list(script), []
        self.channels = [self.Recorder(self, k) for k in range(len(shape.servers))]

    class Recorder:
        def __init__(self, links, k):
            self.links, self.k = links, k

        def send(self, kind, ts=0, payloads=(), **fields):
            self.links.sent.append((self.k, kind, ts, fields))

    def gather(self, which, kinds, timeout_ms=None):
        replies = self.script.pop(0)
        if isinstance(replies, Exception):  # the servers it names stayed silent
            assert set(replies.silent) | set(replies.replies) == set(which)
            raise replies
        assert set(replies) == set(which)
        return replies


def scripted(cfg, flat, k, script):
    """The learner's exchange over ``k`` servers whose replies come from ``script``, and
    its links."""
    from rudra_zmq.learner.exchange import make_exchange

    shape = ClusterShape.of(with_servers(cfg, k), flat.numel)
    links = ScriptedLinks(shape, script)
    return make_exchange(cfg, shape, 0, flat, links, None), links


def test_a_server_that_asks_to_rejoin_gets_a_hello_alone_and_a_finished_one_is_left():
    from rudra_zmq.wire import Message

    flat = _flat10()

    def msg(kind, ts, value, **fields):
        return Message(kind, -1, 0, ts, 0, fields, [np.full(5, value, np.float32)])

    script = [
        {0: msg(Kind.WELCOME, 3, 1.0, step=7), 1: msg(Kind.WELCOME, 4, 2.0)},
        {0: msg(Kind.WEIGHTS, 5, 3.0), 1: ServerError("rejoin", "evicted")},
        {1: msg(Kind.WELCOME, 9, 4.0)},  # server 1's answer to the new HELLO
        {0: msg(Kind.UPTODATE, 5, 0.0), 1: msg(Kind.STOP, 9, 0.0, reason="done")},
        {0: msg(Kind.WEIGHTS, 6, 5.0)},  # server 0 alone: server 1 has finished
        {0: msg(Kind.STOP, 6, 0.0, reason="done")},
    ]
    steps = []
    ex, shards = scripted(small_config(), flat, 2, script)
    ex.on_welcome = steps.append
    assert ex.start() and ex.stamps == [3, 4] and steps == [7]
    assert [s[3]["range"] for s in shards.sent] == [[0, 5], [5, 10]]
    np.testing.assert_array_equal(flat.weights, [1] * 5 + [2] * 5)
    shards.sent.clear()
    assert ex.step(lambda: None)  # server 0 answered weights, server 1 said rejoin
    assert [(k, kind) for k, kind, *_ in shards.sent] == [
        (0, Kind.PUSHPULL),
        (1, Kind.PUSHPULL),
        (1, Kind.HELLO),  # server 1 alone, saying the newest timestamp it had
    ]
    assert [s[2] for s in shards.sent[:2]] == [3, 4] and shards.sent[2][3]["had"] == 4
    assert ex.stamps == [5, 9] and ex.rejoins == 1 and steps == [7]  # server 0's step only
    np.testing.assert_array_equal(flat.weights, [3] * 5 + [4] * 5)
    shards.sent.clear()
    assert ex.step(lambda: None)  # server 1 finished training; server 0 goes on
    np.testing.assert_array_equal(flat.weights, [3] * 5 + [4] * 5)  # UPTODATE: kept
    assert ex.active == [0]
    shards.sent.clear()
    assert ex.step(lambda: None)  # pushes to server 0 only; range 1 keeps its final weights
    assert [(k, kind) for k, kind, *_ in shards.sent] == [(0, Kind.PUSHPULL)]
    np.testing.assert_array_equal(flat.weights, [5] * 5 + [4] * 5)
    assert not ex.step(lambda: None)  # every server has said STOP: the learner ends
    assert ex.active == []


def test_a_refused_slice_takes_its_error_feedback_residual_with_it():
    """float16 gradients with error feedback: server 1 answers rejoin, so the slice it refused
    was never applied and its rounding residual is dropped; server 0's, applied, is kept."""
    from types import SimpleNamespace

    from rudra_zmq.wire import Message

    flat = SimpleNamespace(
        weights=np.zeros(10, np.float32),
        grads=np.full(10, 0.1, np.float32),  # 0.1 is not a float16: a rounding residual
        signature="m",
        numel=10,
        weights_to_device=lambda: None,
    )

    def msg(kind, ts, **fields):
        return Message(kind, -1, 0, ts, 0, fields, [np.zeros(5, np.float32)])

    script = [
        {0: msg(Kind.WELCOME, 1), 1: msg(Kind.WELCOME, 1)},
        {0: msg(Kind.WEIGHTS, 2), 1: ServerError("rejoin", "evicted")},
        {1: msg(Kind.WELCOME, 3)},
    ]
    ex, _ = scripted(small_config("wire.gradient_dtype=float16"), flat, 2, script)
    assert ex.start() and ex.step(lambda: None) and ex.rejoins == 1
    kept, dropped = (c.codec.residual for c in ex.carriers)
    assert kept is not None and np.abs(kept).max() > 0  # applied: carried into the next
    assert dropped is None  # refused: gone with its gradient


def test_one_server_asking_to_rejoin_drops_the_refused_gradients_residual_too():
    """The same for one server (a set of one, the same exchange): the refused push's float16
    residual is dropped, and the next gradient after the WELCOME starts a new one."""
    from types import SimpleNamespace

    from rudra_zmq.wire import Message

    def welcome(ts):
        return {0: Message(Kind.WELCOME, -1, 0, ts, 0, {}, [np.zeros(4, np.float32)])}

    flat = SimpleNamespace(
        weights=np.zeros(4, np.float32),
        grads=np.full(4, 0.1, np.float32),
        signature="m",
        numel=4,
        weights_to_device=lambda: None,
    )
    cfg = small_config("wire.gradient_dtype=float16")
    script = [welcome(7), {0: ServerError("rejoin", "evicted")}, welcome(8)]
    ex, links = scripted(cfg, flat, 1, script)
    assert ex.start() and ex.ts == 7
    assert ex.step(lambda: None) and ex.rejoins == 1 and ex.ts == 8
    assert [kind for _, kind, *_ in links.sent] == [Kind.HELLO, Kind.PUSHPULL, Kind.HELLO]
    assert links.sent[0][3]["range"] == [0, 4]  # one server: its range is the whole vector
    assert ex.carriers[0].codec.residual is None  # refused: gone with its gradient


def _flat10():
    """A learner's flat model of 10 floats, without torch."""
    from types import SimpleNamespace

    return SimpleNamespace(
        weights=np.zeros(10, np.float32),
        grads=np.ones(10, np.float32),
        signature="m",
        numel=10,
        weights_to_device=lambda: None,
    )


def _two_servers_learner(script):
    return scripted(small_config(), _flat10(), 2, script)[0]


@pytest.mark.parametrize("stop_first", [True, False])
def test_a_server_silent_after_another_said_stop_ends_the_learner_without_failing(
    caplog, stop_first
):
    """Server 0 said STOP (a step before, or in the same step) and server 1, dead after
    training ended with its STOP lost, says nothing: the learner ends (no error) and names
    it. While every server is still training, silence stays a failure."""
    from rudra_zmq.learner.links import ServersSilent
    from rudra_zmq.wire import Message

    def msg(kind, ts, **fields):
        return Message(kind, -1, 0, ts, 0, fields, [np.zeros(5, np.float32)])

    welcome = {0: msg(Kind.WELCOME, 3), 1: msg(Kind.WELCOME, 3)}
    stop0 = msg(Kind.STOP, 4, reason="done")
    if stop_first:
        script = [welcome, {0: stop0, 1: msg(Kind.WEIGHTS, 4)}, ServersSilent("quiet", [1], {})]
    else:
        script = [welcome, ServersSilent("quiet", [1], {0: stop0})]
    ex = _two_servers_learner(script)
    assert ex.start()
    if stop_first:
        assert ex.step(lambda: None) and ex.active == [1]
    with caplog.at_level("WARNING", logger="rudra_zmq.learner"):
        assert not ex.step(lambda: None)
    assert ex.active == []
    assert "servers [0] finished training and [1] has said nothing since" in caplog.text

    silent = ServersSilent("no reply from ps1", [1], {0: msg(Kind.WEIGHTS, 4)})
    ex = _two_servers_learner([welcome, silent])
    assert ex.start()
    with pytest.raises(ServersSilent, match="no reply from ps1"):
        ex.step(lambda: None)


def test_a_learners_channel_to_each_server_takes_runtime_sndbuf_kib(ctx):
    """The send buffer that keeps K flows from overflowing a switch port (docs/wire.md):
    every learner-server connection asks the kernel for it (0: the kernel sizes it)."""
    from rudra_zmq.learner.links import server_channels

    for kib, want in ((32, 32 << 10), (0, -1)):
        cfg = small_config("architecture.servers=2", f"runtime.sndbuf_kib={kib}")
        shape = ClusterShape.of(cfg, 1000)
        chans = server_channels(ctx, cfg, shape, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], 0)
        try:
            assert [ch.sock.getsockopt(zmq.SNDBUF) for ch in chans] == [want, want]
        finally:
            for ch in chans:
                ch.close()
