"""``rudra-zmq bench lat``: raw ZeroMQ latency, like libzmq's ``local_lat``/``remote_lat``.

The passive side (``--bind``, libzmq's ``local_lat``) binds a REP socket per transport and
mode and echoes every message; the measuring side (``--connect``, ``remote_lat``) connects a
REQ socket, sends ``count`` messages of ``size`` bytes one at a time and prints libzmq's
figure, the average one-way latency (round-trip time / 2)::

    message size: 64 [B]  roundtrip count: 20000  average latency: 27.123 [us]

plus the p50/p99 of single round trips (also halved) and min/median/max of the average over
``--repeat`` runs. Modes: ``copy`` (``copy=True`` both ways) and ``zerocopy`` (``copy=False``;
the echo sends the received frame back without copying; pyzmq copies frames under 64 KiB
anyway). An empty message ends a case (sizes are >= 1 byte). inproc runs both sides in this
process as threads (they share the GIL).

    rudra-zmq bench lat                                   # tcp, ipc, inproc; 64 B .. 4 MiB
    host-a$ rudra-zmq bench lat --bind tcp://0.0.0.0:5555
    host-b$ rudra-zmq bench lat --connect tcp://host-a:5555 --sizes 64 1Ki 64Ki 1Mi
"""

from __future__ import annotations

import time

import numpy as np
import zmq

from .. import transport
from . import common, sides, transport_sweep

TRANSPORTS, MODES = transport_sweep.TRANSPORTS, transport_sweep.MODES
ECHO_IDLE_MS = 10_000  # an echo loop with no message this long: the measuring side left
RESEND_MS = 1000  # a round trip unanswered this long is sent again (and counted)
GIVE_UP_S = 30.0  # ... and one unanswered this long is an error


# ----------------------------------------------------------------------------- passive side
def handlers(ctx: zmq.Context, agent: sides.Agent) -> dict:
    """echo: bind a REP socket, hand out its endpoint, then echo until an empty message."""

    def echo(req):
        copy = req["copy"]
        # a quiet echo socket ends the loop: the measuring side's closing empty message can be
        # lost (it closes with linger 0), and the agent must not stay deaf to the next run
        sock = transport.make_socket(ctx, zmq.REP, rcvtimeo=ECHO_IDLE_MS)
        endpoint = transport.bind(sock, agent.data_endpoint(req["transport"]))

        def serve():
            try:
                while True:
                    msg = sock.recv(copy=copy)
                    sock.send(msg, copy=copy)
                    if len(msg) == 0:
                        break
            except zmq.Again:  # the measuring side went away: back to the control loop
                pass
            finally:
                sides.close_bound(sock, endpoint)

        return {"endpoint": endpoint}, serve

    return {"echo": echo}


# ----------------------------------------------------------------------------- measuring side
def trips(req, buf, copy: bool, count: int, out: list | None = None) -> tuple[float, int]:
    """``count`` round trips of ``buf``; appends each one's seconds to ``out``. Returns (total
    seconds, round trips resent): a request unanswered for RESEND_MS is sent again (the ZeroMQ
    guide's Lazy Pirate; ``req`` is REQ_RELAXED + REQ_CORRELATE, so a late reply is dropped),
    and its trip is left out of ``out``. Raises RuntimeError after GIVE_UP_S without a reply.
    (On a loaded 2-core box an echo loop once saw no request for 10 s mid-stream.)"""
    size, lost = len(buf), 0
    perf = time.perf_counter
    t_start = perf()
    for _ in range(count):
        t0 = perf()
        req.send(buf, copy=copy)
        resent = False
        while True:
            try:
                reply = req.recv(copy=copy)
                break
            except zmq.Again:  # a late or lost round trip: ask again rather than hang
                if perf() - t0 > GIVE_UP_S:
                    raise RuntimeError(f"no echo of {size} B within {GIVE_UP_S:g} s") from None
                lost, resent = lost + 1, True
                req.send(buf, copy=copy)
        if out is not None and not resent:
            out.append(perf() - t0)
        if len(reply) != size:
            raise RuntimeError(f"echo returned {len(reply)} bytes, sent {size}")
    return perf() - t_start, lost


def run_mode(ctl: sides.Control, ctx, kind: str, mode: str, sizes, args):
    """Every size of one transport and mode on one REQ socket; yields one record per size."""
    copy = mode == "copy"
    ep = ctl.reachable(ctl.request("echo", transport=kind, copy=copy)["endpoint"])
    req = transport.make_socket(ctx, zmq.REQ, rcvtimeo=RESEND_MS)
    req.setsockopt(zmq.REQ_RELAXED, 1)
    req.setsockopt(zmq.REQ_CORRELATE, 1)
    req.connect(ep)
    try:
        for size in sizes:
            buf = np.full(size, 0x5A, np.uint8)
            warm_lost = [0]

            def warm(buf=buf, warm_lost=warm_lost):  # this size's buffer and count
                warm_lost[0] += trips(req, buf, copy, 10)[1]

            per = common.warm_up(warm, args.warmup) / 10
            count = transport_sweep.op_count(args, per)
            samples, averages, lost = [], [], warm_lost[0]
            for _ in range(args.repeat):
                seconds, k = trips(req, buf, copy, count, samples)
                averages.append(seconds / (2 * count) * 1e6)
                lost += k
            one_way = common.summary(np.asarray(samples) / 2 * 1e6)
            lo, med, hi = common.mmm(averages)
            yield {
                "bench": "lat",
                "label": f"{kind} {mode}",
                "transport": kind,
                "mode": mode,
                "size": size,
                "count": count,
                "bytes": size * count,
                "repeat": args.repeat,
                "latency_us": med,
                "latency_min_us": lo,
                "latency_max_us": hi,
                "p50_us": one_way["p50"],
                "p99_us": one_way["p99"],
                "mb_per_s": size / med,  # bytes per µs = MB/s one way
                "resent": lost,
            }
    finally:
        try:  # end the echo loop (an empty message); REQ can send only after a reply
            req.send(b"", zmq.NOBLOCK)
            req.poll(ECHO_IDLE_MS)
        except zmq.ZMQError:
            pass
        req.close(linger=0)


def line(r: dict) -> str:
    return (
        f"lat {r['transport']:<6} {r['mode']:<8} message size: {r['size']} [B] "
        f"roundtrip count: {r['count']} average latency: {r['latency_us']:.3f} [us]  "
        f"(one way; p50 {r['p50_us']:.1f} p99 {r['p99_us']:.1f} µs; min "
        f"{r['latency_min_us']:.1f} max {r['latency_max_us']:.1f} of {r['repeat']})"
        + (
            f"  RESENT {r['resent']} round trips unanswered after {RESEND_MS} ms (their "
            "wait is in the average)"
            if r["resent"]
            else ""
        )
    )


def add_arguments(p) -> None:
    transport_sweep.add_transport_sweep_args(p, "binds a REP socket and echoes")


def run(args) -> int:
    def cases(ctl, ctx, kind, mode, sizes):
        return run_mode(ctl, ctx, kind, mode, sizes, args)

    return transport_sweep.run_transport_sweep(
        args,
        "lat",
        handlers,
        "bench lat (ZeroMQ REQ <-> REP latency)",
        "libzmq local_lat figure: average latency = round-trip time / 2 (one way), µs",
        ("size", [("latency_us", "one-way latency (µs)"), ("mb_per_s", "MB/s one way")], "label"),
        cases,
        line,
    )
