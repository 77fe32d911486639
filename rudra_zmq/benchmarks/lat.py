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
from . import common, sides

TRANSPORTS, MODES = common.TRANSPORTS, common.MODES
ECHO_IDLE_MS = 10_000     # an echo loop with no message this long: the measuring side left


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
            except zmq.Again:   # the measuring side went away: back to the control loop
                pass
            finally:
                sides.close_bound(sock, endpoint)
        return {"endpoint": endpoint}, serve

    return {"echo": echo}


# ----------------------------------------------------------------------------- measuring side
def trips(req, buf, copy: bool, count: int, out: list | None = None) -> float:
    """``count`` round trips of ``buf``; appends each one's seconds to ``out``; returns the
    total seconds."""
    size = len(buf)
    perf = time.perf_counter
    t_start = perf()
    for _ in range(count):
        t0 = perf()
        req.send(buf, copy=copy)
        try:
            reply = req.recv(copy=copy)
        except zmq.Again:   # seen under heavy load, cause not found yet: fail, never hang
            raise RuntimeError(f"no echo of {size} B within {req.RCVTIMEO / 1e3:g} s; the "
                               "other side's echo loop ended") from None
        if out is not None:
            out.append(perf() - t0)
        if len(reply) != size:
            raise RuntimeError(f"echo returned {len(reply)} bytes, sent {size}")
    return perf() - t_start


def run_mode(ctl: sides.Control, ctx, kind: str, mode: str, sizes, args):
    """Every size of one transport and mode on one REQ socket; yields one record per size."""
    copy = mode == "copy"
    ep = ctl.reachable(ctl.request("echo", transport=kind, copy=copy)["endpoint"])
    req = transport.make_socket(ctx, zmq.REQ, rcvtimeo=3 * ECHO_IDLE_MS)
    req.connect(ep)
    try:
        for size in sizes:
            buf = np.full(size, 0x5A, np.uint8)
            per = common.warm_up(lambda: trips(req, buf, copy, 10), args.warmup) / 10
            count = common.op_count(args, per)
            samples, averages = [], []
            for _ in range(args.repeat):
                averages.append(trips(req, buf, copy, count, samples) / (2 * count) * 1e6)
            one_way = common.summary(np.asarray(samples) / 2 * 1e6)
            lo, med, hi = common.mmm(averages)
            yield {"bench": "lat", "label": f"{kind} {mode}", "transport": kind, "mode": mode,
                   "size": size, "count": count, "bytes": size * count, "repeat": args.repeat,
                   "latency_us": med, "latency_min_us": lo, "latency_max_us": hi,
                   "p50_us": one_way["p50"], "p99_us": one_way["p99"],
                   "mb_per_s": size / med}                     # bytes per µs = MB/s one way
    finally:
        try:    # end the echo loop (an empty message); REQ can send only after a reply
            req.send(b"", zmq.NOBLOCK)
            req.poll(ECHO_IDLE_MS)
        except zmq.ZMQError:
            pass
        req.close(linger=0)


def line(r: dict) -> str:
    return (f"lat {r['transport']:<6} {r['mode']:<8} message size: {r['size']} [B] "
            f"roundtrip count: {r['count']} average latency: {r['latency_us']:.3f} [us]  "
            f"(one way; p50 {r['p50_us']:.1f} p99 {r['p99_us']:.1f} µs; min "
            f"{r['latency_min_us']:.1f} max {r['latency_max_us']:.1f} of {r['repeat']})")


def add_arguments(p) -> None:
    common.add_transport_sweep_args(p, "binds a REP socket and echoes")


def run(args) -> int:
    def cases(ctl, ctx, kind, mode, sizes):
        return run_mode(ctl, ctx, kind, mode, sizes, args)

    return common.run_transport_sweep(
        args, "lat", handlers, "bench lat (ZeroMQ REQ <-> REP latency)",
        "libzmq local_lat figure: average latency = round-trip time / 2 (one way), µs",
        ("size", [("latency_us", "one-way latency (µs)"), ("mb_per_s", "MB/s one way")],
         "label"), cases, line)
