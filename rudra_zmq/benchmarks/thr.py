"""``rudra-zmq bench thr``: raw ZeroMQ throughput, like libzmq's ``local_thr``/``remote_thr``.

The passive side (``--bind``, libzmq's ``local_thr``) binds a PULL socket per case and
measures; the measuring side (``--connect``, ``remote_thr``) connects a PUSH socket and sends
``count`` messages of ``size`` bytes, then prints libzmq's figures::

    message size: 1048576 [B]  message count: 3000  mean throughput: 5123 [msg/s]
    mean throughput: 42977.226 [Mb/s]

computed as libzmq does (the clock starts at the first message received; msg/s = count /
elapsed; Mb/s = msg/s x size x 8 / 10^6), so figures compare directly with a C run of
``local_thr``. Cases: every transport (tcp, ipc, inproc) x mode (``copy``: ``send/recv(copy=
True)``; ``zerocopy``: ``copy=False`` both ways — pyzmq copies frames under 64 KiB anyway,
``zmq.COPY_THRESHOLD``) x size. inproc runs both sides in this process, as threads sharing the
GIL: it measures pyzmq's per-message cost more than libzmq's. Each case: a probe, a warm-up,
a count calibrated to ``--seconds``, ``--repeat`` runs (min / median / max). The high-water
mark is libzmq's default 1000 messages, lowered for large messages so that at most ~256 MiB
are queued.

    rudra-zmq bench thr                                   # tcp, ipc, inproc; 64 B .. 4 MiB
    host-a$ rudra-zmq bench thr --bind tcp://0.0.0.0:5555
    host-b$ rudra-zmq bench thr --connect tcp://host-a:5555 -b 1Ki -e 64Mi -f 4
"""

from __future__ import annotations

import time

import numpy as np
import zmq

from .. import transport
from . import common, sides, transport_sweep

TRANSPORTS, MODES = transport_sweep.TRANSPORTS, transport_sweep.MODES
QUEUE_BYTES = 256 << 20  # cap on queued bytes per socket (HWM = this / size, at most 1000)
MAX_HWM = 1000  # libzmq's default


def hwm_for(size: int) -> int:
    return int(max(2, min(MAX_HWM, QUEUE_BYTES // size)))


# ----------------------------------------------------------------------------- passive side
def handlers(ctx: zmq.Context, agent: sides.Agent) -> dict:
    """open (bind a PULL), recv (receive ``count`` messages and time them), close."""
    state = {}

    def open_(req):
        sock = transport.make_socket(
            ctx, zmq.PULL, hwm=req["hwm"], rcvtimeo=int(sides.CONTROL_TIMEOUT_S * 1000)
        )
        endpoint = transport.bind(sock, agent.data_endpoint(req["transport"]))
        state.update(sock=sock, copy=req["copy"], endpoint=endpoint)
        return {"endpoint": endpoint}

    def recv(req):
        sock, copy, count = state["sock"], state["copy"], req["count"]
        nbytes = len(sock.recv(copy=copy))
        t0 = time.perf_counter()
        for _ in range(count - 1):
            nbytes += len(sock.recv(copy=copy))
        return {"elapsed_s": time.perf_counter() - t0, "count": count, "bytes": nbytes}

    def close(req):
        sides.close_bound(state.pop("sock"), state["endpoint"])
        return {}

    return {"open": open_, "recv": recv, "close": close}


# ----------------------------------------------------------------------------- measuring side
def run_case(ctl: sides.Control, ctx, kind: str, mode: str, size: int, args) -> dict:
    copy = mode == "copy"
    hwm = hwm_for(size)
    ep = ctl.reachable(ctl.request("open", transport=kind, copy=copy, hwm=hwm)["endpoint"])
    push = transport.make_socket(ctx, zmq.PUSH, hwm=hwm)
    push.connect(ep)
    buf = np.full(size, 0x5A, np.uint8)

    def burst(count):
        ctl.send("recv", count=count)
        for _ in range(count):
            push.send(buf, copy=copy)
        r = ctl.recv()
        if r["bytes"] != size * count:
            raise RuntimeError(f"received {r['bytes']:,} bytes, expected {size * count:,}")
        return r

    try:
        r = burst(int(min(1000, max(10, (1 << 20) // size))))  # probe (includes connecting)
        per = r["elapsed_s"] / r["count"]
        r = burst(common.calibrate(per, args.warmup, lo=10))
        count = transport_sweep.op_count(args, r["elapsed_s"] / r["count"])
        runs = [burst(count) for _ in range(args.repeat)]
    finally:
        push.close(linger=0)
        ctl.request("close")
    rates = [count / r["elapsed_s"] for r in runs]  # libzmq: count / elapsed
    mbit = [x * size * 8 / 1e6 for x in rates]
    lo, med, hi = common.mmm(mbit)
    msgs = float(np.median(rates))
    return {
        "bench": "thr",
        "label": f"{kind} {mode}",
        "transport": kind,
        "mode": mode,
        "size": size,
        "count": count,
        "bytes": runs[0]["bytes"],
        "repeat": args.repeat,
        "msg_per_s": msgs,
        "mbit_per_s": med,
        "mbit_min": lo,
        "mbit_max": hi,
        "us_per_msg": 1e6 / msgs,
    }


def line(r: dict) -> str:
    return (
        f"thr {r['transport']:<6} {r['mode']:<8} message size: {r['size']} [B] "
        f"message count: {r['count']} mean throughput: {r['msg_per_s']:.0f} [msg/s] "
        f"mean throughput: {r['mbit_per_s']:.3f} [Mb/s]  (min {r['mbit_min']:.1f} max "
        f"{r['mbit_max']:.1f} Mb/s of {r['repeat']}; {r['us_per_msg']:.2f} µs/msg)"
    )


def add_arguments(p) -> None:
    transport_sweep.add_transport_sweep_args(
        p, "binds a PULL socket per case and times what arrives"
    )


def run(args) -> int:
    def cases(ctl, ctx, kind, mode, sizes):
        return (run_case(ctl, ctx, kind, mode, size, args) for size in sizes)

    return transport_sweep.run_transport_sweep(
        args,
        "thr",
        handlers,
        "bench thr (ZeroMQ PUSH -> PULL throughput)",
        "libzmq local_thr figures: msg/s = count / time from the first to the last message; "
        "Mb/s = msg/s x size x 8 / 1e6",
        ("size", [("mbit_per_s", "throughput (Mb/s)"), ("us_per_msg", "µs per message")], "label"),
        cases,
        line,
    )
