"""Shared memory vs ipc:// between a leaf and its co-located learners (issue #5).

A leaf (this process) and k learner processes on this machine run lock-step rounds: the leaf
sends the weights to every learner, each takes them into its flat parameter buffer, writes its
gradient and hands it back, and the leaf sums the k gradients with ``rudra_zmq.kernels`` as
``roles/tree_node.py`` does. A round is timed at the leaf, from the start of sending the weights
to the last gradient summed. Two ways, alternated in blocks of ``--rounds`` (order flipped every
repeat) after an untimed warm-up of each:

- **ipc**: ZeroMQ over ipc://, zero-copy sends and ``copy=False`` receives;
- **shm**: two alternating gradient slots per learner and the weights in one segment behind a
  seqlock (:mod:`.shm_segment`); ZeroMQ carries only a 16-byte notification each way.

Correctness is checked every round, outside the timed part. Segments are files in /dev/shm named
``rudra_shm_leaf_<pid>_...``, unlinked as soon as every learner has mapped them, before that by
``finally`` (SIGTERM becomes SystemExit); each run first removes segments of dead runs. What
each way does, the write assumption and the checks: ``docs/benchmarks.md``.

    rudra-zmq bench shm-leaf                              # defaults, ~2-3 minutes
    rudra-zmq bench shm-leaf --sizes 10M --learners 4 --repeat 9 --csv out.csv --json
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import struct
import sys
import tempfile
import time

import numpy as np
import zmq

from .. import kernels, transport, wire
from . import common
from .shm_segment import (
    PREFIX,
    SHM_DIR,
    TIMEOUT_S,
    VERSION_BYTES,
    Checker,
    Segment,
    Seqlock,
    grad_value,
    make_pattern,
    remove_stale_segments,
    weight_value,
    write,
)

SIZES = ["1M", "10M"]  # float32 parameters
LEARNERS = [1, 2, 4]  # learners per leaf
ROUNDS = 30  # timed rounds per block
REPEAT = 5  # blocks per way, alternating ipc / shm
WARMUP = 8  # untimed rounds of each way before the first block
CHUNK_MIB = 8  # runtime.chunk_mib (the default): frame size of the ipc way
LEAF_THREADS = 1  # kernel threads at the leaf
WAYS = ("ipc", "shm")
# A notification / round header, both directions: way, op, learner, slot, round, version.
HDR = struct.Struct("<BBHBxxxIQ")  # 20 bytes
OP_ROUND, OP_STOP, OP_HELLO = 0, 1, 2


# ----------------------------------------------------------------------------- learner
def learner_main(i, n, endpoint, wname, gname, chunk_bytes, pattern_kind, leaf_pid):
    """One learner: answer every round until STOP, then report checks and CPU per way."""
    transport.tune_malloc()
    kernels.set_num_threads(1)
    wseg = Segment(wname, VERSION_BYTES + 4 * n, create=False)
    gseg = Segment(gname, 2 * 4 * n, create=False)
    lock = Seqlock(wseg, n)
    slots = [gseg.array(np.float32, n, s * 4 * n) for s in (0, 1)]
    private = [np.zeros(n, np.float32) for _ in (0, 1)]
    params = np.zeros(n, np.float32)
    pattern = make_pattern(pattern_kind, n)
    check = Checker(n, pattern)
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=4, rcvtimeo=1000)
    cpu, rounds, retries, version_errors = {w: 0.0 for w in WAYS}, dict.fromkeys(WAYS, 0), 0, 0
    try:
        sock.connect(endpoint)
        sock.send(HDR.pack(0, OP_HELLO, i, 0, 0, 0))
        timed_way, t_prev, silent_since = None, 0.0, time.monotonic()
        while True:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if os.getppid() != leaf_pid or time.monotonic() - silent_since > TIMEOUT_S:
                    return 1  # the leaf is gone
                continue
            silent_since, t = time.monotonic(), time.process_time()
            if timed_way is not None:  # CPU since the last round began, all threads
                cpu[timed_way] += t - t_prev
                rounds[timed_way] += 1
            t_prev = t
            way, op, timed, slot, rnd, version = HDR.unpack(frames[0].bytes)
            if op == OP_STOP:
                sock.send(
                    json.dumps(
                        {
                            "learner": i,
                            "check_errors": check.errors,
                            "version_errors": version_errors,
                            "retries": retries,
                            "cpu_s": cpu,
                            "rounds": rounds,
                        }
                    ).encode()
                )
                sock.poll(1000, zmq.POLLOUT)
                return 0
            if WAYS[way] == "ipc":
                off = 0
                for part in frames[1:]:
                    a = np.frombuffer(part.buffer, np.float32)
                    kernels.copy_into(params[off : off + a.shape[0]], a)
                    off += a.shape[0]
                if off != n:
                    raise RuntimeError(f"learner {i}: weights of {off:,} floats, expected {n:,}")
            else:
                got, r = lock.read_into(params)
                retries += r
                version_errors += got != version
            check(params, weight_value(rnd))
            g = private[slot] if WAYS[way] == "ipc" else slots[slot]
            write(g, grad_value(i, rnd), pattern)
            hdr = HDR.pack(way, OP_ROUND, i, slot, rnd, 0)
            if WAYS[way] == "ipc":
                sock.send_multipart([hdr, *wire.chunk(g, chunk_bytes)], copy=False)
            else:
                sock.send(hdr)
            timed_way = WAYS[way] if timed else None
    finally:
        sock.close(linger=0)
        ctx.term()
        wseg.close()
        gseg.close()


# ----------------------------------------------------------------------------- leaf
class Leaf:
    """The leaf side of one case (n parameters, k learners): segments, socket, processes.

    ``round(way, rnd, timed)`` runs one exchange round and returns its seconds. Use as a
    context manager: leaving it stops the learners and frees everything, on every path.
    """

    def __init__(self, n, k, args, ctx):
        self.n, self.k, self.args = n, k, args
        self.segs, self.procs, self.sock, self.tmp = [], [], None, None
        self.chunk_bytes = int(args.chunk_mib * 2**20)
        self.pattern = make_pattern(args.pattern, n)
        self.check = Checker(n, self.pattern)
        self.acc = np.zeros(n, np.float32)
        self.pool = [np.empty(n, np.float32) for _ in (0, 1)]  # weights "from the parent"
        for r, w in enumerate(self.pool):
            write(w, weight_value(r), self.pattern)
        self.pool_chunks = [wire.chunk(w, self.chunk_bytes) for w in self.pool]
        self.ctx = ctx

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self):
        n, k, base = self.n, self.k, f"{PREFIX}_{os.getpid()}_{self.n}_{self.k}"
        self.tmp = tempfile.mkdtemp(prefix="shm_leaf_")
        self.wseg = Segment(f"{base}_w", VERSION_BYTES + 4 * n, create=True)
        self.segs.append(self.wseg)
        for i in range(k):
            self.segs.append(Segment(f"{base}_g{i}", 2 * 4 * n, create=True))
        for s in self.segs:  # touch every page now, not in a round
            s.array(np.uint8, s.nbytes, 0).fill(0)
        self.lock = Seqlock(self.wseg, n)
        self.slots = [[s.array(np.float32, n, j * 4 * n) for j in (0, 1)] for s in self.segs[1:]]
        self.sock = transport.make_socket(self.ctx, zmq.ROUTER, hwm=4 * k)
        self.endpoint = transport.bind(self.sock, f"ipc://{self.tmp}/leaf.sock")
        spawn = mp.get_context("spawn")
        for i in range(k):
            p = spawn.Process(
                target=learner_main,
                daemon=True,
                name=f"learner {i}",
                args=(
                    i,
                    n,
                    self.endpoint,
                    self.wseg.path.rsplit("/", 1)[1],
                    self.segs[1 + i].path.rsplit("/", 1)[1],
                    self.chunk_bytes,
                    self.args.pattern,
                    os.getpid(),
                ),
            )
            p.start()
            self.procs.append(p)
        self.idents = [None] * k
        for _ in range(k):
            ident, hdr = self._recv()[:2]
            self.idents[HDR.unpack(hdr.bytes)[2]] = ident.bytes
        for s in self.segs:  # every learner has them mapped: no name left to leak
            s.unlink()

    def _recv(self):
        """The next message; raises naming a learner that died, or after TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while not self.sock.poll(500):
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} stopped during the benchmark")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no learner answered for {TIMEOUT_S:.0f} s")
        return self.sock.recv_multipart(copy=False)

    def round(self, way: str, rnd: int, timed: bool) -> float:
        w, slot = WAYS.index(way), rnd % 2
        t0 = time.perf_counter()
        if way == "ipc":
            hdr = HDR.pack(w, OP_ROUND, timed, slot, rnd, 0)
            for ident in self.idents:
                self.sock.send_multipart([ident, hdr, *self.pool_chunks[slot]], copy=False)
        else:
            version = self.lock.publish(self.pool[slot])
            hdr = HDR.pack(w, OP_ROUND, timed, slot, rnd, version)
            for ident in self.idents:
                self.sock.send_multipart([ident, hdr])
        for got in range(self.k):
            frames = self._recv()
            _, _, i, gslot, grnd, _ = HDR.unpack(frames[1].bytes)
            if grnd != rnd or gslot != slot:
                raise RuntimeError(
                    f"learner {i} answered round {grnd} slot {gslot}, "
                    f"expected round {rnd} slot {slot}"
                )
            parts = (
                [np.frombuffer(f.buffer, np.float32) for f in frames[2:]]
                if way == "ipc"
                else [self.slots[i][gslot]]
            )
            off = 0
            for part in parts:
                m = part.shape[0]
                (kernels.accumulate if got else kernels.copy_into)(self.acc[off : off + m], part)
                off += m
            if off != self.n:
                raise RuntimeError(f"learner {i} sent {off:,} floats, expected {self.n:,}")
        dt = time.perf_counter() - t0
        self.check(self.acc, sum(grad_value(i, rnd) for i in range(self.k)), mult=self.k)
        return dt

    def stop(self) -> list[dict]:
        """STOP every learner; returns their reports."""
        for ident in self.idents:
            self.sock.send_multipart([ident, HDR.pack(0, OP_STOP, 0, 0, 0, 0)])
        reports = [json.loads(self._recv()[1].bytes) for _ in range(self.k)]
        for p in self.procs:
            p.join(10)
        return sorted(reports, key=lambda r: r["learner"])

    def __exit__(self, *exc):
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.sock is not None:
            self.sock.close(linger=0)
        for s in self.segs:
            s.close()
        if self.tmp is not None:
            try:
                os.unlink(os.path.join(self.tmp, "leaf.sock"))
            except OSError:
                pass
            os.rmdir(self.tmp)
        return False


def run_case(n, k, args, ctx) -> dict:
    """Warm-up, then ``repeat`` alternating blocks of each way; one record for both ways."""
    times = {w: [] for w in WAYS}
    blocks = {w: [] for w in WAYS}
    cpu = dict.fromkeys(WAYS, 0.0)
    with Leaf(n, k, args, ctx) as leaf:
        rnd = 0
        for way in WAYS:
            for _ in range(args.warmup):
                leaf.round(way, rnd, False)
                rnd += 1
        for b in range(args.repeat):
            for way in WAYS if b % 2 == 0 else WAYS[::-1]:
                c0, ts = time.process_time(), []
                for _ in range(args.rounds):
                    ts.append(leaf.round(way, rnd, True))
                    rnd += 1
                cpu[way] += time.process_time() - c0
                times[way] += ts
                blocks[way].append(float(np.median(ts)) * 1e3)
        reports = leaf.stop()
        leaf_errors = leaf.check.errors
    rec = {
        "bench": "shm_leaf",
        "params": n,
        "bytes": 4 * n,
        "learners": k,
        "rounds_per_way": len(times["ipc"]),
        "blocks": args.repeat,
        "check_errors": leaf_errors + sum(r["check_errors"] for r in reports),
        "version_errors": sum(r["version_errors"] for r in reports),
        "seqlock_retries": sum(r["retries"] for r in reports),
    }
    for w in WAYS:
        s = common.summary(np.asarray(times[w]) * 1e3)
        lr = [r["cpu_s"][w] / max(r["rounds"][w], 1) * 1e3 for r in reports]
        rec |= {
            f"{w}_ms": s["p50"],
            f"{w}_p90_ms": s["p90"],
            f"{w}_block_min_ms": min(blocks[w]),
            f"{w}_block_max_ms": max(blocks[w]),
            f"{w}_leaf_cpu_ms": cpu[w] / len(times[w]) * 1e3,
            f"{w}_learner_cpu_ms": float(np.mean(lr)),
        }
    rec["speedup"] = rec["ipc_ms"] / rec["shm_ms"]
    return rec


def line(r: dict) -> str:
    def way(w):
        return (
            f"{w} {r[f'{w}_ms']:7.2f} ms p90 {r[f'{w}_p90_ms']:7.2f} (blocks "
            f"{r[f'{w}_block_min_ms']:.2f}-{r[f'{w}_block_max_ms']:.2f}) leaf cpu "
            f"{r[f'{w}_leaf_cpu_ms']:6.2f} learner cpu {r[f'{w}_learner_cpu_ms']:6.2f}"
        )

    return (
        f"{common.fmt_count(r['params']):>4} params  k={r['learners']}  {way('ipc')}  |  "
        f"{way('shm')}  |  ipc/shm {r['speedup']:.2f}x  checks {r['check_errors']} errors, "
        f"seqlock retries {r['seqlock_retries']}"
    )


def rows(r: dict) -> list[dict]:
    """One CSV row per way."""
    head = {
        k: r[k] for k in ("params", "bytes", "learners", "rounds_per_way", "blocks", "check_errors")
    }
    return [
        head
        | {
            "way": w,
            "median_ms": r[f"{w}_ms"],
            "p90_ms": r[f"{w}_p90_ms"],
            "block_min_ms": r[f"{w}_block_min_ms"],
            "block_max_ms": r[f"{w}_block_max_ms"],
            "leaf_cpu_ms": r[f"{w}_leaf_cpu_ms"],
            "learner_cpu_ms": r[f"{w}_learner_cpu_ms"],
        }
        for w in WAYS
    ]


def add_arguments(p) -> None:
    p.add_argument("--sizes", nargs="+", default=SIZES, help=f"parameters (default {SIZES})")
    p.add_argument(
        "--learners",
        nargs="+",
        type=int,
        default=LEARNERS,
        help=f"learners per leaf (default {LEARNERS})",
    )
    p.add_argument("--rounds", type=int, default=ROUNDS, help="timed rounds per block")
    p.add_argument("--repeat", type=int, default=REPEAT, help="blocks per way, alternating ipc/shm")
    p.add_argument("--warmup", type=int, default=WARMUP, help="untimed rounds per way")
    p.add_argument("--chunk-mib", type=float, default=CHUNK_MIB, help="ipc frame size")
    p.add_argument("--leaf-threads", type=int, default=LEAF_THREADS)
    p.add_argument(
        "--pattern",
        choices=["fill", "ramp"],
        default="fill",
        help="gradient/weights contents: a constant (one pure write pass) or a "
        "position-dependent ramp (catches misplaced chunks; an extra read)",
    )
    p.add_argument("--csv", metavar="PATH", help="write one row per case and way here")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args) -> int:
    """Run every case (blocks until done); SIGTERM exits 143 after cleaning up."""
    if min(args.learners) < 1 or args.rounds < 1 or args.repeat < 1 or args.warmup < 0:
        raise ValueError("--learners, --rounds and --repeat must be >= 1, --warmup >= 0")
    args.png = None
    sizes = [common.parse_size(s) for s in args.sizes]
    if not os.path.isdir(SHM_DIR):
        raise SystemExit(f"{SHM_DIR} does not exist: this benchmark needs POSIX shared memory")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so every `finally` runs
    stale = remove_stale_segments()
    transport.tune_malloc()
    kernels.set_num_threads(args.leaf_threads)
    report = common.Report(
        args,
        "bench shm-leaf (leaf <-> k learners: ipc:// vs shared memory)",
        notes=[
            f"a round: weights out to k learners, k gradients in and summed at the leaf; "
            f"{args.warmup} warm-up rounds per way, then {args.repeat} blocks x {args.rounds} "
            f"rounds per way, alternating; median / p90 over all rounds",
            f"ipc: zero-copy {args.chunk_mib:g} MiB frames; shm: gradients in per-learner "
            f"segments, weights behind a seqlock, 20-byte notifications over ipc://",
            f"leaf kernel threads {args.leaf_threads}, learner 1; pattern {args.pattern}; "
            f"cpu = ms of CPU (all threads, user+sys) per round",
            *([f"removed stale segments: {' '.join(stale)}"] if stale else []),
        ],
    )
    ctx = zmq.Context()
    try:
        for n in sizes:
            for k in args.learners:
                r = run_case(n, k, args, ctx)
                report.case(r, line(r), rows=rows(r))
    finally:
        ctx.destroy(linger=0)
    report.close()
    return 0
