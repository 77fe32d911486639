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
or copying: PS - echo is the PS's own work, echo - raw the protocol's cost. Every process
calls ``transport.tune_malloc()`` first. The cases of one size are timed round-robin in short
blocks, so load from other users hits all alike. The goal's verdict compares the PS with the
faster of the two raw variants.

After the timed lines comes a PS-side breakdown per size: "warm", the pieces called in a loop
in this process (wire.decode of a PUSHPULL, the update ``ParameterServer._push``: sync engine +
momentum kernel, the snapshot copy that makes the weights safe to send zero-copy, wire.encode
of the reply, and the learner's copy of the received weights, which is not in the timed trip);
and "live", the same pieces timed inside a serving PS process (a subclass with timers, used
for nothing else) while a client runs round trips: caches are cold there, as in real use.
Per-trip CPU time and page faults of every process are printed under each case. ``--cow``
adds a prototype PS (a proposed change, see ``ps_cow_main``) to the timed cases.

    python bench/pushpull.py                          # defaults below, ~1-2 minutes
    python bench/pushpull.py --sizes 89578 10M --ps-threads 1 --seconds 5 --cow --csv out.csv
"""
import argparse
import csv
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np
import zmq

import rudra_zmq
from rudra_zmq import kernels, transport, wire
from rudra_zmq.wire import Kind

# ----------------------------------------------------------------------------- defaults
SIZES = ["89578", "1M", "10M"]       # float32 parameters (89,578 = cifar10_full)
PS_THREADS = [1, 2]                  # runtime.ps_threads of the PS process
SECONDS = 4.0                        # timed seconds per case (calibrated to a trip count)
MIN_TRIPS, MAX_TRIPS = 30, 20_000
WARMUP_S = 0.5                       # untimed round trips per case, at least 10
BLOCK_S = 0.05                       # round-robin block length
CHUNK_MIB = 8                        # runtime.chunk_mib (the default)
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


def ps_config(ps_threads, chunk_mib):
    """Async, λ = 1, momentum 0.9, no evaluation, an epoch so long that training never ends."""
    from rudra_zmq.config import load_config
    return load_config(None, [
        "sync.protocol=async", "sync.learners=1", "sync.batch_size=128",
        "optimizer.lr=0.000001", "optimizer.momentum=0.9", "optimizer.weight_decay=0.0005",
        "train.epochs=1.0e+12", "train.eval_every_epochs=0", "train.eval_every_updates=0",
        "data.dataset=synthetic", "data.synthetic_train=1000000000",
        f"runtime.ps_threads={ps_threads}", f"runtime.chunk_mib={chunk_mib}",
        "runtime.timeout_s=3600"])


def initial_weights(n):
    return (np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01)


# ----------------------------------------------------------------------------- server processes
def ps_main(conn, stop, n, ps_threads, chunk_mib):
    """The PS process: a real ParameterServer with a synthetic model (no torch model)."""
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    from rudra_zmq.roles.ps import ParameterServer
    ps = ParameterServer(ps_config(ps_threads, chunk_mib), "tcp://127.0.0.1:0",
                         model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    conn.send(ps.endpoint)
    ps.serve_forever(stop_event=stop)


LIVE_PIECES = ("handle", "decode", "push", "kernel", "snapshot", "encode", "send")


def ps_live_main(conn, stop, n, ps_threads, chunk_mib):
    """Like ps_main, but the PS times the pieces of each request as it serves them (used only
    for the "live" breakdown, never for the timed lines): medians go back over ``conn``."""
    import types

    from rudra_zmq.roles import ps as ps_mod
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    spans = {k: [] for k in LIVE_PIECES}

    def timed(name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[name].append(time.perf_counter() - t0)
        return call

    proxy = types.ModuleType("wire_timed")      # ps.py looks up wire.decode at call time
    proxy.__dict__.update(vars(wire))
    proxy.decode, proxy.encode = timed("decode", wire.decode), timed("encode", wire.encode)
    ps_mod.wire = proxy

    class TimedPS(ps_mod.ParameterServer):
        handle = timed("handle", ps_mod.ParameterServer.handle)
        _push = timed("push", ps_mod.ParameterServer._push)
        _step = timed("kernel", ps_mod.ParameterServer._step)
        _snapshot_now = timed("snapshot", ps_mod.ParameterServer._snapshot_now)

    ps = TimedPS(ps_config(ps_threads, chunk_mib), "tcp://127.0.0.1:0",
                 model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    ps.sock.send_multipart = timed("send", ps.sock.send_multipart)
    conn.send(ps.endpoint)
    ps.serve_forever(stop_event=stop)
    conn.send({k: statistics.median(v[len(v) // 5:]) * 1e6 for k, v in spans.items() if v})


def ps_cow_main(conn, stop, n, ps_threads, chunk_mib):
    """``--cow`` only: a PROTOTYPE of a proposed ps.py change, not the shipped PS. It sends
    ``w`` itself zero-copy (tracked) instead of a fresh snapshot, and copies ``w`` before an
    update only if a send of it is still in flight (copy-on-write). Sending the weights to
    the stats server (EVAL) is not covered: it is off in this benchmark."""
    from rudra_zmq.roles.ps import ParameterServer
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)

    class CowPS(ParameterServer):
        _trackers = ()

        def _snapshot_now(self):
            return self.w

        def _send(self, ident, kind, payloads=(), **fields):
            self._seq += 1
            frames = wire.encode(kind, wire.SENDER_PS, self._seq, self.engine.timestamp,
                                 self.inc, payloads, **fields)
            tracker = self.sock.send_multipart([ident, *frames], copy=False,
                                               track=bool(payloads))
            if payloads:
                self._trackers = (*self._trackers, tracker)

        def _step(self, sources, g_scale, lr, zero_acc):
            if any(not t.done for t in self._trackers):   # ZeroMQ still reads w: write a copy
                w = np.empty_like(self.w)
                kernels.copy_into(w, self.w)
                self.w = w
            self._trackers = ()
            super()._step(sources, g_scale, lr, zero_acc)

    ps = CowPS(ps_config(ps_threads, chunk_mib), "tcp://127.0.0.1:0",
               model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    conn.send(ps.endpoint)
    ps.serve_forever(stop_event=stop)


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


def echo_main(conn, stop, n, chunk_mib):
    """The protocol-only server: the PS's framing and validation (wire.decode / wire.encode,
    one ROUTER, the same send/receive calls) answering every PUSHPULL with WEIGHTS from one
    preallocated array, without the update or the snapshot copy. PS - echo = the PS's work."""
    transport.tune_malloc()
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64)
    conn.send(transport.bind(sock, "tcp://127.0.0.1:0"))
    weights = initial_weights(n)
    parts = wire.chunk(weights, chunk_mib << 20)
    ts = seq = 0
    while not stop.is_set():
        if sock.poll(100):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = wire.decode(frames[1:], kinds={Kind.HELLO, Kind.PUSHPULL}, numel=n)
                seq += 1
                if msg.kind == Kind.HELLO:
                    out = wire.encode(Kind.WELCOME, wire.SENDER_PS, seq, ts, 1, parts,
                                      learners=1, protocol="async")
                else:
                    ts += 1
                    out = wire.encode(Kind.WEIGHTS, wire.SENDER_PS, seq, ts, 1, parts, sigma=0)
                sock.send_multipart([frames[0], *out], copy=False)
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
    send of the gradient chunks, copy=False receive), minus the model."""

    def __init__(self, ctx, endpoint, n, chunk_bytes):
        self.ch = transport.Channel(ctx, endpoint, 0, name="parameter server",
                                    timeout_ms=60_000, hwm=4)
        self.n = n
        self.grad = np.random.default_rng(1).standard_normal(n, dtype=np.float32) * 0.01
        self.parts = wire.chunk(self.grad, chunk_bytes)
        self.ch.send(Kind.HELLO, model=SIGNATURE, numel=n)
        self.ts = self.ch.recv({Kind.WELCOME}, numel=n).ts
        self.last = None

    def trip(self):
        reply = self.ch.request(Kind.PUSHPULL, self.ts, self.parts,
                                reply_kinds={Kind.WEIGHTS, Kind.UPTODATE}, numel=self.n,
                                wait=False)
        if reply.kind != Kind.WEIGHTS:
            raise RuntimeError(f"expected WEIGHTS after an async push, got {reply.kind.name}")
        self.ts = reply.ts
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
def breakdown(n, ps_threads, chunk_mib, reps):
    """Median µs of each piece of the PS's work for one PUSHPULL of ``n`` floats, in-process."""
    from rudra_zmq.roles.ps import ParameterServer
    kernels.set_num_threads(ps_threads)
    ctx = zmq.Context()
    ps = ParameterServer(ps_config(ps_threads, chunk_mib), "tcp://127.0.0.1:0", ctx=ctx,
                         model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE))
    grad = np.random.default_rng(1).standard_normal(n, dtype=np.float32) * 0.01
    chunk_bytes = chunk_mib << 20
    learner_w = np.empty(n, np.float32)
    out = {k: [] for k in ("decode", "update", "snapshot", "encode", "learner_load")}
    for i in range(reps + 3):
        frames = wire.encode(Kind.PUSHPULL, 0, i + 1, ps.engine.timestamp, 0,
                             wire.chunk(grad, chunk_bytes), wait=False)
        # as received: byte buffers (zmq.Frame.buffer is a memoryview of bytes)
        frames = [frames[0], *(memoryview(p).cast("B") for p in frames[1:])]
        t0 = time.perf_counter()
        msg = wire.decode(frames, kinds={Kind.HELLO, Kind.PUSHPULL}, numel=n)
        t1 = time.perf_counter()
        ps._push(msg)
        t2 = time.perf_counter()
        snap = ps._snapshot_now()
        t3 = time.perf_counter()
        reply = wire.encode(Kind.WEIGHTS, wire.SENDER_PS, i, ps.engine.timestamp, ps.inc,
                            wire.chunk(snap, chunk_bytes), sigma=0)
        t4 = time.perf_counter()
        off = 0
        for part in reply[1:]:
            kernels.copy_into(learner_w[off:off + part.shape[0]], part)
            off += part.shape[0]
        t5 = time.perf_counter()
        if i >= 3:
            for k, a, b in (("decode", t0, t1), ("update", t1, t2), ("snapshot", t2, t3),
                            ("encode", t3, t4), ("learner_load", t4, t5)):
                out[k].append(b - a)
    ps.sock.close(linger=0)
    ctx.term()
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def live_breakdown(n, ps_threads, chunk_mib, seconds, env=None):
    """Median µs of each piece inside a serving PS process during ``seconds`` of round trips."""
    proc, stop, endpoint, conn = start(ps_live_main, n, ps_threads, chunk_mib, env=env)
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
def machine_facts():
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    env = {k: os.environ.get(k, "(unset)") for k in (
        "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MALLOC_ARENA_MAX",
        "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")}
    return {"nproc": os.cpu_count(), "cpu_model": model, "loadavg": os.getloadavg(),
            "python": platform.python_version(), "numpy": np.__version__,
            "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(),
            "build_info": rudra_zmq.build_info(), "env": env}


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
    ap.add_argument("--cow", action="store_true",
                    help="also time a prototype PS that sends w copy-on-write (no snapshot)")
    ap.add_argument("--ps-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of the PS process only, e.g. OMP_WAIT_POLICY=passive")
    ap.add_argument("--csv", metavar="PATH", help="also write one row per case here")
    args = ap.parse_args(argv)
    ps_env = dict(kv.split("=", 1) for kv in args.ps_env)
    sizes = [parse_size(s) for s in args.sizes]
    chunk_bytes = args.chunk_mib << 20
    transport.tune_malloc()

    f = machine_facts()
    print(f"# rudra_zmq push+pull benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
          f"# cpu: {f['cpu_model']} x{f['nproc']}  loadavg: "
          f"{' '.join(f'{x:.2f}' for x in f['loadavg'])}\n"
          f"# python {f['python']}  numpy {f['numpy']}  pyzmq {f['pyzmq']}  libzmq {f['libzmq']}\n"
          f"# build_info: {f['build_info']}\n"
          f"# env: {' '.join(f'{k}={v}' for k, v in f['env'].items())}\n"
          f"# tcp loopback, separate processes (spawn), tune_malloc() in all; PS: async λ=1, "
          f"momentum 0.9, chunk_mib={args.chunk_mib}, PS env: {ps_env or 'as above'}\n"
          f"# times per round trip (push N bytes + reply N bytes): median [p90]; "
          f"ratio = PS median / raw median (goal <= {GOAL:.2f});\n"
          f"# echo = the PS's wire protocol and Python path with no update and no snapshot copy",
          flush=True)

    rows, verdicts = [], []
    for n in sizes:
        nbytes = 4 * n
        chunked = nbytes > chunk_bytes
        raw = start(raw_main, nbytes)
        echo = start(echo_main, n, args.chunk_mib)
        for nt in args.ps_threads:
            ps = start(ps_main, n, nt, args.chunk_mib, env=ps_env)
            cow = start(ps_cow_main, n, nt, args.chunk_mib, env=ps_env) if args.cow else None
            ctx = zmq.Context()
            clients = {"ps": PSClient(ctx, ps[2], n, chunk_bytes),
                       "echo": PSClient(ctx, echo[2], n, chunk_bytes),
                       "raw": RawClient(ctx, raw[2], nbytes)}
            if chunked:
                clients["raw_chunked"] = RawClient(ctx, raw[2], nbytes, chunk_bytes)
            pids = {"ps": ps[0].pid, "echo": echo[0].pid, "raw": raw[0].pid}
            if cow:
                clients["ps_cow"] = PSClient(ctx, cow[2], n, chunk_bytes)
                pids["ps_cow"] = cow[0].pid
            cost = {}
            srv0 = {k: proc_counters(pid) for k, pid in pids.items()}
            try:
                times = time_cases(clients, args.seconds, cost)
                srv1 = {k: proc_counters(pid) for k, pid in pids.items()}
            finally:
                for c in clients.values():
                    c.close()
                ctx.term()
                stop_all([ps, cow] if cow else [ps])
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
            if cow:
                line += (f" | PROTOTYPE ps_cow {us['ps_cow'][0]:9.1f} µs [{us['ps_cow'][1]:9.1f}] "
                         f"(ps_cow/best raw {st['ps_cow']['median'] / st[best]['median']:4.2f}x)")
            print(line + "  trips " + "/".join(str(v["trips"]) for v in st.values()), flush=True)
            raw_trips = st["raw"]["trips"] + st.get("raw_chunked", {"trips": 0})["trips"]
            srv = {k: ((srv1[k][0] - srv0[k][0]) * 1e6 / t, (srv1[k][1] - srv0[k][1]) / t)
                   for k, t in (("ps", st["ps"]["trips"]), ("echo", st["echo"]["trips"]),
                                ("raw", raw_trips), ("ps_cow", st.get("ps_cow", {}).get("trips")))
                   if t}
            cli = {k: (v[0] * 1e6 / st[k]["trips"], v[1] / st[k]["trips"])
                   for k, v in cost.items()}
            print(f"#   per trip: server CPU µs " + " ".join(f"{k} {v[0]:.0f}" for k, v in
                                                      srv.items()) +
                  ", faults " + " ".join(f"{k} {v[1]:.1f}" for k, v in srv.items()) +
                  " | client CPU "
                  f"µs " + " ".join(f"{k} {v[0]:.0f}" for k, v in cli.items()) +
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
          "kernel; snapshot = copy of w for the zero-copy reply; encode = wire.encode of "
          "WEIGHTS; learner_load = the learner's copy of the received weights, outside the "
          "timed trip). live: the same pieces timed inside a serving PS process during "
          f"{args.live_seconds:g} s of round trips (handle = all of ParameterServer.handle; "
          "push includes kernel = _step; send = the zmq send_multipart call)", flush=True)
    for n in sizes:
        for nt in args.ps_threads:
            reps = args.breakdown_reps or max(20, min(2000, int(2e8 / n)))
            b = breakdown(n, nt, args.chunk_mib, reps)
            print(f"breakdown n={fmt_n(n):>6} ps_threads={nt} warm  " +
                  "  ".join(f"{k} {v:8.1f}" for k, v in b.items()) +
                  f"  | PS total {b['decode'] + b['update'] + b['snapshot'] + b['encode']:8.1f}",
                  flush=True)
            rows.append({"n": n, "bytes": 4 * n, "ps_threads": nt, "impl": "breakdown_warm",
                         **{f"{k}_us": v for k, v in b.items()}})
            if args.live_seconds > 0:
                lv = live_breakdown(n, nt, args.chunk_mib, args.live_seconds, ps_env)
                print(f"breakdown n={fmt_n(n):>6} ps_threads={nt} live  " +
                      "  ".join(f"{k} {lv[k]:8.1f}" for k in LIVE_PIECES if k in lv) +
                      f"  | loadavg {os.getloadavg()[0]:.2f}", flush=True)
                rows.append({"n": n, "bytes": 4 * n, "ps_threads": nt, "impl": "breakdown_live",
                             **{f"{k}_us": v for k, v in lv.items()}})

    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)

    print(f"# goal: PS round trip <= {GOAL:.2f}x the faster raw round trip (one frame or "
          f"chunked)  (loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for n, nt, ratio, best in verdicts:
        print(f"{'PASS' if ratio <= GOAL else 'MISS'}  n={fmt_n(n):>6} ps_threads={nt}  "
              f"want <= {GOAL:.2f}x  got {ratio:.2f}x (vs {best})")


if __name__ == "__main__":
    sys.exit(main())
