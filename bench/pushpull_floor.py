"""Floors for one learner's push+pull: what the best possible PS could reach on this machine.

Issue #3 asks for the PS round trip (push a gradient, get the updated weights) to be at most
1.15x a raw ZeroMQ round trip of the same bytes over tcp loopback. This script times minimal
servers that do only what any PS must, with nothing of rudra_zmq's protocol, so their ratio to
the raw trip is a lower bound for any implementation:

- ``raw``: the baseline. The client sends the N-byte gradient zero-copy (frames of at most
  8 MiB, the PS's ``runtime.chunk_mib``) behind a 17-byte struct header; the server answers
  with N bytes of a preallocated buffer, zero-copy.
- ``kernel``: the same messages, and the server runs the fused momentum update (the PS's
  Cython kernel, one thread, out-of-place into the other of two buffers) on the received
  gradient before it answers with the new weights. No msgpack, no validation, no engine: a
  header parsed by ``struct`` and the kernel.
- ``raw xK`` / ``kernel xK`` (cut-through): the gradient goes as K messages of N/K bytes; the
  server updates and answers each part as soon as it arrives, so the update of part k overlaps
  the transfer of parts k+1.. in both directions. The client sends all K, then receives K.

Cases of one size are timed round-robin in short blocks so that load from other users hits
all alike; the figure is the median trip. Both processes call ``transport.tune_malloc()``.

    python bench/pushpull_floor.py                       # 90K and 10M, ~1 minute
    python bench/pushpull_floor.py --sizes 1M --parts 4 8 --seconds 4
"""
import argparse
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

import numpy as np
import zmq

from rudra_zmq import kernels, transport

HDR = struct.Struct("<BQQ")       # op (0 raw, 1 kernel, 2 stop, 3 held), lo, hi (floats)
FRAME_BYTES = 8 << 20             # runtime.chunk_mib = 8
RAW, KERNEL, STOP, HELD = 0, 1, 2, 3


def frames_of(a):
    """Zero-copy views of float32 array ``a`` of at most FRAME_BYTES each."""
    step = FRAME_BYTES // 4
    return [a[i:i + step] for i in range(0, a.shape[0], step)] or [a]


def server(conn, n):
    transport.tune_malloc()
    kernels.set_num_threads(1)
    ctx = zmq.Context(io_threads=1)
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=1000)
    conn.send(transport.bind(sock, "tcp://127.0.0.1:0"))
    w = [np.ones(n, np.float32), np.ones(n, np.float32)]
    v = np.zeros(n, np.float32)
    cur = 0
    held = []
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            op, lo, hi = HDR.unpack(frames[1].bytes)
            if op == STOP:
                return
            if op == HELD:
                # store-and-forward: keep the parts until the last, then update and answer
                # each part in turn (the reply of part k travels while part k+1 is updated)
                held.append((frames, lo))
                if hi < n:
                    continue
                out = w[1 - cur]
                for fr, off in held:
                    lo2 = off
                    for f in fr[2:]:
                        g = np.frombuffer(f.buffer, np.float32)
                        k = g.shape[0]
                        kernels.sgd_momentum_step(w[cur][off:off + k], v[off:off + k], g, 0.01,
                                                  0.9, 0.004, 1.0, False, out=out[off:off + k])
                        off += k
                    sock.send_multipart([fr[0], fr[1], *frames_of(out[lo2:off])], copy=False)
                held = []
                cur = 1 - cur
                continue
            if op == KERNEL:
                out, off = w[1 - cur], lo
                for f in frames[2:]:
                    g = np.frombuffer(f.buffer, np.float32)
                    k = g.shape[0]
                    kernels.sgd_momentum_step(w[cur][off:off + k], v[off:off + k], g, 0.01, 0.9,
                                              0.004, 1.0, False, out=out[off:off + k])
                    off += k
                reply = out[lo:hi]
                if hi == n:
                    cur = 1 - cur
            else:
                reply = w[cur][lo:hi]
            sock.send_multipart([frames[0], frames[1], *frames_of(reply)], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


_last = []


def trip(sock, g, op, parts):
    """One push+pull: ``parts`` messages out, ``parts`` replies in. Returns seconds."""
    n = g.shape[0]
    bounds = [(n * i // parts, n * (i + 1) // parts) for i in range(parts)]
    t = time.perf_counter()
    for lo, hi in bounds:
        sock.send_multipart([HDR.pack(op, lo, hi), *frames_of(g[lo:hi])], copy=False)
    got = 0
    held = []
    for _ in bounds:
        held.append(sock.recv_multipart(copy=False))
        for f in held[-1][1:]:
            got += len(f.buffer)
    dt = time.perf_counter() - t
    _last[:] = held   # held until the next trip, as a learner holds its reply
    assert got == 4 * n, (got, n)
    return dt


def measure(n, parts_list, seconds, block_s=0.05):
    """Median trip per case, round-robin in blocks. Returns {case: (median_s, trips)}."""
    here, there = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=server, args=(there, n), daemon=True)
    proc.start()
    ctx = zmq.Context(io_threads=1)
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=1000)
    sock.connect(here.recv())
    g = np.full(n, 1e-3, np.float32)
    cases = [(op, p) for p in parts_list for op in ((RAW, KERNEL) if p == 1 else (RAW, KERNEL, HELD))]
    times = {c: [] for c in cases}
    try:
        for c in cases:                                  # warm-up
            for _ in range(5):
                trip(sock, g, *c)
        end = time.monotonic() + seconds * len(cases)
        while time.monotonic() < end:
            for c in cases:
                t_block = time.monotonic() + block_s
                times[c].append(trip(sock, g, *c))
                while time.monotonic() < t_block:
                    times[c].append(trip(sock, g, *c))
        sock.send_multipart([HDR.pack(STOP, 0, 0)])
        proc.join(10)
    finally:
        sock.close(linger=0)
        ctx.term()
        if proc.is_alive():
            proc.kill()
    return {c: (statistics.median(ts), len(ts)) for c, ts in times.items()}


def parse_size(s):
    mult = {"K": 10**3, "M": 10**6}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["89578", "10M"], help="float32 parameters")
    ap.add_argument("--parts", nargs="+", type=int, default=[1, 8],
                    help="messages per gradient (1 = one message; K > 1 = cut-through)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per case")
    ap.add_argument("--block", type=float, default=0.05,
                    help="seconds of back-to-back trips of one case before the next case "
                         "(short: every case sees the same load; long: caches stay warm "
                         "between trips of one case, as in `rudra-zmq bench pushpull`)")
    args = ap.parse_args(argv)
    transport.tune_malloc()
    print(f"# bench/pushpull_floor.py  {time.strftime('%Y-%m-%d %H:%M:%S')}  loadavg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}  python {sys.version.split()[0]}  "
          f"pyzmq {zmq.__version__}  libzmq {zmq.zmq_version()}")
    print("# ratio = median trip / median raw trip of the same size as ONE message (the goal's "
          "baseline); goal <= 1.15")
    for size in args.sizes:
        n = parse_size(size)
        res = measure(n, args.parts, args.seconds, args.block)
        base = res[(RAW, 1)][0] if (RAW, 1) in res else None
        for (op, p), (med, trips) in res.items():
            name = {RAW: "raw", KERNEL: "kernel", HELD: "held"}[op] + (f" x{p}" if p > 1 else "")
            ratio = f"{med / base:5.2f}x" if base else "  -  "
            print(f"n={n:>11,} ({4 * n / 2**20:7.2f} MiB)  {name:<10} median {med * 1e6:10.1f} µs"
                  f"  trips {trips:6d}  ratio {ratio}", flush=True)
    print(f"# loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
