"""Liveness of connections (transport.set_heartbeat: TCP keepalive, not ZMTP heartbeats).

libzmq 4.3.5 aborts the process (``!_io_error``, stream_engine_base.cpp:310) when a ZMTP
heartbeat is due on a connection whose peer left while the socket's queue was full and unread
(zeromq/libzmq#4841): seen in CI as a whole ImageNet run dying at its start, and in a
restarted statistics server loading its data as the learners finished. Keepalive probes
are the kernel's, so that abort has no timer left to fire, and a vanished host is still found.
"""

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from netns_check import netns_missing
from rudra_zmq import transport, wire
from rudra_zmq.channel import Channel
from rudra_zmq.wire import Kind

SCENE = """
import sys, time, zmq
from rudra_zmq import transport
transport.set_heartbeat(1)
ctx = zmq.Context()
kind = getattr(zmq, sys.argv[1])
sock = transport.make_socket(ctx, kind, hwm=16)
ep = transport.bind(sock, "tcp://127.0.0.1:0")
for _ in range(int(sys.argv[2])):
    peer = zmq.Context()
    out = peer.socket(zmq.PUSH if kind == zmq.PULL else zmq.DEALER)
    out.setsockopt(zmq.SNDHWM, 100000)
    out.connect(ep)
    try:
        for i in range(20000):
            out.send(b"x" * 10000, zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(0.3)             # the socket's queue is full: libzmq stops reading the peer
    out.close(linger=0)
    peer.term()
    time.sleep(1.5)             # a heartbeat of 1 s would be due now, on a connection gone
    while sock.poll(0):
        sock.recv_multipart()
print("alive")
"""


@pytest.mark.parametrize("kind", ["ROUTER", "DEALER", "PULL"])
def test_a_peer_leaving_while_a_full_queue_is_unread_does_not_abort_the_process(kind):
    """The scene of the abort, with the sockets every role makes (transport.make_socket): with
    ZMTP heartbeats it aborted 6 times in 6 (2 tries of each kind) here, in its first round."""
    proc = subprocess.run(
        [sys.executable, "-c", SCENE, kind, "2"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stderr


def test_sockets_probe_with_tcp_keepalive_and_send_no_zmtp_heartbeats(ctx, monkeypatch):
    monkeypatch.setattr(transport, "_HEARTBEAT_S", 3)
    sock = transport.make_socket(ctx, zmq.DEALER)
    got = [sock.getsockopt(o) for o in (zmq.TCP_KEEPALIVE, zmq.TCP_KEEPALIVE_IDLE)]
    got += [sock.getsockopt(o) for o in (zmq.TCP_KEEPALIVE_INTVL, zmq.TCP_KEEPALIVE_CNT)]
    assert got == [1, 3, 3, transport.KEEPALIVE_PROBES]
    assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
    sock.close(0)
    transport.set_heartbeat(0)
    sock = transport.make_socket(ctx, zmq.DEALER)
    assert sock.getsockopt(zmq.TCP_KEEPALIVE) == -1  # the OS default: no probes
    sock.close(0)


@pytest.fixture
def far_host():
    """A network namespace behind a veth pair (10.231.<pid%250>.2, this side .1): a host whose
    cable the test can pull. Removed afterwards."""
    why = netns_missing()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 10000
    ns, near, far, net = f"rzka{tag}", f"rzka{tag}a", f"rzka{tag}b", f"10.231.{tag % 250}"

    def ip(*args, check=True):
        return subprocess.run(["ip", *args], check=check, capture_output=True)

    ip("netns", "del", ns, check=False)
    ip("link", "del", near, check=False)
    ip("netns", "add", ns)
    try:
        ip("link", "add", near, "type", "veth", "peer", "name", far)
        ip("link", "set", far, "netns", ns)
        ip("addr", "add", f"{net}.1/24", "dev", near)
        ip("link", "set", near, "up")
        ip("-n", ns, "addr", "add", f"{net}.2/24", "dev", far)
        ip("-n", ns, "link", "set", far, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, far, f"{net}.2"
    finally:
        ip("link", "del", near, check=False)
        ip("netns", "del", ns, check=False)


SERVER = """
import sys, zmq
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER)
r.bind(f"tcp://{sys.argv[1]}:5599")
print("bound", flush=True)
while True:
    f = r.recv_multipart()
    r.send_multipart(f)
"""


def _drop_seen(sock, within_s: float) -> bool:
    """Whether ``sock``'s monitor reports the connection dropped within ``within_s``."""
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        return bool(mon.poll(int(within_s * 1000))) and (
            recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        )
    finally:
        sock.disable_monitor()
        mon.close(0)


@pytest.mark.parametrize("probe_s", [1, 0])
def test_a_host_whose_cable_is_pulled_is_dropped_after_the_keepalive_probes(
    far_host, ctx, monkeypatch, probe_s
):
    """An idle connection to a host that went silent (link down, no FIN, no RST) is dropped by
    the kernel after ``heartbeat_s`` idle + 5 probes (1 s: ~6 s); with probing off (0) it
    stays for as long as the test looks (9 s)."""
    ns, far, addr = far_host
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, addr],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "bound"
        monkeypatch.setattr(transport, "_HEARTBEAT_S", probe_s)
        sock = transport.make_socket(ctx, zmq.DEALER, rcvtimeo=10_000)
        sock.connect(f"tcp://{addr}:5599")
        sock.send(b"ping")
        assert sock.recv() == b"ping"  # connected, then idle
        time.sleep(0.2)
        subprocess.run(["ip", "-n", ns, "link", "set", far, "down"], check=True)
        dropped = _drop_seen(sock, 9.0)
        sock.close(0)
        assert dropped == bool(probe_s)
    finally:
        server.kill()
        server.wait()


def test_a_server_that_answers_nothing_is_said_silent_after_two_checks_then_answering(caplog):
    """A stopped or hung server (its kernel still answers keepalive) answers neither the
    request nor the CHECKs: the channel says so (a notice, on the terminal under `run`) once
    two CHECKs sent runtime.retry_s apart went unanswered -- the CHECKs the server received
    are the clock, long before runtime.timeout_s (100 retries here) -- waits on, and says
    when the server answers again."""
    ctx = zmq.Context()
    router = transport.make_socket(ctx, zmq.ROUTER)
    endpoint = transport.bind(router, "tcp://127.0.0.1:0")
    ch = Channel(ctx, endpoint, 0, name="parameter server", timeout_ms=20_000, retry_ms=200)
    got, failed = [], []

    def ask():
        try:
            got.append(ch.request(Kind.PULL))
        except Exception as exc:  # noqa: BLE001 -- the test says what went wrong
            failed.append(exc)

    def said(text):
        return [r.getMessage() for r in caplog.records if text in r.getMessage()]

    t = threading.Thread(target=ask, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="rudra_zmq.channel"):
            t.start()
            heard, deadline = [], time.monotonic() + 15  # a bound against hanging only
            while not said("answered nothing"):
                assert not failed and time.monotonic() < deadline, (failed, heard)
                if router.poll(20):
                    heard.append(router.recv_multipart())
            while router.poll(0):
                heard.append(router.recv_multipart())
            request = wire.decode(heard[0][1:])
            checks = [m for m in heard[1:] if wire.decode(m[1:]).kind == Kind.CHECK]
            assert request.kind == Kind.PULL and all(c[0] == heard[0][0] for c in checks)
            # said as the third CHECK goes out (two unanswered before it), not after 100
            assert len(checks) in (2, 3), len(checks)
            assert not failed and not got  # it waits on
            router.send_multipart(
                [heard[0][0], *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, re=request.seq)]
            )
            t.join(15)
        assert got and got[0].kind == Kind.UPTODATE and not failed
        notices = [r.getMessage() for r in caplog.records if r.name == "rudra_zmq.channel"]
        assert len(notices) == 2, notices
        assert "[notice]" in notices[0] and "a request and 2 CHECKs" in notices[0]
        assert "answers again" in notices[1]
    finally:
        t.join(25)  # a request never answered ends at its timeout (20 s): then close
        ch.close()
        router.close(linger=0)
        ctx.term()
