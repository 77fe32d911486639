"""A model-sized message half-sent when its connection ends, with the sockets of transport.py:
the case in which libzmq 4.3.5 aborts the whole process with "Resource temporarily unavailable
(src/session_base.cpp:233)" (docs/wire.md, "Half-sent messages").

Run as ``python tests/half_sent.py MODE [ROUNDS]``; prints ``survived`` and exits 0 unless
libzmq aborts it. A learner's ``Channel`` pushes a 200 MiB gradient (``wire.chunk`` into
``runtime.chunk_mib`` frames, as ``learner/exchange.py`` does) to a PS-like ROUTER that has stopped
reading (its one-message queue is full), so the push stays half-sent. Then:

- ``close``: the ROUTER closes and the channel closes right after (``Channel.close``), as
  when a run ends. With linger 0 the channel's socket drops the half-sent message at once and
  the connection's end, microseconds later, aborted the process (9 of 12 tries of 100
  rounds); with ``transport.LINGER_MS`` the end comes while the message is still being sent.
- ``disconnect``: the channel's socket lets go of the connection (``zmq_disconnect``, which no
  role calls), then the ROUTER closes: the socket acknowledges its pipe's end only when it is
  used again, so the window stays open and libzmq aborts every time, whatever the linger.
  The libzmq bug itself, deterministically.
"""

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
CHUNK = 8 << 20  # runtime.chunk_mib's default
SETTLE_S = 0.5  # for the I/O thread to fill the kernel's buffers and stall


def round_(ctx, grad, mode: str) -> None:
    """One push left half-sent, then the end of its connection (see the module docstring)."""
    ps = transport.make_socket(ctx, zmq.ROUTER, hwm=1, max_bytes=transport.frame_limit(4 * NUMEL))
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
    ch.send(Kind.PUSH, 0, wire.chunk(grad, CHUNK))
    time.sleep(SETTLE_S if mode == "disconnect" else 0.05)
    if mode == "disconnect":
        ch.sock.disconnect(endpoint)
        time.sleep(2 * transport.LINGER_MS / 1000)
        ps.close(linger=0)
        time.sleep(SETTLE_S)  # the channel's engine sees the connection end meanwhile
        ch.close()
    else:
        ps.close(linger=0)
        ch.close()


def main() -> None:
    mode = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    if mode not in ("disconnect", "close"):
        raise SystemExit(f"mode {mode!r}: use disconnect or close")
    transport.set_heartbeat(2.0)
    grad = np.ones(NUMEL, np.float32)
    ctx = zmq.Context()
    for _ in range(rounds):
        round_(ctx, grad, mode)
    ctx.term()
    print("survived", rounds, flush=True)


if __name__ == "__main__":
    main()
