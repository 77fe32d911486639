"""Hardsync in parts (``wire.parts``) at the server's state: no sockets, messages built with
wire.encode. A part is stepped once every member's part is in; the round's update steps the
rest; per element the result is the whole-message update's."""

import numpy as np
import pytest

from cluster import small_config
from rudra_zmq import wire
from rudra_zmq.server.parts import PartRound
from rudra_zmq.server.state import ServerState
from rudra_zmq.shape import part_bounds
from rudra_zmq.sync import ProtocolViolation
from rudra_zmq.wire import Kind
from test_ps import expected_step

N, SIG = 12, "sig"
SEG = [(0, N, 1.0, 1.0)]


def state(*overrides):
    cfg = small_config("sync.protocol=hardsync", *overrides)
    w0 = np.linspace(-1, 1, N, dtype=np.float32)
    st = ServerState(cfg, w0, SEG, SIG, epoch_size=64)
    for i in range(cfg.sync.learners):
        st.register(str(i).encode(), msg(Kind.HELLO, i, model=SIG, numel=N))
    return cfg, st, w0


def msg(kind, sender, ts=0, payloads=(), seq=1, **fields):
    return wire.decode(wire.encode(kind, sender, seq, ts, 0, list(payloads), **fields), numel=N)


def parts_of(grad, parts, sender, ts=0, seq=1, last=None):
    """The request's parts in order; ``last``: the one sent last (without x{more})."""
    b = part_bounds(N, parts)
    last = len(b) - 2 if last is None else last
    return [
        msg(
            Kind.PUSHPULL,
            sender,
            ts,
            [grad[lo:hi]],
            seq,
            at=lo,
            **({"more": True} if i != last else {}),
        )
        for i, (lo, hi) in enumerate(zip(b, b[1:]))
    ]


def grads(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(np.float32) for _ in range(n)]


def test_part_bounds_cut_like_split_and_never_more_parts_than_floats():
    assert part_bounds(12, 4) == [0, 3, 6, 9, 12]
    assert part_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert part_bounds(3, 8) == [0, 1, 2, 3]
    assert part_bounds(5, 1) == [0, 5]
    with pytest.raises(ValueError, match="parts must be"):
        part_bounds(5, 0)


def test_a_round_in_parts_steps_each_part_once_both_are_in_and_ends_with_the_whole_update():
    cfg, st, w0 = state("wire.parts=4")
    g = grads()
    a, b = parts_of(g[0], 4, 0), parts_of(g[1], 4, 1)
    assert st.push_part(a[0]) is None and st.parts_ahead() == []  # learner 1's part 0 missing
    assert st.push_part(b[0]) is None
    ahead = st.parts_ahead()  # part 0 is complete: stepped into the next version, not published
    w1, _ = expected_step(w0, np.zeros_like(w0), g, cfg, SEG)
    assert [i for i, _ in ahead] == [0] and st.engine.timestamp == 0
    np.testing.assert_allclose(ahead[0][1], w1[0:3], rtol=1e-6)
    np.testing.assert_array_equal(st.w, w0)  # the current version is untouched meanwhile
    assert st.parts.round.ahead_to(0, st.engine.members) == [(0, 1), (1, 1)]
    for m in a[1:3] + b[1:3]:
        assert st.push_part(m) is None
    assert [i for i, _ in st.parts_ahead()] == [1, 2]
    for sender in (0, 1):
        st.parts.round.ahead_to(1, {sender}), st.parts.round.ahead_to(2, {sender})
    assert st.push_part(a[3]).update is None
    arrival = st.push_part(b[3])
    assert arrival.update is not None and st.engine.timestamp == 1
    np.testing.assert_allclose(st.w, w1, rtol=1e-6)
    assert st.parts.record() == {"parts": 4, "stepped_ahead": 3, "dropped": 0, "rate_changed": 0}
    # the replies carry what did not go ahead: from part 3 on
    frames, at = st.weights_for(0)
    assert at == {"at": 9} and sum(f.shape[0] for f in frames) == 3
    assert st.weights_for(0)[1] == {}  # once: a reply sent again carries the whole range


def test_parts_end_bit_identical_to_whole_messages_with_two_learners():
    """Two gradients sum alike in either order, so parts change nothing at all."""
    _, whole, _ = state()
    _, parted, _ = state("wire.parts=3")
    for t in range(5):
        g = grads(seed=t)
        for i in (1, 0):
            whole.push(msg(Kind.PUSHPULL, i, t, [g[i]], seq=t + 1))
        ms = [parts_of(g[0], 3, 0, t, t + 1), parts_of(g[1], 3, 1, t, t + 1)]
        for k in range(3):  # interleaved, learner 0 first
            for m in (ms[0][k], ms[1][k]):
                parted.push_part(m)
                parted.parts_ahead()
    np.testing.assert_array_equal(parted.w, whole.w)
    np.testing.assert_array_equal(parted.updater.v, whole.updater.v)
    assert parted.parts.stepped_ahead == 5 * 2


def test_a_part_that_is_not_one_of_the_servers_parts_is_refused_before_anything_changes():
    _, st, w0 = state("wire.parts=4")
    g = np.ones(N, np.float32)
    bad = [
        msg(Kind.PUSHPULL, 0, 0, [g[0:4]], at=0, more=True),  # parts of 3 here
        msg(Kind.PUSHPULL, 0, 0, [g[8:]], at=8),  # a last part, of 4 floats
        msg(Kind.PUSHPULL, 0, 0, [g[1:4]], at=1, more=True),
    ]
    for m in bad:
        with pytest.raises(ProtocolViolation, match="another wire.parts"):
            st.push_part(m)
    assert not st.parts.open
    np.testing.assert_array_equal(st.updater.acc, 0)
    with pytest.raises(ProtocolViolation, match="takes them in wire.parts=4 parts"):
        st.push(msg(Kind.PUSHPULL, 0, 0, [g]))
    _, whole, _ = state()
    with pytest.raises(ProtocolViolation, match="whole ones"):
        whole.push_part(parts_of(g, 4, 0)[0])


def test_a_part_from_a_stale_or_unknown_learner_is_refused_before_it_is_summed():
    _, st, _ = state("wire.parts=4")
    g = np.ones(N, np.float32)
    with pytest.raises(ProtocolViolation, match="newer than the server"):
        st.push_part(parts_of(g, 4, 0, ts=3)[0])
    st.evict(1)
    with pytest.raises(ProtocolViolation, match="not a member"):
        st.push_part(parts_of(g, 4, 1)[0])
    np.testing.assert_array_equal(st.updater.acc, 0)


def test_a_resent_request_adds_nothing_twice_and_a_lost_part_waits_for_the_resend():
    _, st, _ = state("wire.parts=4")
    g = np.ones(N, np.float32)
    a = parts_of(g, 4, 0)
    st.push_part(a[0]), st.push_part(a[1])
    assert st.push_part(a[0]) is None and st.push_part(a[1]) is None  # copies: not summed
    np.testing.assert_array_equal(st.updater.acc[:6], 1.0)
    assert st.push_part(a[3]) is None  # part 2 lost: the request is not complete
    np.testing.assert_array_equal(st.updater.acc[9:], 1.0)
    assert st.engine.pending == 0
    for m in a[:3]:  # the request sent again whole: part 2 completes it (the server drops
        st.push_part(m)  # the copies behind it: ps.py's is_sent_before / is_duplicate)
    assert st.engine.pending == 1 and st.engine.pending_learners == {0}
    np.testing.assert_array_equal(st.updater.acc, 1.0)


def test_parts_sent_last_layer_first_end_bit_identical_and_the_reply_carries_part_0_only():
    """As a learner pushing during backward sends them: the last part first, part 0 (no
    x{more}) last. Parts 3, 2, 1 go ahead as both learners' are in; the reply is part 0."""
    _, whole, _ = state()
    _, parted, _ = state("wire.parts=4")
    for t in range(3):
        g = grads(seed=t)
        for i in (1, 0):
            whole.push(msg(Kind.PUSHPULL, i, t, [g[i]], seq=t + 1))
        ms = [parts_of(g[s], 4, s, t, t + 1, last=0) for s in (0, 1)]
        ahead = []
        for k in (3, 2, 1, 0):
            for m in (ms[0][k], ms[1][k]):
                parted.push_part(m)
                for i, _ in parted.parts_ahead():  # as ReplyWeights.ahead sends them
                    ahead.append(i)
                    assert parted.parts.round.ahead_to(i, parted.engine.members) == [
                        (0, t + 1),
                        (1, t + 1),
                    ]
        assert ahead == [3, 2, 1]
        for s in (0, 1):
            frames, fields = parted.weights_for(s)
            assert fields == {"at": 0} and sum(f.shape[0] for f in frames) == 3
    np.testing.assert_array_equal(parted.w, whole.w)
    np.testing.assert_array_equal(parted.updater.v, whole.updater.v)


def test_a_learner_evicted_mid_round_keeps_its_parts_and_each_part_is_averaged_over_its_own():
    cfg, st, w0 = state("wire.parts=4")
    g = grads()
    a, b = parts_of(g[0], 4, 0), parts_of(g[1], 4, 1)
    for m in a:
        st.push_part(m)
    st.push_part(b[0]), st.push_part(b[1])
    assert [i for i, _ in st.parts_ahead()] == [0, 1]
    update = st.evict(1)  # learner 1 sent half of its gradient
    assert update is not None and st.engine.timestamp == 1
    both, _ = expected_step(w0, np.zeros_like(w0), g, cfg, SEG)
    alone, _ = expected_step(w0, np.zeros_like(w0), g[:1], cfg, SEG)
    np.testing.assert_allclose(st.w[:6], both[:6], rtol=1e-6)
    np.testing.assert_allclose(st.w[6:], alone[6:], rtol=1e-6)
    assert not st.parts.open


def test_a_learner_that_rejoins_mid_round_has_the_parts_stepped_without_it_dropped():
    _, st, _ = state("wire.parts=4", "sync.learners=3")
    g = np.ones(N, np.float32)
    st.evict(2)
    for s in (0, 1):
        st.push_part(parts_of(g, 4, s)[0])
    assert [i for i, _ in st.parts_ahead()] == [0]
    st.register(b"2", msg(Kind.HELLO, 2, seq=5, model=SIG, numel=N))
    st.join(2, 0.0)
    late = parts_of(g, 4, 2, seq=6)
    st.push_part(late[0])  # its part 0 was stepped without it
    assert st.parts.round.dropped == 1 and 2 not in st.parts.round.contrib[0]
    st.push_part(late[1])
    assert 2 in st.parts.round.contrib[1]


def test_parts_complete_in_any_order_and_the_reply_carries_the_run_not_sent_ahead():
    r = PartRound(12, 4)
    for s in (0, 1):
        assert r.arrive(s, 7, 2) == "add"
    assert r.complete({0, 1}) == [2]
    r.stepped[2] = True
    assert r.ahead_to(2, {0, 1}) == [(0, 7), (1, 7)]
    r.stepped[3] = True
    assert r.ahead_to(3, {0}) == [(0, 7)]
    r.finished(5)
    # learner 0 lacks parts 0-1 (one run: elements 0..6); learner 1 lacks 0, 1 and 3
    assert r.tail(0, 5) == (0, 6) and r.tail(1, 5) == (0, 12) and r.tail(0, 5) == (0, 12)
    assert r.complete({0}) == [] and not any(r.contrib)
    r.sent = {0: {0, 1, 2, 3}, 1: {0, 1}}
    r.finished(6)
    assert r.tail(0, 6) == (12, 12) and r.tail(1, 6) == (6, 12)


def test_a_server_answers_each_part_ahead_and_a_check_mid_request_hears_not_got(ctx):
    """Over sockets: learner 0's part 0 goes ahead once learner 1's is in, while learner 0's
    later parts are still to come; a CHECK about a request half in says "not got" (so a lost
    part is sent again); the reply carries the rest; a server of whole messages refuses
    parts, naming wire.parts."""
    from cluster import FakeLearner, running
    from test_ps import make_ps

    cfg, ps = make_ps(ctx, "sync.protocol=hardsync", "wire.parts=4")
    with running(ps) as errors:
        a, b = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        n = ps.state.numel
        w0, ts = a.hello(ps.state.signature, n)
        b.hello(ps.state.signature, n)
        bounds = part_bounds(n, 4)
        g = [np.full(n, v, np.float32) for v in (0.5, 1.5)]

        def part(who, i, seq):
            lo, hi = bounds[i], bounds[i + 1]
            more = {"more": True} if i < 3 else {}
            frames = wire.encode(
                Kind.PUSHPULL, who.id, seq, ts, 0, [g[who.id][lo:hi]], at=lo, **more
            )
            who.send_raw(frames)

        part(a, 0, 10)
        a.send_raw(wire.encode(Kind.CHECK, 0, 10, 0, 0))
        receipt = a.recv()
        assert receipt.kind == Kind.RECEIPT and receipt.fields == {"re": 10, "got": False}
        part(b, 0, 20)
        ahead = a.recv()  # part 0 of the next version, before a's other parts were sent
        assert ahead.kind == Kind.WEIGHTS and ahead.ts == 1
        assert ahead.fields == {"re": 10, "at": 0, "more": True}
        w1, _ = expected_step(w0, np.zeros_like(w0), g, cfg, ps.state.updater.segments)
        np.testing.assert_allclose(
            np.concatenate(ahead.payloads), w1[: bounds[1]], rtol=1e-6, atol=1e-7
        )
        for i in (1, 2, 3):
            part(a, i, 10), part(b, i, 20)
        got = [a.recv() for _ in range(3)]  # parts 1 and 2 ahead, then the reply
        assert [m.fields.get("at") for m in got] == bounds[1:4]
        reply = got[-1].fields  # the reply: what is left (with σ when a's part came last)
        assert {k: reply[k] for k in ("re", "at")} == {"re": 10, "at": bounds[3]}
        assert "more" not in reply and reply.get("sigma", 0) == 0
        np.testing.assert_allclose(
            np.concatenate(got[-1].payloads), w1[bounds[3] :], rtol=1e-6, atol=1e-7
        )
        a.send_raw(wire.encode(Kind.CHECK, 0, 10, 0, 0))
        assert a.recv().fields == {"re": 10, "got": True}
        a.close(), b.close()
    assert not errors
    _, whole = make_ps(ctx, "sync.protocol=hardsync")
    with running(whole) as errors:
        c = FakeLearner(ctx, whole.endpoint, 0)
        c.hello(whole.state.signature, whole.state.numel)
        frames = wire.encode(Kind.PUSHPULL, 0, 5, 0, 0, [np.zeros(3, np.float32)], at=0, more=True)
        c.send_raw(frames)
        refusal = c.recv()
        assert refusal.kind == Kind.ERROR and refusal.fields["code"] == "unexpected_field"
        assert "wire.parts=1" in refusal.fields["error"]
        c.close()
    assert not errors


def recording_serving(*overrides):
    """A request path (``Serving``) over a parts state, recording what it does in ``did``
    (the PUSHPULL handler, each send with its code and ``re``, each STOP); ``push(ident, seq,
    upto)`` hands it parts of a gradient from learner 0."""
    import logging

    from rudra_zmq import codec
    from rudra_zmq.server.serving import Serving

    cfg, st, _ = state("wire.parts=4", *overrides)
    did = []
    serving = Serving(
        None,
        wire.SENDER_PS,
        st,
        {Kind.PUSHPULL: lambda ident, m: did.append(("handler", m.kind))},
        send=lambda ident, kind, payloads=(), **f: did.append((kind, f.get("code"), f["re"])),
        stop=lambda ident, sender, seq: did.append(("stop", sender, seq)),
        learners=st.learners,
        log=logging.getLogger("test_server_parts"),
        dtypes=codec.dtypes(cfg),
        parts=True,
    )
    g = np.ones(N, np.float32)

    def push(ident: bytes, seq: int, upto: int = 4, last: int | None = None) -> None:
        """``last``: the part sent last, without x{more} (default the final one)."""
        parts = parts_of(g, 4, 0, seq=seq, last=last)
        if last is not None:  # wire.priority's order: backward's, the first layers last
            parts = parts[::-1]
        for m in parts[:upto]:
            serving.handle(
                [ident, *wire.encode(Kind.PUSHPULL, 0, seq, 0, 0, m.payloads, **m.fields)]
            )

    return st, did, push


def test_once_training_is_over_a_request_in_parts_is_told_stop_once_at_its_last_part():
    st, did, push = recording_serving()
    push(b"0", 9, upto=2)
    assert did == [("handler", Kind.PUSHPULL)] * 2
    st.done, did[:] = True, []
    push(b"0", 10)
    assert did == [("stop", 0, 10)]


SLOW_LEARNER = """
import sys, time
sys.path.insert(0, "tests")
import numpy as np, zmq
from cluster import FakeLearner
from rudra_zmq import wire
from rudra_zmq.wire import Kind
endpoint, n, half = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
a = FakeLearner(ctx, endpoint, 0, timeout_ms=10_000, sockopts={zmq.RCVBUF: 1 << 16})
a.hello("sig", n)
g = np.ones(n, np.float32)
a.send_raw(wire.encode(Kind.PUSHPULL, 0, 10, 0, 0, [g[:half]], at=0, more=True))
a.send_raw(wire.encode(Kind.PUSHPULL, 0, 10, 0, 0, [g[half:]], at=half))
time.sleep(0.5)  # its parts leave
print("sent", flush=True)
sys.stdin.readline()  # stopped (SIGSTOP) about here, then woken: SIGCONT, then a line
got = [a.recv(), a.recv()]
print(" ".join(f"{m.kind.name}:{m.fields.get('re')}:{m.fields.get('at')}" for m in got), flush=True)
"""


def test_the_last_stop_reaches_a_learner_slow_to_read_behind_the_weights_sent_ahead(ctx):
    """The run's last round, in 2 parts of 8 MB: learner a (a process of its own) is stopped
    after sending its parts, so part 0 of the new weights, sent ahead to it, waits in the
    server's queue with the STOP behind it when the server ends. Woken a second later, a
    still gets both: once training is over the server's socket gives what it queued
    ``runtime.retry_s`` to leave. (It gave 0.2 s: on the emulated LAN three learners of
    eight lost that STOP and failed after runtime.timeout_s.)"""
    import signal
    import subprocess
    import sys
    import time

    from cluster import FakeLearner, running
    from rudra_zmq.benchmarks.synthetic_roles import overrides
    from rudra_zmq.config import load_config
    from rudra_zmq.server.ps import ParameterServer

    n = 4_000_000  # 16 MB of weights: a part is more than the kernel's socket buffers hold
    sets = overrides("base", "hardsync", 2, 2, parts=2, retry_s=3, chunk_mib=64)  # one frame
    model = (np.zeros(n, np.float32), [(0, n, 1.0, 1.0)], SIG)
    ps = ParameterServer(load_config(None, sets), "tcp://127.0.0.1:0", ctx=ctx, model=model)
    half = part_bounds(n, 2)[1]
    with running(ps) as errors:
        a = subprocess.Popen(
            [sys.executable, "-c", SLOW_LEARNER, ps.endpoint, str(n), str(half)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert a.stdout.readline() == "sent\n"
            a.send_signal(signal.SIGSTOP)  # reads nothing: its link's buffers fill
            b = FakeLearner(ctx, ps.endpoint, 1)
            b.hello(SIG, n)
            g = np.ones(n, np.float32)
            b.send_raw(wire.encode(Kind.PUSHPULL, 1, 20, 0, 0, [g[:half]], at=0, more=True))
            b.send_raw(wire.encode(Kind.PUSHPULL, 1, 20, 0, 0, [g[half:]], at=half))
            ahead, stop = b.recv(), b.recv()
            assert (ahead.kind, ahead.fields["at"], stop.kind) == (Kind.WEIGHTS, 0, Kind.STOP)
            deadline = time.monotonic() + 10
            while not ps.state.all_stopped and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # the server has ended by now
            a.send_signal(signal.SIGCONT)
            # a line, not a signal: a signal that came before signal.pause() was entered was
            # handled there and left it waiting (CI under load: the child never woke)
            out, _ = a.communicate("go\n", timeout=30)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
        b.close()
    assert out == "WEIGHTS:10:0 STOP:10:None\n", out
    assert not errors


def test_a_request_refused_at_a_part_gets_one_error_and_its_resend_one_more():
    """A learner this server does not know (a restarted server: "rejoin") sends a gradient in
    4 parts: one ERROR and one refusal counted for the request, not one per part; the same
    request sent again (as Channel.resend does: the parts in the order sent) is answered again."""
    st, did, push = recording_serving()
    push(b"7", 9)
    push(b"7", 9)  # sent again
    push(b"7", 10)  # its next request
    assert did == [(Kind.ERROR, "rejoin", 9)] * 2 + [(Kind.ERROR, "rejoin", 10)]
    assert st.counters.invalid == 3


def test_a_request_refused_that_sends_part_0_last_gets_one_error_per_copy():
    """``wire.priority`` sends the parts backward finished lowest offset first, so part 0
    (the first layers) goes last: a copy refused at its first part (part 3) drops the rest
    up to the one without x{more} (part 0), and the copy sent again gets one ERROR more."""
    st, did, push = recording_serving()
    push(b"7", 9, last=0)
    assert did == [(Kind.ERROR, "rejoin", 9)]  # part 0 is the copy's end, not a new copy
    push(b"7", 9, last=0)  # sent again
    push(b"7", 10, last=0)  # its next request
    assert did == [(Kind.ERROR, "rejoin", 9)] * 2 + [(Kind.ERROR, "rejoin", 10)]
    assert st.counters.invalid == 3
