"""``rudra-zmq bench kernels``: every kernel, in every instruction-set variant this CPU runs,
beside the memory floor, NumPy, torch and (``--against``) another checkout's kernels.

For each size, thread count and kernel it prints one line: the floor time, then each variant's
median time per call and its fraction of the floor (floor time / its time: 1.00 = at the
floor), then the NumPy twin (:mod:`.numpy_twins`, also the tests' oracle), torch (in-place
tensor ops; ``SGD(foreach=True)`` for the optimizer steps, with ``SGD(fused=True)`` beside
them) and, with ``--against``, the other checkout's kernels, as their time / the default
variant's.

The floor: a STREAM-like triad on the same buffers, timed in the same rounds as the kernel. In
place, ``a += s*b`` (12 bytes per element: read a and b, write a), as torch's ``add_`` and as
the default variant's ``accumulate_scaled``; the faster one's GB/s, times the kernel's logical
bytes (what it reads plus what it writes, e.g. the fused momentum step reads w, v, acc and
writes w, v: 20 bytes per element), is the floor time. STREAM's own triad writes a third array
(``a = b + s*c``) and so also pays for reading the lines it overwrites; it is printed per size
for reference ("stream triad"), never used as the floor (it is the slower, easier one).

Implementations are timed round-robin, in a fresh random order every round (``--seed``), after a
warm-up, so load from other users hits all alike and each follows every other about equally
often; the number of rounds is calibrated to ``--seconds`` per case (``--reps`` fixes it). At
the end the issue's goals for 10M float32 on 2 threads are printed as PASS/MISS.

    rudra-zmq bench kernels                               # 1M 10M, 1 and 2 threads
    rudra-zmq bench kernels --sizes 10M --threads 2 --seconds 3 --against ../prev-checkout
"""

from __future__ import annotations

import glob
import importlib.util
import os
import random
import statistics
import time

import numpy as np

from .. import kernels
from ..kernels import variants as kv
from . import common
from . import numpy_twins as twins

SIZES = ["1M", "10M"]
THREADS = [1, 2]
SECONDS = 1.5  # timed seconds per case (all implementations), at least MIN_REPS rounds
MIN_REPS = 5
WARMUP = 2  # untimed calls per implementation
SEED = 0  # of the rounds' order; repeats of one comparison pass --seed 1, 2, ...
LR, MOMENTUM, WD, G_SCALE, S = 0.01, 0.9, 0.004, 0.25, 0.999
TARGET_N, TARGET_THREADS = 10_000_000, 2
# (kernel, what, want): the default variant's fraction of the floor, or its speed-up on
# torch's fused SGD; every forced variant against --against's kernels (time ratio)
GOALS = [
    ("sgd_momentum_step", "floor", 0.9),
    ("sgd_momentum_step", "torch fused", 1.2),
    ("accumulate_f16", "floor", 0.85),
    ("accumulate_bf16", "floor", 0.85),
    ("narrow_f16_feedback", "floor", 0.85),
    ("narrow_bf16_feedback", "floor", 0.85),
]
# two builds of the same code measured side by side differ by this much (bench/RESULTS.md)
AGAINST_SLACK = 0.95


def _fb_twin(a, dst, fmt):
    """The NumPy twin of narrow_*_feedback (without the saturation of finite values past the
    half range, which these inputs never reach): v = src + res; dst = half(v); res = v - dst."""
    v = a["acc"] + a["res"]
    getattr(twins, f"narrow_{fmt}")(dst, v)
    back = np.empty_like(v)
    getattr(twins, f"widen_{fmt}")(back, dst)
    np.subtract(v, back, out=a["res"])


def _fb_torch(t, dst):
    v = t["acc"] + t["res"]
    dst.copy_(v)
    t["res"].copy_(v - dst.float())


# kernel -> (bytes read + written per element, our call on module k, NumPy twin, torch call)
# Every call takes the shared state dict `a` (numpy arrays) or `t` (torch views + optimizers).
KERNELS = {
    "sgd_momentum_step": (
        20,
        lambda k, a: k.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda a: twins.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda t: t["sgd_m"].step(),
    ),
    "sgd_momentum_step(zero_acc)": (
        24,
        lambda k, a: k.sgd_momentum_step(
            a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE, zero_acc=True
        ),
        lambda a: twins.sgd_momentum_step(
            a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE, zero_acc=True
        ),
        lambda t: (t["sgd_m"].step(), t["p"].grad.zero_()),
    ),
    "sgd_step": (
        12,
        lambda k, a: k.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda a: twins.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda t: t["sgd"].step(),
    ),
    "accumulate": (
        12,
        lambda k, a: k.accumulate(a["v"], a["acc"]),
        lambda a: twins.accumulate(a["v"], a["acc"]),
        lambda t: t["v"].add_(t["acc"]),
    ),
    "accumulate_scaled": (
        12,
        lambda k, a: k.accumulate_scaled(a["v"], a["acc"], S),
        lambda a: twins.accumulate_scaled(a["v"], a["acc"], S),
        lambda t: t["v"].add_(t["acc"], alpha=S),
    ),
    "scale": (
        8,
        lambda k, a: k.scale(a["v"], S),
        lambda a: twins.scale(a["v"], S),
        lambda t: t["v"].mul_(S),
    ),
    "copy_into": (
        8,
        lambda k, a: k.copy_into(a["v"], a["w"]),
        lambda a: twins.copy_into(a["v"], a["w"]),
        lambda t: t["v"].copy_(t["p"].detach()),
    ),
    # half precision: acc (float32, read and written) += S * g (2 bytes read)
    "accumulate_f16": (
        10,
        lambda k, a: k.accumulate_f16(a["v"], a["f16"], S),
        lambda a: twins.accumulate_f16(a["v"], a["f16"], S),
        lambda t: t["v"].add_(t["f16"], alpha=S),
    ),
    "accumulate_bf16": (
        10,
        lambda k, a: k.accumulate_bf16(a["v"], a["bf16"], S),
        lambda a: twins.accumulate_bf16(a["v"], a["bf16"], S),
        lambda t: t["v"].add_(t["bf16"], alpha=S),
    ),
    "widen_f16": (
        6,
        lambda k, a: k.widen_f16(a["w"], a["f16"]),
        lambda a: twins.widen_f16(a["w"], a["f16"]),
        lambda t: t["p"].detach().copy_(t["f16"]),
    ),
    "widen_bf16": (
        6,
        lambda k, a: k.widen_bf16(a["w"], a["bf16"]),
        lambda a: twins.widen_bf16(a["w"], a["bf16"]),
        lambda t: t["p"].detach().copy_(t["bf16"]),
    ),
    "narrow_f16": (
        6,
        lambda k, a: k.narrow_f16(a["f16_out"], a["acc"]),
        lambda a: twins.narrow_f16(a["f16_out"], a["acc"]),
        lambda t: t["f16_out"].copy_(t["acc"]),
    ),
    "narrow_bf16": (
        6,
        lambda k, a: k.narrow_bf16(a["bf16_out"], a["acc"]),
        lambda a: twins.narrow_bf16(a["bf16_out"], a["acc"]),
        lambda t: t["bf16_out"].copy_(t["acc"]),
    ),
    # src (acc) and the residual read, the residual and dst (2 bytes) written
    "narrow_f16_feedback": (
        14,
        lambda k, a: k.narrow_f16_feedback(a["f16_out"], a["acc"], a["res"]),
        lambda a: _fb_twin(a, a["f16_out"], "f16"),
        lambda t: _fb_torch(t, t["f16_out"]),
    ),
    "narrow_bf16_feedback": (
        14,
        lambda k, a: k.narrow_bf16_feedback(a["bf16_out"], a["acc"], a["res"]),
        lambda a: _fb_twin(a, a["bf16_out"], "bf16"),
        lambda t: _fb_torch(t, t["bf16_out"]),
    ),
}
DEFAULT_KERNELS = [
    "sgd_momentum_step",
    "accumulate",
    "accumulate_f16",
    "accumulate_bf16",
    "narrow_f16_feedback",
    "narrow_bf16_feedback",
]
# torch's single-kernel fused=True SGD beside the optimizer steps. foreach=True with weight
# decay allocates a fresh grad+wd*p temporary every step, so on large models it pays page
# faults that fused=True (and our kernels) do not.
TORCH_FUSED = {
    "sgd_momentum_step": lambda t: t["sgd_m_fused"].step(),
    "sgd_momentum_step(zero_acc)": lambda t: (t["sgd_m_fused"].step(), t["p"].grad.zero_()),
    "sgd_step": lambda t: t["sgd_fused"].step(),
}
FLOOR_IMPLS = ("triad torch", "triad ours")  # in-place a += s*b: the floor is the faster
NOTES = [
    "floor = the kernel's logical bytes (read + written) at the GB/s of the faster in-place",
    "  triad a += s*b of this case's rounds (torch add_, or our accumulate_scaled);",
    "variants: median ms (floor time / it: 1.00 = at the floor); * = the default variant;",
    "numpy, torch, torch fused, --against: median ms (its time / the default variant's);",
    "torch = SGD(foreach=True) for the optimizer steps, in-place tensor ops otherwise",
]


def time_round_robin(
    calls: dict, reps: int | None, seconds: float, warmup: int = WARMUP, seed: int = SEED
):
    """({name: (median s, min s, max s)}, rounds) per call of each fn(arg) in ``calls``.

    Each implementation gets ``warmup`` untimed calls; the number of timed rounds is ``reps``
    or what fits ``seconds`` at the warm-up's pace (at least MIN_REPS). Each round runs every
    implementation once, in a fresh random order (``seed``: the same rounds every run with the
    same seed), so load from other users hits all alike and each follows every other about
    equally often. A fixed
    order rotated every round (A B C, B C A, ...) is not enough: A always follows C, and what
    the call before leaves in the cache counts (32 MiB of L3 here against 60 MB passes). In
    the rotated order the first variant always followed the floor's triad (other arrays) and
    the --against build always followed the last variant (the same arrays), which ranked
    identical loops in call order (bench/RESULTS.md, "Kernels").
    """
    t0 = time.perf_counter()
    for fn, arg in calls.values():
        for _ in range(warmup):
            fn(arg)
    per_round = (time.perf_counter() - t0) / warmup
    reps = reps or common.calibrate(per_round, seconds, lo=MIN_REPS, hi=10_000)
    times = {name: [] for name in calls}
    order = list(calls)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            fn, arg = calls[name]
            t = time.perf_counter()
            fn(arg)
            times[name].append(time.perf_counter() - t)
    return {name: (statistics.median(ts), min(ts), max(ts)) for name, ts in times.items()}, reps


def state(n: int, rng):
    """Shared arrays for one size: w, v, acc, the residual and half buffers (numpy) and torch
    views of the same memory."""
    import torch

    a = {k: (rng.standard_normal(n, dtype=np.float32) * 0.01) for k in ("w", "v", "acc")}
    a["res"] = np.zeros(n, np.float32)
    a["f16"], a["f16_out"] = a["acc"].astype(np.float16), np.empty(n, np.float16)
    a["bf16"], a["bf16_out"] = np.empty(n, np.uint16), np.empty(n, np.uint16)
    twins.narrow_bf16(a["bf16"], a["acc"])
    p = torch.from_numpy(a["w"]).requires_grad_(True)
    p.grad = torch.from_numpy(a["acc"])

    def bf16(x):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)

    t = {
        "p": p,
        **{k: torch.from_numpy(a[k]) for k in ("v", "acc", "res", "f16", "f16_out")},
        "w2": torch.from_numpy(a["w"]),
        "bf16": bf16(a["bf16"]),
        "bf16_out": bf16(a["bf16_out"]),
        # torch folds lr outside the buffer (buf = m*buf + g + wd*w; w -= lr*buf), Caffe
        # inside; both read w, v, acc and write w, v, so the memory traffic is the same.
        "sgd_m": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
        "sgd": torch.optim.SGD([p], lr=LR, weight_decay=WD, foreach=True),
        "sgd_m_fused": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD, fused=True),
        "sgd_fused": torch.optim.SGD([p], lr=LR, weight_decay=WD, fused=True),
    }
    return a, t


def against_modules(checkout: str) -> dict:
    """{label: module} of another checkout's compiled kernels, built in place: the variants of
    ``CHECKOUT/rudra_zmq/kernels/_<variant>*.so`` this CPU runs, or an older build's single
    ``CHECKOUT/rudra_zmq/_kernels*.so`` (labelled by the checkout's folder name), each loaded
    under a name of its own beside ours."""
    found = {}
    base = os.path.basename(os.path.normpath(checkout))
    pkg = os.path.join(checkout, "rudra_zmq")
    paths = glob.glob(os.path.join(pkg, "kernels", "_*.so")) + glob.glob(
        os.path.join(pkg, "_kernels.*.so")
    )
    for path in sorted(paths):
        stem = os.path.basename(path).split(".", 1)[0]
        variant = None if stem == "_kernels" else stem[1:]
        if variant is not None and (
            variant not in kv.VARIANTS or kv.missing(variant, kernels.CPU_FEATURES)
        ):
            continue  # the CPU probe, or a variant this CPU cannot run
        spec = importlib.util.spec_from_file_location(f"rudra_zmq_against.{stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found[f"{base}:{variant}" if variant else base] = module
    if not found:
        raise SystemExit(
            f"--against {checkout}: no compiled kernels in {pkg}/ (build them there with "
            "`python setup.py build_ext --inplace`)"
        )
    return found


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
    p.add_argument(
        "--seed",
        type=int,
        default=SEED,
        help=f"of the rounds' random order (default {SEED}); vary it across repeats",
    )
    p.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS, choices=list(KERNELS))
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=list(kv.VARIANTS),
        help="kernel variants to time (default: every one this CPU runs)",
    )
    p.add_argument(
        "--against",
        metavar="CHECKOUT",
        help="also time the kernels of another checkout (built in place, e.g. a git worktree "
        "of an earlier commit), side by side",
    )
    common.add_output_args(p)


def _line(name, n, nt, floor_ms, ms, ratio, variants, default) -> str:
    cols = [
        f"{v}{'*' if v == default else ''} {ms[v]:7.3f} ({ratio[v]:4.2f})"
        for v in variants
        if v in ms
    ]
    cols += [f"{o} {ms[o]:8.3f} ({ratio[o]:5.2f}x)" for o in ms if o not in variants]
    return (
        f"{name:<28} n={common.fmt_count(n):>4} thr={nt} floor {floor_ms:7.3f} ms | "
        + " | ".join(cols)
    )


def run(args) -> int:
    import torch

    sizes = [common.parse_size(s) for s in args.sizes]
    available = kernels.available_variants()
    names = args.variants or available
    missing = [v for v in names if v not in available]
    if missing:
        raise SystemExit(
            f"--variants {' '.join(missing)}: not run by this CPU or not built here "
            f"(available: {', '.join(available)})"
        )
    mods = {v: kernels.load_variant(v) for v in names}
    default = kernels.VARIANT
    others = against_modules(args.against) if args.against else {}
    report = common.Report(
        args,
        "kernels benchmark",
        notes=NOTES,
        torch=torch.__version__,
        plot=(
            "n",
            [("gb_per_s", "GB/s"), ("median_ms", "ms per call")],
            "label",
            lambda r: r["kernel"] in ("sgd_momentum_step", "accumulate_f16"),
        ),
    )
    results = {}
    rng = np.random.default_rng(0)
    for n in sizes:
        a, t = state(n, rng)
        for nt in args.threads:
            for m in (*mods.values(), *others.values()):
                m.set_num_threads(nt)
            torch.set_num_threads(nt)
            stream = time_round_robin(
                {"stream": (lambda t_: torch.add(t_["v"], t_["acc"], alpha=S, out=t_["w2"]), t)},
                args.reps,
                args.seconds / 4,
                seed=args.seed,
            )[0]["stream"][0]
            report.note(
                f"n={common.fmt_count(n)} thr={nt}: stream triad a = b + s*c (torch) "
                f"{12 * n / stream / 1e9:.1f} GB/s (for reference, not the floor)",
                n=n,
                threads=nt,
                stream_triad_gb_per_s=12 * n / stream / 1e9,
            )
            for name in args.kernels:
                nbytes, ours, ref_np, ref_t = KERNELS[name]
                nbytes *= n
                calls = {v: (lambda a_, k=m, f=ours: f(k, a_), a) for v, m in mods.items()}
                calls.update({o: (lambda a_, k=m, f=ours: f(k, a_), a) for o, m in others.items()})
                calls["numpy"] = (ref_np, a)
                calls["torch"] = (ref_t, t)
                if name in TORCH_FUSED:
                    calls["torch fused"] = (TORCH_FUSED[name], t)
                calls["triad torch"] = (lambda t_: t_["v"].add_(t_["acc"], alpha=S), t)
                calls["triad ours"] = (
                    lambda a_: kernels.accumulate_scaled(a_["v"], a_["acc"], S),
                    a,
                )
                res, reps = time_round_robin(calls, args.reps, args.seconds, seed=args.seed)
                floor_gbs = max(12 * n / res[f][0] / 1e9 for f in FLOOR_IMPLS)
                floor_s = nbytes / floor_gbs / 1e9
                shown = {k: v for k, v in res.items() if k not in FLOOR_IMPLS}
                ms = {k: v[0] * 1e3 for k, v in shown.items()}
                ratio = {
                    k: (floor_s / v[0] if k in mods else v[0] / res[default][0])
                    for k, v in shown.items()
                }
                if default not in mods:  # --variants without the default: ratios to floor
                    ratio.update({k: floor_s / v[0] for k, v in shown.items()})
                results[(name, n, nt)] = {"ms": ms, "ratio": ratio, "floor_ms": floor_s * 1e3}
                gbs = {k: nbytes / v[0] / 1e9 for k, v in shown.items()}
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
                        "floor_ms": floor_s * 1e3,
                        "reps": reps,
                    }
                    for impl, (med, lo, hi) in shown.items()
                ]
                report.case(
                    {
                        "kernel": name,
                        "n": n,
                        "threads": nt,
                        "bytes": nbytes,
                        "reps": reps,
                        "default_variant": default,
                        "floor_gb_per_s": floor_gbs,
                        "floor_ms": floor_s * 1e3,
                        "median_ms": ms,
                        "gb_per_s": gbs,
                        "ratio": ratio,
                    },
                    _line(name, n, nt, floor_s * 1e3, ms, ratio, list(mods), default),
                    rows=rows,
                )
        del a, t  # free this size before allocating the next
    goals(report, results, default, list(mods), list(others))
    report.close()
    return 0


def goals(report, results, default, variants, others) -> None:
    """The issue's goals at 10M floats on 2 threads: PASS, MISS, or SKIP when not measured."""
    report.emit(
        {"type": "goals_header"},
        f"# goals: {common.fmt_count(TARGET_N)} float32, {TARGET_THREADS} threads, "
        f"the default variant ({default})",
    )

    def verdict(kernel, label, want, got):
        v = "SKIP" if got is None else ("PASS" if got >= want else "MISS")
        report.emit(
            {"type": "goal", "kernel": kernel, "goal": label, "want": want, "got": got},
            f"{v}  {kernel:<28} {label:<34} want >= {want:.2f}  got "
            + (f"{got:.2f}" if got is not None else "- (not in this run)"),
        )

    for kernel, what, want in GOALS:
        r = results.get((kernel, TARGET_N, TARGET_THREADS))
        got = None
        if r is not None and default in r["ms"]:
            got = (
                r["ratio"][default] if what == "floor" else r["ms"].get(what, 0) / r["ms"][default]
            )
        verdict(kernel, f"{what} ({'fraction' if what == 'floor' else 'speed-up'})", want, got)
    # every variant against the other checkout: not slower (its time / ours)
    for (kernel, n, nt), r in sorted(results.items()):
        if (n, nt) != (TARGET_N, TARGET_THREADS):
            continue
        for v in variants:
            for o in others:
                got = r["ms"][o] / r["ms"][v]
                verdict(kernel, f"{v} vs {o} (time ratio)", AGAINST_SLACK, got)
