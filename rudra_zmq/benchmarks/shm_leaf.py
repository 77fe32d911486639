"""Shared memory vs ipc:// between a leaf and its co-located learners (issue #5).

A leaf (this process) and k learner processes on this machine run lock-step rounds: the leaf
sends the weights to every learner, each takes them into its flat parameter buffer, writes its
gradient and hands it back, and the leaf sums the k gradients with ``rudra_zmq.kernels`` as
``tree/node.py`` does (both sides: :mod:`.shm_exchange`). A round is timed at the leaf,
from the start of sending the weights to the last gradient summed. Two ways, alternated in
blocks of ``--rounds`` (order flipped every repeat) after an untimed warm-up of each:

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

import os
import signal
import sys
import time

import numpy as np
import zmq

from .. import kernels, transport
from . import common
from .shm_exchange import WAYS, Leaf
from .shm_segment import SHM_DIR, remove_stale_segments

SIZES = ["1M", "10M"]  # float32 parameters
LEARNERS = [1, 2, 4]  # learners per leaf
ROUNDS = 30  # timed rounds per block
REPEAT = 5  # blocks per way, alternating ipc / shm
WARMUP = 8  # untimed rounds of each way before the first block
CHUNK_MIB = 8  # runtime.chunk_mib (the default): frame size of the ipc way
LEAF_THREADS = 1  # kernel threads at the leaf


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
