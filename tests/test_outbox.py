"""A socket is never closed with a message half-sent by a finite linger (rudra_zmq/outbox.py):
the libzmq 4.3.5 abort at session_base.cpp:233 needs exactly that (docs/wire.md, "Half-sent
messages"). The stress counts are tests/half_sent.py's."""

import threading

import numpy as np
import pytest
import zmq

from rudra_zmq import outbox, transport, wire
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(60)
NUMEL = 16 << 20  # 64 MiB of float32: far more than loopback's socket buffers hold
CHUNK = 4 << 20  # bytes per payload frame


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def ended(ctx, seconds=20.0) -> bool:
    """Whether ``ctx.term()`` returns within ``seconds`` (it runs in a thread of its own)."""
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def push(numel=NUMEL):
    grad = np.ones(numel, np.float32)
    return wire.encode(Kind.PUSH, 0, 1, 0, 0, wire.chunk(grad, CHUNK))


def stalled_server(ctx):
    """A ROUTER with a one-message queue that reads nothing."""
    server = transport.make_socket(ctx, zmq.ROUTER, hwm=1, max_bytes=transport.frame_limit(CHUNK))
    return server, transport.bind(server, "tcp://127.0.0.1:0")


def test_a_header_and_one_payload_frame_are_not_tracked_libzmq_takes_them_whole(ctx):
    server, endpoint = stalled_server(ctx)
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=4)
    sock.connect(endpoint)
    out = outbox.Outbox(sock)
    out.send(wire.encode(Kind.PUSH, 0, 1, 0, 0, [np.ones(1000, np.float32)]))
    assert out.pending() == 0
    assert out.close(transport.LINGER_MS)
    server.close(linger=0)


def test_a_model_in_chunks_that_its_peer_does_not_read_is_never_dropped_half_sent(ctx):
    server_ctx = zmq.Context()  # the server's own I/O thread, as in another process
    server, endpoint = stalled_server(server_ctx)
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=8)
    sock.connect(endpoint)
    out = outbox.Outbox(sock)
    for _ in range(4):  # fill its queue (a pipe holds a message or two beyond the HWM)
        out.send(wire.encode(Kind.HELLO, 0, 0, 0, 0, model="m", numel=NUMEL))
    assert server.poll(5000)
    out.send(push())
    assert out.pending() == 1
    before = outbox.held()
    # the push stays half-sent (its first frames taken, the rest not): an infinite linger
    assert not out.close(transport.LINGER_MS)
    assert outbox.held() == before + 1 and sock.closed
    server.close(linger=0)  # the connection ends: libzmq reads the rest out of the pipe
    assert ended(server_ctx)
    assert ended(ctx), "the closed socket kept its context waiting after its peer went"


def test_a_client_whose_connection_is_down_drops_its_whole_messages_with_the_finite_linger(ctx):
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=4)
    sock.connect("tcp://127.0.0.1:1")  # nothing listens: no connection takes anything
    out = outbox.Outbox(sock)
    out.send(push(2 << 20))  # two payload frames
    before = outbox.held()
    assert out.pending() == 1
    assert out.close(50, connected=False)
    assert outbox.held() == before
    assert ended(ctx, 5.0)


def test_a_message_its_peer_read_is_no_longer_tracked(ctx):
    server = transport.make_socket(ctx, zmq.ROUTER, hwm=4, max_bytes=transport.frame_limit(CHUNK))
    endpoint = transport.bind(server, "tcp://127.0.0.1:0")
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=4)
    sock.connect(endpoint)
    out = outbox.Outbox(sock)
    frames = push(4 << 20)
    out.send(frames)
    server.setsockopt(zmq.RCVTIMEO, 10_000)
    assert len(server.recv_multipart(copy=False)) == 1 + len(frames)
    assert out.close(10_000)  # waits for the last frame's release, then a finite linger
    assert out.pending() == 0
    server.close(linger=0)
