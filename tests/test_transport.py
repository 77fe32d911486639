"""channel.Channel: a silent server is a TimeoutError naming it, never a hang."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from rudra_zmq import plan_endpoints, transport, wire
from rudra_zmq.channel import Channel, ServerError
from rudra_zmq.config import ConfigError
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(30)


def server_and_channel(ctx, sender, timeout_ms, **kw):
    """A bound ROUTER the test answers by hand, a Channel to it, and the port."""
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    return (
        server,
        Channel(ctx, f"tcp://127.0.0.1:{port}", sender, timeout_ms=timeout_ms, **kw),
        port,
    )


def test_a_silent_server_is_a_timeout_error_naming_it(ctx):
    server, ch, port = server_and_channel(ctx, 0, 200, name="parameter server")
    t = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"no reply from the parameter server at "
        rf"tcp://127.0.0.1:{port} within 0.2 s",
    ):
        ch.request(Kind.PULL, 0)
    assert time.monotonic() - t < 10  # bounded, not a hang (generous: the box is shared)
    ch.close()


def test_a_timeout_says_what_the_request_awaited_and_what_the_checks_heard(ctx):
    """A server that says "got it" to every CHECK and never answers (a reply lost on its
    way): the TimeoutError says so, so a stalled run's log tells a lost reply from a
    server that never got the request."""
    import threading

    server, ch, _ = server_and_channel(ctx, 3, 1500, retry_ms=100)
    server.setsockopt(zmq.RCVTIMEO, 100)
    done = threading.Event()

    def says_got():
        while not done.is_set():
            try:
                ident, *frames = server.recv_multipart()
            except zmq.Again:
                continue
            msg = wire.decode(frames)
            if msg.kind == Kind.CHECK:
                receipt = wire.encode(Kind.RECEIPT, wire.SENDER_PS, 1, 0, 77, re=msg.seq, got=True)
                server.send_multipart([ident, *receipt])

    t = threading.Thread(target=says_got, daemon=True)
    t.start()
    try:
        with pytest.raises(TimeoutError) as err:
            ch.request(Kind.PULL, 0)
    finally:
        done.set()
        t.join(5)
    said = str(err.value)
    m = re.search(
        r"request \d+ sent [\d.]+ s ago; asked about (\d+) times \(the server said "
        r"got (\d+), not got 0\); on this channel 0 resends",
        said,
    )
    assert m, said
    assert int(m[1]) >= 2 and 1 <= int(m[2]) <= int(m[1]), said
    assert ch.waiting() != "no request outstanding"
    ch.close()


def test_a_reply_is_validated_and_an_error_reply_raises_server_error(ctx):
    server, ch, _ = server_and_channel(ctx, 3, 5000)
    ch.send(Kind.PULL, 0)
    ident, *_ = server.recv_multipart()
    server.send_multipart([ident, *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, 77)])
    assert ch.recv({Kind.UPTODATE}).kind == Kind.UPTODATE and ch.inc == 77
    ch.send(Kind.PULL, 0)
    ident, *_ = server.recv_multipart()
    server.send_multipart(
        [ident, *wire.encode(Kind.ERROR, wire.SENDER_PS, 2, 0, 77, code="protocol", error="nope")]
    )
    with pytest.raises(ServerError, match="refused the request: nope"):
        ch.recv({Kind.UPTODATE})
    ch.close()


def ours(server, ident=None):
    """The next message on ``server`` from ``ident`` (any, if None): another connection (a
    test elsewhere that used this port before) is skipped."""
    while True:
        frames = server.recv_multipart()
        if ident is None or frames[0] == ident:
            return frames


def test_a_slow_request_is_asked_about_with_a_header_and_sent_again_only_if_lost(ctx):
    import threading

    server, ch, _ = server_and_channel(ctx, 3, 10_000, retry_ms=300)
    server.setsockopt(zmq.RCVTIMEO, 5000)
    got = []
    client = threading.Thread(target=lambda: got.append(ch.request(Kind.PULL, 0)), daemon=True)
    client.start()
    try:
        first = ours(server)
        seq = wire.decode(first[1:]).seq

        def receipt(got):
            server.send_multipart(
                [first[0], *wire.encode(Kind.RECEIPT, wire.SENDER_PS, 1, 0, 77, re=seq, got=got)]
            )

        check = ours(server, first[0])  # nothing answered within retry_ms: a header asks
        assert len(check) == 2 and wire.decode(check[1:]).kind == Kind.CHECK
        assert wire.decode(check[1:]).seq == seq and ch.checks >= 1
        receipt(True)  # "got it": the round is only slow, so nothing is sent again
        check = ours(server, first[0])
        assert wire.decode(check[1:]).kind == Kind.CHECK and ch.resent == 0
        receipt(False)  # "never got it" (say, a restarted server): sent again, unchanged
        again = ours(server, first[0])
        while wire.decode(again[1:]).kind == Kind.CHECK:  # one asked before the receipt came
            again = ours(server, first[0])
        assert again[1:] == first[1:] and ch.resent == 1
    except BaseException:
        client.join(15)  # its request times out: never destroy the context under its recv
        raise

    def answer(re):
        server.send_multipart(
            [first[0], *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, 77, re=re)]
        )

    answer(seq)
    client.join(10)
    assert got[0].fields["re"] == seq
    answer(seq)  # the answer to the second copy, late
    ch.send(Kind.PULL, 0)
    nxt = wire.decode(ours(server, first[0])[1:]).seq
    answer(nxt)
    assert ch.recv({Kind.UPTODATE}).fields["re"] == nxt and ch.late == 1
    answer(nxt)  # late again, while nothing is outstanding
    time.sleep(0.2)
    assert ch.drop_late() == 1 and ch.late == 2
    ch.close()


def test_a_request_is_sent_again_when_the_connection_drops_and_comes_back(ctx):
    """The evidence without any RECEIPT: the server went (its reply lost with it) and one
    came back on the same endpoint; the request goes again, unchanged, long before
    retry_ms."""
    import threading

    server, ch, port = server_and_channel(ctx, 3, 20_000, retry_ms=60_000)
    server.setsockopt(zmq.RCVTIMEO, 10_000)
    got = []
    ch.send(Kind.PULL, 0)
    first = ours(server)
    client = threading.Thread(target=lambda: got.append(ch.recv({Kind.UPTODATE})), daemon=True)
    client.start()
    back = ctx.socket(zmq.ROUTER)
    try:
        server.close(linger=0)
        time.sleep(0.3)  # the client sees the connection drop
        back.setsockopt(zmq.RCVTIMEO, 10_000)
        back.bind(f"tcp://127.0.0.1:{port}")
        again = ours(back, first[0])
        assert again[1:] == first[1:] and ch.resent == 1 and ch.checks == 0
    except BaseException:
        client.join(25)
        raise
    seq = wire.decode(first[1:]).seq
    back.send_multipart([first[0], *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, 7, re=seq)])
    client.join(10)
    assert got[0].fields["re"] == seq
    ch.close()
    back.close(linger=0)


def test_free_tcp_endpoints_are_distinct_and_outside_the_ephemeral_range():
    # a launcher takes several before any role binds; the kernel once offered the same
    # free port twice (data and stats collided in CI)
    lo, hi = transport.ephemeral_port_range()
    ports = [int(transport.free_tcp_endpoint().rsplit(":", 1)[1]) for _ in range(300)]
    assert len(set(ports)) == len(ports)
    if lo - 10000 >= 1000:
        assert all(10000 <= p < lo for p in ports), (lo, min(ports), max(ports))


def test_a_port_range_in_the_environment_bounds_the_choice_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv(transport.PORTS_ENV, "20000-20999")
    ports = {int(transport.free_tcp_endpoint().rsplit(":", 1)[1]) for _ in range(50)}
    assert len(ports) == 50 and all(20000 <= p <= 20999 for p in ports)
    for bad in ("20000", "20000-20100", "80-2000", "a-b"):
        monkeypatch.setenv(transport.PORTS_ENV, bad)
        with pytest.raises(ValueError, match=f"RUDRA_ZMQ_PORTS={bad!r}"):
            transport.free_tcp_endpoint()


def test_a_busy_port_range_in_the_environment_is_never_left(monkeypatch):
    """The random draws find only busy ports: every port of $RUDRA_ZMQ_PORTS is tried once
    (the one free port is found), then a clear error, never a port outside the range."""
    monkeypatch.setenv(transport.PORTS_ENV, "40000-40999")
    free = {40999}
    monkeypatch.setattr(transport, "_port_is_free", lambda host, port: port in free)
    monkeypatch.setattr(transport, "_handed_out", set())
    assert transport.free_tcp_endpoint() == "tcp://127.0.0.1:40999"  # the scan found it
    with pytest.raises(OSError, match=r"no free tcp port on 127.0.0.1 in \$RUDRA_ZMQ_PORTS="):
        transport.free_tcp_endpoint()  # 40999 is planned now: none left in the range
    with pytest.raises(ConfigError, match=r"^no free tcp port .*give a wider or another range"):
        plan_endpoints.tcp_endpoint("127.0.0.1")  # what a run says: not "use an address"


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # offer the taken port twice, then random ones (as many as the function wants: the
        # first may happen to be one it handed out before, in another test)
        offers = iter([taken, taken])
        monkeypatch.setattr(transport, "ephemeral_port_range", lambda: (65000, 65535))
        monkeypatch.setattr(
            transport._rng,
            "randrange",
            lambda a, b: next(offers, None) or transport.random.Random().randrange(a, b),
        )
        ep = transport.free_tcp_endpoint()
    assert int(ep.rsplit(":", 1)[1]) != taken


def test_a_foreign_host_is_an_os_error():
    with pytest.raises(OSError):
        transport.free_tcp_endpoint("192.0.2.1")  # TEST-NET-1: never this machine's


def test_a_wait_longer_than_the_wake_slice_still_gets_its_reply_or_times_out(ctx):
    server, ch, port = server_and_channel(ctx, 3, 30_000)
    ch.send(Kind.PULL, 0)
    ident, *_ = server.recv_multipart()
    time.sleep(3 * transport.WAKE_MS / 1000)  # the client's receive wakes up meanwhile
    server.send_multipart([ident, *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, 7)])
    assert ch.recv({Kind.UPTODATE}).kind == Kind.UPTODATE
    ch.close()
    ch = Channel(ctx, f"tcp://127.0.0.1:{port}", 4, timeout_ms=3 * transport.WAKE_MS)
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        ch.request(Kind.PULL, 0)
    assert time.monotonic() - t >= 3 * transport.WAKE_MS / 1000  # the whole timeout, not a slice
    ch.close()


_SIGNAL_ON_ANOTHER_THREAD = """
import signal, threading, time, zmq
from rudra_zmq.channel import Channel
from rudra_zmq.wire import Kind

def stop(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, stop)
# a thread that may take the signal, as torch's threads do; the main thread then blocks it,
# so Linux delivers SIGTERM to that thread and never interrupts the main thread's wait
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
ctx = zmq.Context()
server = ctx.socket(zmq.ROUTER)
port = server.bind_to_random_port("tcp://127.0.0.1")
ch = Channel(ctx, f"tcp://127.0.0.1:{port}", 0, timeout_ms=120_000)
print("ready", flush=True)
try:
    ch.request(Kind.PULL, 0)
except KeyboardInterrupt:
    print("interrupted", flush=True)
ctx.destroy(linger=0)
"""


def test_a_signal_taken_by_another_thread_still_ends_a_long_wait():
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_ON_ANOTHER_THREAD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # now inside the 120 s wait
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)  # without the wake slices: 120 s
        assert "interrupted" in out
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_a_channel_closed_as_its_server_goes_with_a_push_half_sent_does_not_abort_the_process():
    # libzmq 4.3.5 aborted the whole process ("Resource temporarily unavailable
    # (src/session_base.cpp:233)") when a channel closed with linger 0 with a 200 MiB push
    # half-sent and the connection ended just after: docs/wire.md, "Half-sent messages". 200
    # rounds, each a chance; in a subprocess, so that an abort fails this test with its stderr.
    script = Path(__file__).resolve().parent / "half_sent.py"
    proc = subprocess.run(
        [sys.executable, str(script), "close", "200"], capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, (
        f"exit {proc.returncode}: {proc.stdout[-1000:]}{proc.stderr[-3000:]}"
    )


def test_a_request_in_parts_goes_as_one_message_per_part_and_its_reply_comes_ahead_in_parts(ctx):
    import numpy as np

    server, ch, _ = server_and_channel(ctx, 3, 5000)
    server.setsockopt(zmq.RCVTIMEO, 5000)
    grad, weights = np.arange(9, dtype=np.float32), np.zeros(9, np.float32)
    parts = [(0, [grad[:3]]), (3, [grad[3:6]]), (6, [grad[6:]])]

    def reply(at, values, seq, more=False, ident=None):
        fields = {"at": at, "re": seq, **({"more": True} if more else {})}
        frames = wire.encode(Kind.WEIGHTS, wire.SENDER_PS, 1, 5, 77, [values], **fields)
        server.send_multipart([ident, *frames])

    ch.send_parts(Kind.PUSHPULL, 4, parts, weights)
    first = [ours(server) for _ in parts]
    msgs = [wire.decode(f[1:], numel=9) for f in first]
    assert [(m.fields["at"], m.fields.get("more", False)) for m in msgs] == [
        (0, True), (3, True), (6, False)
    ]  # fmt: skip
    assert len({m.seq for m in msgs}) == 1 and all(m.ts == 4 for m in msgs)
    np.testing.assert_array_equal(np.concatenate([m.payloads[0] for m in msgs]), grad)
    ident, seq = first[0][0], msgs[0].seq
    new = np.arange(100, 109, dtype=np.float32)
    reply(0, new[:3], seq, more=True, ident=ident)
    reply(3, new[3:6], seq, more=True, ident=ident)
    reply(6, new[6:], seq, ident=ident)  # the reply: what did not go ahead
    msg = ch.recv({Kind.WEIGHTS})
    assert msg.fields["at"] == 6 and ch._last is None
    np.testing.assert_array_equal(weights[:6], new[:6])  # the parts ahead, in place
    # a part ahead lost (a dropped connection): the reply says rejoin, a WELCOME brings all
    weights[:] = 0
    ch.send_parts(Kind.PUSHPULL, 5, parts, weights)
    seq = wire.decode([ours(server) for _ in parts][0][1:]).seq
    reply(3, new[3:6], seq, more=True, ident=ident)  # part 0 never came
    reply(6, new[6:], seq, ident=ident)
    with pytest.raises(ServerError, match="parts of its weights sent ahead of its reply were lost"):
        ch.recv({Kind.WEIGHTS})
    np.testing.assert_array_equal(weights[:3], 0)
    ch.close()
