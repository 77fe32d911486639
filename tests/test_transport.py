"""transport.Channel: a silent server is a TimeoutError naming it, never a hang."""
import time

import pytest
import zmq

from rudra_zmq import transport, wire
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(30)


def test_a_silent_server_is_a_timeout_error_naming_it(ctx):
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    ch = transport.Channel(ctx, f"tcp://127.0.0.1:{port}", 0, name="parameter server",
                           timeout_ms=200)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no reply from the parameter server at "
                                           rf"tcp://127.0.0.1:{port} within 0.2 s"):
        ch.request(Kind.PULL, 0, wait=False)
    assert time.monotonic() - t < 10  # bounded, not a hang (generous: the box is shared)
    ch.close()


def test_a_reply_is_validated_and_an_error_reply_raises_server_error(ctx):
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    ch = transport.Channel(ctx, f"tcp://127.0.0.1:{port}", 3, timeout_ms=5000)
    ch.send(Kind.PULL, 0, wait=False)
    ident, *_ = server.recv_multipart()
    server.send_multipart([ident, *wire.encode(Kind.UPTODATE, wire.SENDER_PS, 1, 0, 77)])
    assert ch.recv({Kind.UPTODATE}).kind == Kind.UPTODATE and ch.inc == 77
    ch.send(Kind.PULL, 0, wait=False)
    ident, *_ = server.recv_multipart()
    server.send_multipart([ident, *wire.encode(Kind.ERROR, wire.SENDER_PS, 2, 0, 77,
                                               code="protocol", error="nope")])
    with pytest.raises(transport.ServerError, match="refused the request: nope"):
        ch.recv({Kind.UPTODATE})
    ch.close()
