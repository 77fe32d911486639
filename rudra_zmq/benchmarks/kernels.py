"""``rudra-zmq bench kernels``: the update kernels beside NumPy, torch and a plain copy.

For each size, thread count and kernel it prints one line: our median time per call and GB/s
(bytes the kernel logically reads + writes, e.g. the fused momentum step reads w, v, acc and
writes w, v -- and acc with zero_acc -- so 5 or 6 x 4 bytes x n), then the same operation as
(a) the multi-op NumPy twin (:mod:`.numpy_twins`, also the tests' oracle), (b) torch
(``torch.optim.SGD(foreach=True)`` for the optimizer steps, in-place tensor ops otherwise), and
(c) a plain copy moving the same bytes (``np.copyto`` and our threaded ``copy_into`` of
touched/2 bytes: read half, write half). Implementations are timed round-robin (A B C A B C...)
after a warm-up, so load from other users hits all alike; the number of rounds is calibrated
to ``--seconds`` per case (``--reps`` fixes it). At the end the issue's targets for 10M float32
on 2 threads are checked and printed as PASS/MISS.

    rudra-zmq bench kernels                               # 1M 10M 100M, 1 and 2 threads
    rudra-zmq bench kernels --sizes 10M --threads 2 --reps 30 --csv bench/out/k.csv
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from .. import kernels
from . import common
from . import numpy_twins as twins

SIZES = ["1M", "10M", "100M"]
THREADS = [1, 2]
SECONDS = 1.5  # timed seconds per case (all implementations), at least MIN_REPS
MIN_REPS = 5
WARMUP = 2  # untimed calls per implementation
LR, MOMENTUM, WD, G_SCALE, S = 0.01, 0.9, 0.004, 0.25, 0.999
TARGET_N, TARGET_THREADS = 10_000_000, 2
TARGETS = [
    ("vs NumPy", "numpy", 3.0),
    ("vs torch foreach SGD", "torch", 1.5),
    ("vs copy bandwidth", "copy", 0.8),
]

# kernel -> (floats read + written per element, our call, numpy call, torch call)
# Every call takes the shared state dict `a` (numpy arrays) and `t` (torch views + optimizers).
KERNELS = {
    "sgd_momentum_step": (
        5,
        lambda a: kernels.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda a: twins.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda t: t["sgd_m"].step(),
    ),
    "sgd_momentum_step(zero_acc)": (
        6,
        lambda a: kernels.sgd_momentum_step(
            a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE, zero_acc=True
        ),
        lambda a: twins.sgd_momentum_step(
            a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE, zero_acc=True
        ),
        lambda t: (t["sgd_m"].step(), t["p"].grad.zero_()),
    ),
    "sgd_step": (
        3,
        lambda a: kernels.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda a: twins.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda t: t["sgd"].step(),
    ),
    "accumulate": (
        3,
        lambda a: kernels.accumulate(a["v"], a["acc"]),
        lambda a: twins.accumulate(a["v"], a["acc"]),
        lambda t: t["v"].add_(t["acc"]),
    ),
    "accumulate_scaled": (
        3,
        lambda a: kernels.accumulate_scaled(a["v"], a["acc"], S),
        lambda a: twins.accumulate_scaled(a["v"], a["acc"], S),
        lambda t: t["v"].add_(t["acc"], alpha=S),
    ),
    "scale": (
        2,
        lambda a: kernels.scale(a["v"], S),
        lambda a: twins.scale(a["v"], S),
        lambda t: t["v"].mul_(S),
    ),
    "copy_into": (
        2,
        lambda a: kernels.copy_into(a["v"], a["w"]),
        lambda a: twins.copy_into(a["v"], a["w"]),
        lambda t: t["v"].copy_(t["p"].detach()),
    ),
}
# torch's step for the zero_acc variant also zeroes the gradient, so both do the same work.
# Extra baseline for the optimizer steps (not a target): torch's single-kernel fused=True SGD.
# foreach=True with weight_decay allocates a fresh grad+wd*p temporary every step, so on
# large models it pays page faults that fused=True (and our kernels) do not.
TORCH_FUSED = {
    "sgd_momentum_step": lambda t: t["sgd_m_fused"].step(),
    "sgd_momentum_step(zero_acc)": lambda t: (t["sgd_m_fused"].step(), t["p"].grad.zero_()),
    "sgd_step": lambda t: t["sgd_fused"].step(),
}
NOTES = [
    "GB/s = logical bytes read+written / median time; copy = copy of touched/2 bytes;",
    "ratios: numpy/torch = their time / ours; copy = our GB/s / best copy GB/s;",
    "torch = SGD(foreach=True) for the optimizer steps, in-place tensor ops otherwise;",
    "torch fused = SGD(fused=True), shown for reference (not a target)",
]


def time_round_robin(calls: dict, reps: int | None, seconds: float, warmup: int = WARMUP):
    """({name: (median s, min s, max s)}, rounds) per call of each fn(arg) in ``calls``.

    Each implementation gets ``warmup`` untimed calls; the number of timed rounds is ``reps``
    or what fits ``seconds`` at the warm-up's pace (at least MIN_REPS). Rounds go A B C A B C
    so that load from other users of a shared box hits all implementations alike.
    """
    t0 = time.perf_counter()
    for fn, arg in calls.values():
        for _ in range(warmup):
            fn(arg)
    per_round = (time.perf_counter() - t0) / warmup
    reps = reps or common.calibrate(per_round, seconds, lo=MIN_REPS, hi=10_000)
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, (fn, arg) in calls.items():
            t = time.perf_counter()
            fn(arg)
            times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(ts), min(ts), max(ts)) for name, ts in times.items()}, reps


def state(n: int, rng):
    """Shared arrays for one size: w, v, acc (numpy) and torch views of the same memory."""
    import torch

    a = {k: (rng.standard_normal(n, dtype=np.float32) * 0.01) for k in ("w", "v", "acc")}
    p = torch.from_numpy(a["w"]).requires_grad_(True)
    p.grad = torch.from_numpy(a["acc"])
    t = {
        "p": p,
        "v": torch.from_numpy(a["v"]),
        "acc": torch.from_numpy(a["acc"]),
        # torch folds lr outside the buffer (buf = m*buf + g + wd*w; w -= lr*buf), Caffe
        # inside; both read w, v, acc and write w, v, so the memory traffic is the same.
        "sgd_m": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
        "sgd": torch.optim.SGD([p], lr=LR, weight_decay=WD, foreach=True),
        "sgd_m_fused": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD, fused=True),
        "sgd_fused": torch.optim.SGD([p], lr=LR, weight_decay=WD, fused=True),
    }
    return a, t


def line(name, n, nt, ms, gbs, ratio) -> str:
    return (
        f"{name:<28} n={common.fmt_count(n):>4} thr={nt}  ours {ms['ours']:8.3f} ms "
        f"{gbs['ours']:5.1f} GB/s | numpy {ms['numpy']:8.3f} ms "
        f"{gbs['numpy']:5.1f} GB/s ({ratio['numpy']:4.1f}x) | torch "
        f"{ms['torch']:8.3f} ms {gbs['torch']:5.1f} GB/s ({ratio['torch']:4.2f}x) | "
        f"copyto {gbs['np.copyto']:5.1f} copy_into {gbs['copy_into']:5.1f} GB/s "
        f"(ours/copy {ratio['copy']:4.2f})"
        + (
            f" | torch fused {ms['torch_fused']:7.3f} ms ({ratio['torch_fused']:4.2f}x)"
            if "torch_fused" in ms
            else ""
        )
    )


def add_arguments(p) -> None:
    p.add_argument("--sizes", nargs="+", default=SIZES, help="float32 counts, e.g. 1M 10M 100M")
    p.add_argument("--threads", nargs="+", type=int, default=THREADS)
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed rounds per case (default: calibrated to --seconds)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=SECONDS,
        help=f"timed seconds per case, all implementations (default {SECONDS:g})",
    )
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    common.add_output_args(p)


def run(args) -> int:
    import torch

    sizes = [common.parse_size(s) for s in args.sizes]
    report = common.Report(
        args,
        "kernels benchmark",
        notes=NOTES,
        torch=torch.__version__,
        plot=(
            "n",
            [("gb_per_s", "GB/s"), ("median_ms", "ms per call")],
            "label",
            lambda r: (
                r["impl"] in ("ours", "numpy", "torch")
                and r["kernel"] in ("sgd_momentum_step", "accumulate")
            ),
        ),
    )
    results = {}
    rng = np.random.default_rng(0)
    for n in sizes:
        a, t = state(n, rng)
        half = (6 * n + 1) // 2  # biggest copy any kernel needs
        src, dst = np.ones(half, np.float32), np.zeros(half, np.float32)
        for nt in args.threads:
            kernels.set_num_threads(nt)
            torch.set_num_threads(nt)
            for name in args.kernels:
                units, ours, ref_np, ref_t = KERNELS[name]
                nbytes = units * 4 * n
                m = (units * n + 1) // 2
                s_, d_ = src[:m], dst[:m]
                calls = {
                    "ours": (ours, a),
                    "numpy": (ref_np, a),
                    "torch": (ref_t, t),
                    "np.copyto": (lambda _, d=d_, s=s_: np.copyto(d, s), None),
                    "copy_into": (lambda _, d=d_, s=s_: kernels.copy_into(d, s), None),
                }
                if name in TORCH_FUSED:
                    calls["torch_fused"] = (TORCH_FUSED[name], t)
                res, reps = time_round_robin(calls, args.reps, args.seconds)
                gbs = {k: nbytes / v[0] / 1e9 for k, v in res.items()}
                ratio = {
                    "numpy": res["numpy"][0] / res["ours"][0],
                    "torch": res["torch"][0] / res["ours"][0],
                    "copy": gbs["ours"] / max(gbs["np.copyto"], gbs["copy_into"]),
                }
                if "torch_fused" in res:
                    ratio["torch_fused"] = res["torch_fused"][0] / res["ours"][0]
                results[(name, n, nt)] = ratio
                ms = {k: v[0] * 1e3 for k, v in res.items()}
                rows = [
                    {
                        "kernel": name,
                        "n": n,
                        "threads": nt,
                        "impl": impl,
                        "label": f"{name} {impl} thr={nt}",
                        "median_s": med,
                        "min_s": lo,
                        "max_s": hi,
                        "median_ms": med * 1e3,
                        "gb_per_s": gbs[impl],
                        "bytes": nbytes,
                        "reps": reps,
                    }
                    for impl, (med, lo, hi) in res.items()
                ]
                report.case(
                    {
                        "kernel": name,
                        "n": n,
                        "threads": nt,
                        "bytes": nbytes,
                        "reps": reps,
                        "median_ms": ms,
                        "gb_per_s": gbs,
                        "ratio": ratio,
                    },
                    line(name, n, nt, ms, gbs, ratio),
                    rows=rows,
                )
        del a, t, src, dst, s_, d_, calls  # free this size before allocating the next
    targets(report, results)
    report.close()
    return 0


def targets(report, results) -> None:
    report.emit(
        {"type": "targets_header"},
        f"# targets: {common.fmt_count(TARGET_N)} float32, {TARGET_THREADS} threads",
    )
    for name in ("sgd_momentum_step", "sgd_momentum_step(zero_acc)"):
        ratio = results.get((name, TARGET_N, TARGET_THREADS))
        for label, key, want in TARGETS:
            got = None if ratio is None else ratio[key]
            verdict = "SKIP" if got is None else ("PASS" if got >= want else "MISS")
            report.emit(
                {
                    "type": "target",
                    "kernel": name,
                    "target": label,
                    "want": want,
                    "got": got,
                    "verdict": verdict,
                },
                f"{verdict}  {name:<28} {label:<22} want >= {want:.1f}x  got "
                + (
                    f"{got:.2f}x"
                    if got is not None
                    else f"- ({common.fmt_count(TARGET_N)}/{TARGET_THREADS} threads not in "
                    "this run)"
                ),
            )
