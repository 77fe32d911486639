"""A model-sized message half-sent when its connection ends, with the sockets of transport.py:
the case in which libzmq 4.3.5 aborts the whole process with "Resource temporarily unavailable
(src/session_base.cpp:233)" (docs/wire.md, "Half-sent messages").

Run as ``python tests/half_sent.py MODE [ROUNDS [SEED [CHUNK_MIB]]]``; prints ``survived`` and
exits 0 unless libzmq aborts it (``round N`` before each round: the last printed aborted). A
learner's ``Channel`` pushes a 200 MiB gradient (``wire.chunk`` into ``CHUNK_MIB`` frames, as
``learner/exchange.py`` does with ``runtime.chunk_mib``) to a PS-like ROUTER that has stopped
reading (its one-message queue is full), so the push stays half-sent. Then:

- ``close``: the ROUTER closes and the channel closes right after (``Channel.close``), as
  when a run ends. With linger 0 the channel's socket drops the half-sent message at once and
  the connection's end, microseconds later, aborted the process (9 of 12 tries of 100
  rounds); with ``transport.LINGER_MS`` the end comes while the message is still being sent.
- ``disconnect``: the channel's socket lets go of the connection (``zmq_disconnect``, which no
  role calls), then the ROUTER closes: the socket acknowledges its pipe's end only when it is
  used again, so the window stays open and libzmq aborts every time, whatever the linger.
  The libzmq bug itself, deterministically.
- ``expired``: the channel closes first (``Channel.close``, linger ``transport.LINGER_MS``)
  while the ROUTER still reads nothing, and the ROUTER closes around the moment the linger
  runs out (``LINGER_MS`` +- ``JITTER_S``, seeded): a server that goes just after a learner
  gave up on it. Aborted 7 of 10 tries of 50 rounds before ``outbox`` (the channel's socket
  closed with that linger, the push half-sent); since, the channel closes a push its server
  has not read with an infinite linger, and none aborted (docs/wire.md).
"""

import random
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rudra_zmq import transport, wire  # noqa: E402
from rudra_zmq.channel import Channel  # noqa: E402
from rudra_zmq.wire import Kind  # noqa: E402

NUMEL = 50 << 20  # 200 MiB of float32, ImageNet-sized
CHUNK_MIB = 8  # runtime.chunk_mib's default
SETTLE_S = 0.5  # for the I/O thread to fill the kernel's buffers and stall
JITTER_S = 0.002  # ``expired``: the ROUTER closes this near the end of the channel's linger
MODES = ("disconnect", "close", "expired")


def round_(ctx, server_ctx, grad, mode: str, rng: random.Random, chunk: int) -> None:
    """One push left half-sent, then the end of its connection (see the module docstring)."""
    ps = transport.make_socket(
        server_ctx, zmq.ROUTER, hwm=1, max_bytes=transport.frame_limit(4 * NUMEL)
    )
    endpoint = transport.bind(ps, "tcp://127.0.0.1:0")
    ch = Channel(
        ctx,
        endpoint,
        0,
        name="ps",
        timeout_ms=5_000,
        hwm=4,
        max_bytes=transport.frame_limit(4 * NUMEL),
    )
    ch.send(Kind.HELLO, model="m", numel=NUMEL)  # fills the ROUTER's queue of one message
    if not ps.poll(5_000):
        raise SystemExit("the ROUTER never got the HELLO")
    ch.send(Kind.PUSH, 0, wire.chunk(grad, chunk))
    time.sleep(SETTLE_S if mode == "disconnect" else 0.05)
    if mode == "disconnect":
        ch.sock.disconnect(endpoint)
        time.sleep(2 * transport.LINGER_MS / 1000)
        ps.close(linger=0)
        time.sleep(SETTLE_S)  # the channel's engine sees the connection end meanwhile
        ch.close()
    elif mode == "expired":
        ch.close()
        time.sleep(max(0.0, transport.LINGER_MS / 1000 + rng.uniform(-JITTER_S, JITTER_S)))
        ps.close(linger=0)
    else:
        ps.close(linger=0)
        ch.close()


def main() -> None:
    mode = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if mode not in MODES:
        raise SystemExit(f"mode {mode!r}: use one of {', '.join(MODES)}")
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    chunk = int(sys.argv[4] if len(sys.argv) > 4 else CHUNK_MIB) << 20
    transport.set_heartbeat(2.0)
    grad = np.ones(NUMEL, np.float32)
    ctx = zmq.Context()
    # ``expired``: the server's own context (I/O thread), as in another process, so that the
    # connection's end can come while the channel's I/O thread is between two commands
    server_ctx = zmq.Context() if mode == "expired" else ctx
    for n in range(rounds):
        print("round", n, flush=True)  # the last one printed is the one that aborted
        round_(ctx, server_ctx, grad, mode, rng, chunk)
    ctx.term()
    if server_ctx is not ctx:
        server_ctx.term()
    print("survived", rounds, flush=True)


if __name__ == "__main__":
    main()
