"""Push + pull through the parameter server beside a raw ZeroMQ round trip of the same bytes.

One learner (this process) and one server process talk over tcp loopback. For each model size
and PS kernel thread count it prints one line: the median (and p90) time of a learner's
PUSHPULL(wait=False) -> WEIGHTS round trip through a real ``ParameterServer`` (async, λ = 1, so
every push is an update and every pull gets new weights; momentum 0.9), beside a raw pyzmq
round trip of the same bytes between two processes (DEALER sends N bytes zero-copy, a ROUTER
replies with a preallocated N-byte buffer zero-copy, ``copy=False`` receives on both sides),
and the ratio. The raw round trip is timed twice: as one N-byte frame ("raw", the goal's
baseline) and split into the same ``runtime.chunk_mib`` frames the PS uses ("raw chunked";
only where that differs). A third server, "echo", speaks the PS's protocol (wire.decode,
wire.encode, the same socket calls) but answers from a preallocated array without updating
or copying, in the same messages (streamed in the same parts where the PS streams): PS - echo
is the PS's own work, echo - raw the protocol's cost. Every process calls
``transport.tune_malloc()`` first. The cases of one size are timed round-robin in short
blocks, so load from other users hits all alike. The goal's verdict compares the PS with the
faster of the two raw variants.

The PS sends its weights zero-copy with no snapshot copy per version: the update writes the
next version into a free buffer (``rudra_zmq/versions.py``, ``WeightVersions``; the kernels'
``out=``), and a reply that follows its update is streamed in up to ``runtime.stream_parts``
parts (``--stream-parts``, default 8; WPART messages, then WEIGHTS) while the update computes
the rest. The clients here receive through ``transport.Channel``, which gathers such parts
(``wire.assemble``). The ``--cow`` prototype this script used to time (copy-on-write weights
instead of a snapshot) is therefore gone: the PS itself now does that.

After the timed lines comes a PS-side breakdown per size: "warm", the pieces called in a loop
in this process (wire.decode of a PUSHPULL; the update ``ParameterServer._push``: sync engine
+ momentum kernel in one pass, unstreamed, of which next_buffer = ``versions.next_buffer``;
wire.encode of the reply in the messages the PS sends; and the learner's copy of the received
weights, which is not in the timed trip); and "live", the pieces of each PUSHPULL timed inside
a serving PS process (a subclass with timers, used for nothing else, with the hot path off:
``roles/ps_hot.py`` serves a c = 1 PUSHPULL in one C call) while a client runs round trips,
summed per request (a streamed reply encodes and sends once per part, inside the update):
caches are cold there, as in real use. Per-trip CPU time and page faults of every process are
printed under each case.

    python bench/pushpull.py                          # defaults below, ~1-2 minutes
    python bench/pushpull.py --sizes 89578 10M --ps-threads 1 --seconds 5 --csv out.csv
    python bench/pushpull.py --stream-parts 1         # replies unstreamed (one WEIGHTS message)
"""
import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import numpy as np
import zmq

from rudra_zmq import kernels, transport, wire
from rudra_zmq.benchmarks import common
from rudra_zmq.wire import Kind

# ----------------------------------------------------------------------------- defaults
SIZES = ["89578", "1M", "10M"]       # float32 parameters (89,578 = cifar10_full)
PS_THREADS = [1, 2]                  # runtime.ps_threads of the PS process
SECONDS = 4.0                        # timed seconds per case (calibrated to a trip count)
MIN_TRIPS, MAX_TRIPS = 30, 20_000
WARMUP_S = 0.5                       # untimed round trips per case, at least 10
BLOCK_S = 0.05                       # round-robin block length
CHUNK_MIB = 8                        # runtime.chunk_mib (the default)
STREAM_PARTS = 8                     # runtime.stream_parts (the default; 1 = unstreamed)
LIVE_S = 2.0                         # round trips for the live (instrumented) PS breakdown
GOAL = 1.15                          # PS round trip <= GOAL x raw round trip
SIGNATURE = "bench-pushpull"


def parse_size(s):
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def fmt_n(n):
    for unit, div in (("M", 10**6), ("K", 10**3)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n:,}"


def ps_config(ps_threads, chunk_mib, stream_parts):
    """Async, λ = 1, momentum 0.9, no evaluation, an epoch so long that training never ends."""
    from rudra_zmq.config import load_config
    return load_config(None, [
        "sync.protocol=async", "sync.learners=1", "sync.batch_size=128",
        "optimizer.lr=0.000001", "optimizer.momentum=0.9", "optimizer.weight_decay=0.0005",
        "train.epochs=1.0e+12", "train.eval_every_epochs=0", "train.eval_every_updates=0",
        "data.dataset=synthetic", "data.synthetic_train=1000000000",
        f"runtime.ps_threads={ps_threads}", f"runtime.chunk_mib={chunk_mib}",
        f"runtime.stream_parts={stream_parts}", "runtime.timeout_s=3600"])


def initial_weights(n):
    return (np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01)


def part_floats(n, chunk_mib, stream_parts):
    """Floats per part of a streamed WEIGHTS reply, as the PS computes it; >= n means the reply
    is not streamed."""
    from rudra_zmq.update import stream_part_floats

    return stream_part_floats(n, chunk_mib << 20, stream_parts)


def weights_messages(kind, seq, ts, inc, w, chunk_bytes, pf, **fields):
    """The frames of each message of a reply carrying ``w``, as the PS sends it: one message
    (``w`` in chunks) if ``pf >= len(w)``, else WPART messages of ``pf`` floats and a last
    ``kind`` message with ``parts`` = how many came before it."""
    n = w.shape[0]
    if pf >= n:
        return [wire.encode(kind, wire.SENDER_PS, seq, ts, inc, wire.chunk(w, chunk_bytes),
                            **fields)]
    starts = range(0, n, pf)
    out = [wire.encode(Kind.WPART, wire.SENDER_PS, seq + i, ts, inc, [w[lo:lo + pf]], offset=lo)
           for i, lo in enumerate(starts[:-1])]
    out.append(wire.encode(kind, wire.SENDER_PS, seq + len(out), ts, inc, [w[starts[-1]:]],
                           parts=len(out), **fields))
    return out


# ----------------------------------------------------------------------------- server processes
def ps_main(conn, stop, n, ps_threads, chunk_mib, stream_parts):
    """The PS process: a real ParameterServer with a synthetic model (no torch model)."""
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    from rudra_zmq.roles.ps import ParameterServer
    ps = ParameterServer(ps_config(ps_threads, chunk_mib, stream_parts), "tcp://127.0.0.1:0",
                         model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    conn.send(ps.endpoint)
    ps.serve_forever(stop_event=stop)


# per PUSHPULL, summed over its calls: handle = all of ParameterServer.handle; push = _push
# (engine + update, and the streamed reply's encodes/sends); next_buffer = versions.next_buffer;
# kernel = Updater.step_range (all parts); encode = wire.encode; send = the zmq send_multipart calls;
# sends = how many messages went out (a count, not µs)
LIVE_PIECES = ("handle", "decode", "push", "next_buffer", "kernel", "encode", "send", "sends")


def ps_live_main(conn, stop, n, ps_threads, chunk_mib, stream_parts):
    """Like ps_main, but the PS times the pieces of each PUSHPULL as it serves it (used only
    for the "live" breakdown, never for the timed lines): each piece is summed over its calls
    within one request; medians over requests (and the buffers WeightVersions allocated) go
    back over ``conn``."""
    import types

    from rudra_zmq.roles import ps as ps_mod
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    spans = {k: [] for k in LIVE_PIECES}
    cur = {}                                    # this request's sums

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[name] = cur.get(name, 0.0) + time.perf_counter() - t0
        return call

    proxy = types.ModuleType("wire_timed")      # ps.py looks up wire.decode at call time
    proxy.__dict__.update(vars(wire))
    proxy.decode, proxy.encode = timed("decode", wire.decode), timed("encode", wire.encode)
    ps_mod.wire = proxy

    class TimedPS(ps_mod.ParameterServer):
        _push = timed("push", ps_mod.ParameterServer._push)

        def handle(self, frames):
            cur.clear()
            t0 = time.perf_counter()
            try:
                return super().handle(frames)
            finally:
                cur["handle"] = time.perf_counter() - t0
                if "push" in cur:               # a PUSHPULL (not the HELLO)
                    for k, v in cur.items():
                        spans[k].append(v)

    ps = TimedPS(ps_config(ps_threads, chunk_mib, stream_parts), "tcp://127.0.0.1:0",
                 model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    ps.hot = None     # the pieces of the general path (the hot path is one C call)
    ps.versions.next_buffer = timed("next_buffer", ps.versions.next_buffer)
    ps.updater.step_range = timed("kernel", ps.updater.step_range)
    send = timed("send", ps.io.send_multipart)

    def counted_send(*a, **k):
        cur["sends"] = cur.get("sends", 0) + 1
        return send(*a, **k)

    ps.io.send_multipart = counted_send
    conn.send(ps.endpoint)
    ps.serve_forever(stop_event=stop)
    out = {k: statistics.median(v[len(v) // 5:]) * (1 if k == "sends" else 1e6)
           for k, v in spans.items() if v}
    conn.send({**out, "buffers": ps.versions.allocated})


def raw_main(conn, stop, nbytes):
    """The baseline process: a ROUTER that answers every message with one preallocated N-byte
    buffer (or the same buffer in the frames the request came in), zero-copy both ways."""
    transport.tune_malloc()
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64)
    conn.send(transport.bind(sock, "tcp://127.0.0.1:0"))
    reply = np.ones(nbytes, np.uint8)
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                off, out = 0, [frames[0]]
                for f in frames[1:]:   # same frame sizes back: one frame, or the PS's chunks
                    size = len(f.buffer)
                    out.append(reply[off:off + size])
                    off += size
                sock.send_multipart(out, copy=False)
    sock.close(linger=0)
    ctx.term()


def echo_main(conn, stop, n, chunk_mib, stream_parts):
    """The protocol-only server: the PS's framing and validation (wire.decode / wire.encode,
    one ROUTER, the same send/receive calls) answering every PUSHPULL with WEIGHTS from one
    preallocated array, in the same messages as the PS (WPART parts, then WEIGHTS, where it
    streams), without the update. PS - echo = the PS's work."""
    transport.tune_malloc()
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64)
    conn.send(transport.bind(sock, "tcp://127.0.0.1:0"))
    weights = initial_weights(n)
    chunk_bytes = chunk_mib << 20
    pf = part_floats(n, chunk_mib, stream_parts)
    ts = seq = 0
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = wire.decode(frames[1:], kinds={Kind.HELLO, Kind.PUSHPULL}, numel=n)
                if msg.kind == Kind.HELLO:   # the PS never streams a WELCOME
                    msgs = weights_messages(Kind.WELCOME, seq + 1, ts, 1, weights, chunk_bytes,
                                            n, learners=1, protocol="async")
                else:
                    ts += 1
                    msgs = weights_messages(Kind.WEIGHTS, seq + 1, ts, 1, weights, chunk_bytes,
                                            pf, sigma=0)
                seq += len(msgs)
                for out in msgs:
                    sock.send_multipart([frames[0], *out], zmq.NOBLOCK, copy=False)
    sock.close(linger=0)
    ctx.term()


def start(target, *args, env=None):
    """Start ``target(conn, stop, *args)`` in a spawned process (with ``env`` added to its
    environment); returns (process, stop event, the endpoint it reported, conn)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})      # a spawned child inherits the environment at start()
    try:
        return _start(target, *args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(target, *args):
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    stop = spawn.Event()
    proc = spawn.Process(target=target, args=(child, stop, *args), daemon=True)
    proc.start()
    deadline = time.monotonic() + 120
    while not parent.poll(0.1):
        if not proc.is_alive() or time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"{target.__name__} did not report its endpoint (exit code "
                               f"{proc.exitcode})")
    return proc, stop, parent.recv(), parent


def stop_all(servers):
    for proc, stop, *_ in servers:
        stop.set()
    for proc, stop, *_ in servers:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


# ----------------------------------------------------------------------------- clients
class PSClient:
    """A learner's side of the PS protocol, as roles/learner.py does it (Channel, zero-copy
    send of the gradient chunks, copy=False receive; Channel.recv gathers a streamed reply's
    WPART messages and its WEIGHTS into one message), minus the model."""

    def __init__(self, ctx, endpoint, n, chunk_bytes):
        self.ch = transport.Channel(ctx, endpoint, 0, name="parameter server",
                                    timeout_ms=60_000, hwm=4)
        self.n = n
        self.grad = np.random.default_rng(1).standard_normal(n, dtype=np.float32) * 0.01
        self.parts = wire.chunk(self.grad, chunk_bytes)
        self.ch.send(Kind.HELLO, model=SIGNATURE, numel=n)
        self.ts = self.ch.recv({Kind.WELCOME}, numel=n).ts
        self.last, self.msgs = None, 0

    def trip(self):
        reply = self.ch.request(Kind.PUSHPULL, self.ts, self.parts,
                                reply_kinds={Kind.WEIGHTS, Kind.UPTODATE}, numel=self.n,
                                wait=False)
        if reply.kind != Kind.WEIGHTS:
            raise RuntimeError(f"expected WEIGHTS after an async push, got {reply.kind.name}")
        self.ts = reply.ts
        self.msgs = reply.fields.get("parts", 0) + 1   # messages the reply came in
        self.last = reply   # keep the frames alive until the next trip, as a learner would

    def close(self):
        self.ch.close()


class RawClient:
    """DEALER: send the N-byte buffer zero-copy (as one frame or in chunks), wait for the
    N-byte reply with copy=False."""

    def __init__(self, ctx, endpoint, nbytes, chunk_bytes=None):
        self.sock = transport.make_socket(ctx, zmq.DEALER, hwm=4)
        self.sock.connect(endpoint)
        self.buf = np.ones(nbytes, np.uint8)
        self.frames = [self.buf] if chunk_bytes is None else wire.chunk(self.buf, chunk_bytes)
        self.nbytes = nbytes
        self.last = None

    def trip(self):
        self.sock.send_multipart(self.frames, copy=False)
        if not self.sock.poll(60_000):
            raise TimeoutError("raw server did not answer within 60 s")
        reply = self.sock.recv_multipart(copy=False)
        if sum(len(f.buffer) for f in reply) != self.nbytes:
            raise RuntimeError("raw server answered the wrong number of bytes")
        self.last = reply

    def close(self):
        self.sock.close(linger=0)


def proc_counters(pid):
    """(CPU seconds, minor page faults) of a process so far, all threads, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def self_counters():
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_cases(clients, seconds, cost=None):
    """{name: [seconds per trip]}: warm-up, calibrate, then round-robin blocks. ``cost``, if
    given, collects this (client) process's CPU seconds and page faults per case."""
    per = {}
    for name, c in clients.items():
        t0, k = time.perf_counter(), 0
        while k < 10 or time.perf_counter() - t0 < WARMUP_S:
            c.trip()
            k += 1
        per[name] = (time.perf_counter() - t0) / k
    trips = {name: int(min(MAX_TRIPS, max(MIN_TRIPS, seconds / t))) for name, t in per.items()}
    block = {name: max(1, int(BLOCK_S / t)) for name, t in per.items()}
    times = {name: [] for name in clients}
    cost = {} if cost is None else cost
    cost.update({name: [0.0, 0] for name in clients})
    while any(len(times[nm]) < trips[nm] for nm in clients):
        for name, c in clients.items():
            c0 = self_counters()
            for _ in range(min(block[name], trips[name] - len(times[name]))):
                t0 = time.perf_counter()
                c.trip()
                times[name].append(time.perf_counter() - t0)
            c1 = self_counters()
            cost[name][0] += c1[0] - c0[0]
            cost[name][1] += c1[1] - c0[1]
    return times


def stats(ts):
    s = sorted(ts)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
            "min": s[0], "trips": len(s)}


# ----------------------------------------------------------------------------- PS breakdown
def breakdown(n, ps_threads, chunk_mib, stream_parts, reps):
    """Median µs of each piece of the PS's work for one PUSHPULL of ``n`` floats, in-process.
    The update runs as one unstreamed pass (``_push`` with no one to stream to); the reply is
    encoded in the messages the PS sends (streamed parts where it streams)."""
    from rudra_zmq.roles.ps import ParameterServer
    kernels.set_num_threads(ps_threads)
    ctx = zmq.Context()
    ps = ParameterServer(ps_config(ps_threads, chunk_mib, stream_parts), "tcp://127.0.0.1:0",
                         ctx=ctx, model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    pf = part_floats(n, chunk_mib, stream_parts)
    if ps.part_floats != pf:
        raise RuntimeError(f"part_floats() here gives {pf} floats, ParameterServer.part_floats "
                           f"{ps.part_floats}: update bench/pushpull.py to match ps.py")
    nb_spans = []
    next_buffer = ps.versions.next_buffer

    def timed_next_buffer():
        t0 = time.perf_counter()
        try:
            return next_buffer()
        finally:
            nb_spans.append(time.perf_counter() - t0)

    ps.versions.next_buffer = timed_next_buffer
    grad = np.random.default_rng(1).standard_normal(n, dtype=np.float32) * 0.01
    chunk_bytes = chunk_mib << 20
    learner_w = np.empty(n, np.float32)
    out = {k: [] for k in ("decode", "update", "next_buffer", "encode", "learner_load")}
    for i in range(reps + 3):
        frames = wire.encode(Kind.PUSHPULL, 0, i + 1, ps.engine.timestamp, 0,
                             wire.chunk(grad, chunk_bytes), wait=False)
        # as received: byte buffers (zmq.Frame.buffer is a memoryview of bytes)
        frames = [frames[0], *(memoryview(p).cast("B") for p in frames[1:])]
        t0 = time.perf_counter()
        msg = wire.decode(frames, kinds={Kind.HELLO, Kind.PUSHPULL}, numel=n)
        t1 = time.perf_counter()
        ps._push(msg, None)
        t2 = time.perf_counter()
        reply = weights_messages(Kind.WEIGHTS, i, ps.engine.timestamp, ps.inc, ps.w,
                                 chunk_bytes, pf, sigma=0)
        t3 = time.perf_counter()
        off = 0
        for m in reply:
            for part in m[1:]:
                kernels.copy_into(learner_w[off:off + part.shape[0]], part)
                off += part.shape[0]
        t4 = time.perf_counter()
        if i >= 3:
            for k, a, b in (("decode", t0, t1), ("update", t1, t2), ("encode", t2, t3),
                            ("learner_load", t3, t4)):
                out[k].append(b - a)
            out["next_buffer"].append(nb_spans[-1])
    if not np.array_equal(learner_w, ps.w):
        raise RuntimeError("the learner's copy differs from the PS's weights")
    buffers = ps.versions.allocated
    ps.io.close(linger=0)
    ctx.term()
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}, buffers


def live_breakdown(n, ps_threads, chunk_mib, stream_parts, seconds, env=None):
    """Median µs of each piece inside a serving PS process during ``seconds`` of round trips."""
    proc, stop, endpoint, conn = start(ps_live_main, n, ps_threads, chunk_mib, stream_parts,
                                       env=env)
    ctx = zmq.Context()
    client = PSClient(ctx, endpoint, n, chunk_mib << 20)
    try:
        t0, trips = time.perf_counter(), 0
        while trips < 10 or time.perf_counter() - t0 < seconds:
            client.trip()
            trips += 1
    finally:
        client.close()
        ctx.term()
        stop.set()
    out = conn.recv() if conn.poll(30) else {}
    proc.join(10)
    return out


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=SIZES, help="float32 counts, e.g. 89578 1M 10M")
    ap.add_argument("--ps-threads", nargs="+", type=int, default=PS_THREADS)
    ap.add_argument("--seconds", type=float, default=SECONDS, help="timed seconds per case")
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_MIB, help="runtime.chunk_mib")
    ap.add_argument("--breakdown-reps", type=int, default=None,
                    help="calls per piece in the PS breakdown (default by size)")
    ap.add_argument("--live-seconds", type=float, default=LIVE_S,
                    help="seconds of round trips for the live PS breakdown (0 = skip)")
    ap.add_argument("--stream-parts", type=int, default=STREAM_PARTS,
                    help="runtime.stream_parts: a weights reply that follows its update goes "
                         "out in up to this many parts as they are computed (1 = unstreamed)")
    ap.add_argument("--ps-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the PS process only, e.g. OMP_WAIT_POLICY=passive")
    ap.add_argument("--csv", metavar="PATH", help="also write one row per case here")
    args = ap.parse_args(argv)
    if args.stream_parts < 1:
        ap.error("--stream-parts must be >= 1")
    ps_env = dict(kv.split("=", 1) for kv in args.ps_env)
    sizes = [parse_size(s) for s in args.sizes]
    chunk_bytes = args.chunk_mib << 20
    transport.tune_malloc()

    facts = common.machine_facts(env_keys=(
        "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MALLOC_ARENA_MAX",
        "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"))
    print(common.header_text("push+pull benchmark", facts, notes=[
        f"tcp loopback, separate processes (spawn), tune_malloc() in all; PS: async λ=1, "
        f"momentum 0.9, chunk_mib={args.chunk_mib}, stream_parts={args.stream_parts}, "
        f"PS env: {ps_env or 'as above'}",
        f"times per round trip (push N bytes + reply N bytes): median [p90]; "
        f"ratio = PS median / raw median (goal <= {GOAL:.2f});",
        "echo = the PS's wire protocol and Python path (same reply messages) with no update; "
        "msgs = messages per reply (WPART parts + WEIGHTS) ps/echo"]),
        flush=True)

    rows, verdicts = [], []
    for n in sizes:
        nbytes = 4 * n
        chunked = nbytes > chunk_bytes
        raw = start(raw_main, nbytes)
        echo = start(echo_main, n, args.chunk_mib, args.stream_parts)
        for nt in args.ps_threads:
            ps = start(ps_main, n, nt, args.chunk_mib, args.stream_parts, env=ps_env)
            ctx = zmq.Context()
            clients = {"ps": PSClient(ctx, ps[2], n, chunk_bytes),
                       "echo": PSClient(ctx, echo[2], n, chunk_bytes),
                       "raw": RawClient(ctx, raw[2], nbytes)}
            if chunked:
                clients["raw_chunked"] = RawClient(ctx, raw[2], nbytes, chunk_bytes)
            pids = {"ps": ps[0].pid, "echo": echo[0].pid, "raw": raw[0].pid}
            cost = {}
            srv0 = {k: proc_counters(pid) for k, pid in pids.items()}
            try:
                times = time_cases(clients, args.seconds, cost)
                srv1 = {k: proc_counters(pid) for k, pid in pids.items()}
                msgs = f"{clients['ps'].msgs}/{clients['echo'].msgs}"
            finally:
                for c in clients.values():
                    c.close()
                ctx.term()
                stop_all([ps])
            st = {k: stats(v) for k, v in times.items()}
            ratio = st["ps"]["median"] / st["raw"]["median"]
            best = min(("raw", "raw_chunked") if chunked else ("raw",),
                       key=lambda k: st[k]["median"])
            verdicts.append((n, nt, st["ps"]["median"] / st[best]["median"], best))
            us = {k: (v["median"] * 1e6, v["p90"] * 1e6) for k, v in st.items()}
            gbs = 2 * nbytes / st["ps"]["median"] / 1e9
            line = (f"pushpull n={fmt_n(n):>6} ({nbytes / 2**20:6.2f} MiB) ps_threads={nt}  "
                    f"PS {us['ps'][0]:9.1f} µs [{us['ps'][1]:9.1f}] {gbs:5.2f} GB/s | "
                    f"raw {us['raw'][0]:9.1f} µs [{us['raw'][1]:9.1f}] | PS/raw {ratio:4.2f}x | "
                    f"echo {us['echo'][0]:9.1f} µs [{us['echo'][1]:9.1f}] "
                    f"(echo/raw {st['echo']['median'] / st['raw']['median']:4.2f}x)")
            if chunked:
                line += (f" | raw chunked {us['raw_chunked'][0]:9.1f} µs "
                         f"[{us['raw_chunked'][1]:9.1f}] (PS/raw chunked "
                         f"{st['ps']['median'] / st['raw_chunked']['median']:4.2f}x)")
            print(line + f"  msgs {msgs}  trips " + "/".join(str(v["trips"]) for v in st.values()), flush=True)
            raw_trips = st["raw"]["trips"] + st.get("raw_chunked", {"trips": 0})["trips"]
            srv = {k: ((srv1[k][0] - srv0[k][0]) * 1e6 / t, (srv1[k][1] - srv0[k][1]) / t)
                   for k, t in (("ps", st["ps"]["trips"]), ("echo", st["echo"]["trips"]),
                                ("raw", raw_trips))
                   if t}
            cli = {k: (v[0] * 1e6 / st[k]["trips"], v[1] / st[k]["trips"])
                   for k, v in cost.items()}
            print("#   per trip: server CPU µs " + " ".join(f"{k} {v[0]:.0f}" for k, v in
                                                      srv.items()) +
                  ", faults " + " ".join(f"{k} {v[1]:.1f}" for k, v in srv.items()) +
                  " | client CPU µs " + " ".join(f"{k} {v[0]:.0f}" for k, v in cli.items()) +
                  ", faults " + " ".join(f"{k} {v[1]:.1f}" for k, v in cli.items()) +
                  f" | loadavg {os.getloadavg()[0]:.2f}", flush=True)
            for impl, s in st.items():
                rows.append({"n": n, "bytes": nbytes, "ps_threads": nt, "impl": impl,
                             "median_us": s["median"] * 1e6, "p90_us": s["p90"] * 1e6,
                             "min_us": s["min"] * 1e6, "trips": s["trips"],
                             "loadavg1": os.getloadavg()[0]})
        stop_all([raw, echo])

    print("# PS-side breakdown, median µs per PUSHPULL. warm: pieces called in a loop in this "
          "process (decode = wire.decode; update = ParameterServer._push: engine + momentum "
          "kernel writing the next version, one unstreamed pass, of which next_buffer = "
          "versions.next_buffer; encode = wire.encode of the reply's messages; learner_load = "
          "the learner's copy of the received weights, outside the timed trip). live: pieces "
          "timed inside a serving PS process during "
          f"{args.live_seconds:g} s of round trips, summed per request (handle = all of "
          "ParameterServer.handle; push = _push, including next_buffer, kernel = Updater.step_range "
          "and, when the reply is streamed, its encodes and sends; send = the zmq "
          "send_multipart calls; sends = messages sent, a count). buffers = weight buffers "
          "WeightVersions allocated in all", flush=True)
    for n in sizes:
        for nt in args.ps_threads:
            reps = args.breakdown_reps or max(20, min(2000, int(2e8 / n)))
            b, buffers = breakdown(n, nt, args.chunk_mib, args.stream_parts, reps)
            print(f"breakdown n={fmt_n(n):>6} ps_threads={nt} warm  " +
                  "  ".join(f"{k} {v:8.1f}" for k, v in b.items()) +
                  f"  | PS total {b['decode'] + b['update'] + b['encode']:8.1f}  "
                  f"buffers {buffers}", flush=True)
            rows.append({"n": n, "bytes": 4 * n, "ps_threads": nt, "impl": "breakdown_warm",
                         **{f"{k}_us": v for k, v in b.items()}, "buffers": buffers})
            if args.live_seconds > 0:
                lv = live_breakdown(n, nt, args.chunk_mib, args.stream_parts,
                                    args.live_seconds, ps_env)
                print(f"breakdown n={fmt_n(n):>6} ps_threads={nt} live  " +
                      "  ".join(f"{k} {lv[k]:8.1f}" for k in LIVE_PIECES
                                if k in lv and k != "sends") +
                      f"  sends {lv.get('sends', 0):g}  buffers {lv.get('buffers', '?')}"
                      f"  | loadavg {os.getloadavg()[0]:.2f}", flush=True)
                rows.append({"n": n, "bytes": 4 * n, "ps_threads": nt, "impl": "breakdown_live",
                             **{k if k in ("sends", "buffers") else f"{k}_us": v
                                for k, v in lv.items()}})

    if args.csv:
        common.write_csv(args.csv, rows)

    print(f"# goal: PS round trip <= {GOAL:.2f}x the faster raw round trip (one frame or "
          f"chunked)  (loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for n, nt, ratio, best in verdicts:
        print(f"{'PASS' if ratio <= GOAL else 'MISS'}  n={fmt_n(n):>6} ps_threads={nt}  "
              f"want <= {GOAL:.2f}x  got {ratio:.2f}x (vs {best})")


if __name__ == "__main__":
    sys.exit(main())
