"""Update-kernel benchmark: rudra_zmq.kernels beside NumPy, torch and a plain copy.

For each size, thread count and kernel it prints one line: our median time per call and GB/s
(bytes the kernel logically reads + writes, e.g. the fused momentum step reads w, v, acc and
writes w, v -- and acc with zero_acc -- so 5 or 6 x 4 bytes x n), then the same operation as
(a) the multi-op NumPy twin from tests/oracles.py, (b) torch (``torch.optim.SGD(foreach=True)``
for the optimizer steps, in-place tensor ops otherwise), and (c) a plain copy moving the same
bytes (``np.copyto`` and our threaded ``copy_into`` of touched/2 bytes: read half, write half).
All figures come from the same run; ratios are printed on the line. At the end the issue's
targets for 10M float32 on 2 threads are checked and printed as PASS/MISS.

    python bench/kernels.py                       # defaults below, ~2 minutes on 2 cores
    python bench/kernels.py --sizes 10M --threads 2 --reps 30 --csv bench/out/k.csv
"""
import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

import rudra_zmq
from rudra_zmq import kernels

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import oracles  # noqa: E402  (the NumPy twins: test oracle and baseline)

# ----------------------------------------------------------------------------- defaults
SIZES = ["1M", "10M", "100M"]
THREADS = [1, 2]
REPS = {1_000_000: 40, 10_000_000: 15, 100_000_000: 5}   # timed calls per case (median)
WARMUP = 2                                               # untimed calls per implementation
LR, MOMENTUM, WD, G_SCALE, S = 0.01, 0.9, 0.004, 0.25, 0.999
TARGET_N, TARGET_THREADS = 10_000_000, 2
TARGETS = [("vs NumPy", "numpy", 3.0), ("vs torch foreach SGD", "torch", 1.5),
           ("vs copy bandwidth", "copy", 0.8)]

# kernel -> (floats read + written per element, our call, numpy call, torch call)
# Every call takes the shared state dict `a` (numpy arrays) and `t` (torch views + optimizers).
KERNELS = {
    "sgd_momentum_step": (5,
        lambda a: kernels.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda a: oracles.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE),
        lambda t: t["sgd_m"].step()),
    "sgd_momentum_step(zero_acc)": (6,
        lambda a: kernels.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE,
                                            zero_acc=True),
        lambda a: oracles.sgd_momentum_step(a["w"], a["v"], a["acc"], LR, MOMENTUM, WD, G_SCALE,
                                            zero_acc=True),
        lambda t: (t["sgd_m"].step(), t["p"].grad.zero_())),
    "sgd_step": (3,
        lambda a: kernels.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda a: oracles.sgd_step(a["w"], a["acc"], LR, WD, G_SCALE),
        lambda t: t["sgd"].step()),
    "accumulate": (3,
        lambda a: kernels.accumulate(a["v"], a["acc"]),
        lambda a: oracles.accumulate(a["v"], a["acc"]),
        lambda t: t["v"].add_(t["acc"])),
    "accumulate_scaled": (3,
        lambda a: kernels.accumulate_scaled(a["v"], a["acc"], S),
        lambda a: oracles.accumulate_scaled(a["v"], a["acc"], S),
        lambda t: t["v"].add_(t["acc"], alpha=S)),
    "scale": (2,
        lambda a: kernels.scale(a["v"], S),
        lambda a: oracles.scale(a["v"], S),
        lambda t: t["v"].mul_(S)),
    "copy_into": (2,
        lambda a: kernels.copy_into(a["v"], a["w"]),
        lambda a: oracles.copy_into(a["v"], a["w"]),
        lambda t: t["v"].copy_(t["p"].detach())),
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


def parse_size(s):
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    s = s.strip().upper()
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def fmt_n(n):
    for unit, div in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def time_round_robin(calls, reps, warmup=WARMUP):
    """{name: (median s, min s)} per call of each fn(arg) in `calls` ({name: (fn, arg)}).

    Each implementation gets `warmup` untimed calls, then the timed calls go round-robin
    (A B C A B C ...) so that load from other users of this shared box hits all of them alike
    and the ratios stay fair even when the absolute times drift.
    """
    for fn, arg in calls.values():
        for _ in range(warmup):
            fn(arg)
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, (fn, arg) in calls.items():
            t0 = time.perf_counter()
            fn(arg)
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def state(n, rng):
    """Shared arrays for one size: w, v, acc (numpy) and torch views of the same memory."""
    a = {k: (rng.standard_normal(n, dtype=np.float32) * 0.01) for k in ("w", "v", "acc")}
    p = torch.from_numpy(a["w"]).requires_grad_(True)
    p.grad = torch.from_numpy(a["acc"])
    t = {"p": p, "v": torch.from_numpy(a["v"]), "acc": torch.from_numpy(a["acc"]),
         # torch folds lr outside the buffer (buf = m*buf + g + wd*w; w -= lr*buf), Caffe
         # inside; both read w, v, acc and write w, v, so the memory traffic is the same.
         "sgd_m": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD, foreach=True),
         "sgd": torch.optim.SGD([p], lr=LR, weight_decay=WD, foreach=True),
         "sgd_m_fused": torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, weight_decay=WD,
                                        fused=True),
         "sgd_fused": torch.optim.SGD([p], lr=LR, weight_decay=WD, fused=True)}
    return a, t


def machine_facts():
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    env = {k: os.environ.get(k, "(unset)") for k in (
        "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_NUM_THREADS",
        "OPENBLAS_CORETYPE", "MKL_NUM_THREADS")}
    return {"nproc": os.cpu_count(), "cpu_model": model, "loadavg": os.getloadavg(),
            "python": platform.python_version(), "numpy": np.__version__,
            "torch": torch.__version__, "build_info": rudra_zmq.build_info(), "env": env}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=SIZES, help="float32 counts, e.g. 1M 10M 100M")
    ap.add_argument("--threads", nargs="+", type=int, default=THREADS)
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed calls per case for every size (default by size: {REPS})")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--csv", metavar="PATH", help="also write one row per (case, impl) here")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]

    facts = machine_facts()
    out = (lambda obj, text: print(json.dumps(obj), flush=True)) if args.json else \
          (lambda obj, text: print(text, flush=True))
    bi = facts["build_info"]
    out({"type": "header", **facts},
        f"# rudra_zmq kernels benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"# cpu: {facts['cpu_model']} x{facts['nproc']}  loadavg: "
        f"{' '.join(f'{x:.2f}' for x in facts['loadavg'])}\n"
        f"# python {facts['python']}  numpy {facts['numpy']}  torch {facts['torch']}\n"
        f"# build_info: {bi}\n"
        f"# env: {' '.join(f'{k}={v}' for k, v in facts['env'].items())}\n"
        f"# GB/s = logical bytes read+written / median time; copy = copy of touched/2 bytes;\n"
        f"# ratios: numpy/torch = their time / ours; copy = our GB/s / best copy GB/s;\n"
        f"# torch = SGD(foreach=True) for the optimizer steps, in-place tensor ops otherwise;\n"
        f"# torch fused = SGD(fused=True), shown for reference (not a target)")

    rows, results = [], {}
    rng = np.random.default_rng(0)
    for n in sizes:
        reps = args.reps or REPS.get(n, max(3, int(15 * 10_000_000 / n)))
        a, t = state(n, rng)
        half = (6 * n + 1) // 2                      # biggest copy any kernel needs
        src = np.ones(half, np.float32)
        dst = np.zeros(half, np.float32)
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
                    "np.copyto": (lambda _: np.copyto(d_, s_), None),
                    "copy_into": (lambda _: kernels.copy_into(d_, s_), None),
                }
                if name in TORCH_FUSED:
                    calls["torch_fused"] = (TORCH_FUSED[name], t)
                res = time_round_robin(calls, reps)
                gbs = {k: nbytes / v[0] / 1e9 for k, v in res.items()}
                best_copy = max(gbs["np.copyto"], gbs["copy_into"])
                ratio = {"numpy": res["numpy"][0] / res["ours"][0],
                         "torch": res["torch"][0] / res["ours"][0],
                         "copy": gbs["ours"] / best_copy}
                if "torch_fused" in res:
                    ratio["torch_fused"] = res["torch_fused"][0] / res["ours"][0]
                results[(name, n, nt)] = ratio
                for impl, (med, best) in res.items():
                    rows.append({"kernel": name, "n": n, "threads": nt, "impl": impl,
                                 "median_s": med, "min_s": best, "gb_per_s": gbs[impl],
                                 "bytes": nbytes, "reps": reps})
                ms = {k: v[0] * 1e3 for k, v in res.items()}
                out({"type": "case", "kernel": name, "n": n, "threads": nt, "bytes": nbytes,
                     "reps": reps, "median_ms": ms, "gb_per_s": gbs, "ratio": ratio},
                    f"{name:<28} n={fmt_n(n):>4} thr={nt}  ours {ms['ours']:8.3f} ms "
                    f"{gbs['ours']:5.1f} GB/s | numpy {ms['numpy']:8.3f} ms "
                    f"{gbs['numpy']:5.1f} GB/s ({ratio['numpy']:4.1f}x) | torch "
                    f"{ms['torch']:8.3f} ms {gbs['torch']:5.1f} GB/s ({ratio['torch']:4.2f}x) | "
                    f"copyto {gbs['np.copyto']:5.1f} copy_into {gbs['copy_into']:5.1f} GB/s "
                    f"(ours/copy {ratio['copy']:4.2f})"
                    + (f" | torch fused {ms['torch_fused']:7.3f} ms ({ratio['torch_fused']:4.2f}x)"
                       if "torch_fused" in ms else ""))
        del a, t, src, dst, s_, d_, calls  # free this size before allocating the next

    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["kernel"])
            wr.writeheader()
            wr.writerows(rows)

    out({"type": "targets_header"},
        f"# targets: {fmt_n(TARGET_N)} float32, {TARGET_THREADS} threads")
    for name in ("sgd_momentum_step", "sgd_momentum_step(zero_acc)"):
        ratio = results.get((name, TARGET_N, TARGET_THREADS))
        for label, key, want in TARGETS:
            if ratio is None:
                verdict, got = "SKIP", None
            else:
                got = ratio[key]
                verdict = "PASS" if got >= want else "MISS"
            out({"type": "target", "kernel": name, "target": label, "want": want, "got": got,
                 "verdict": verdict},
                f"{verdict}  {name:<28} {label:<22} want >= {want:.1f}x  got "
                + (f"{got:.2f}x" if got is not None else f"- ({fmt_n(TARGET_N)}/"
                   f"{TARGET_THREADS} threads not in this run)"))


if __name__ == "__main__":
    main()
