"""End-to-end training throughput: ``rudra-zmq run`` beside a plain PyTorch loop, same cores.

Each distributed case is a real ``rudra-zmq run`` (stats, data, PS and learner processes,
started as a user would, in a temporary run directory) of cifar10_full on CIFAR-10-shaped
synthetic data, 1-softsync, µ = 128 per learner, momentum 0.9, no evaluation during training.
Its throughput is measured from the PS's ``update`` records in ``metrics.jsonl``: samples of
the updates in the steady-state window (after the first ``--skip-s`` seconds of updates and
before the last ``--trim-s``) over the window's duration, so start-up (imports, first batches)
and shutdown are excluded. The learners' own ``samples_per_s`` records are shown as a cross
check (``train_run.py`` runs and measures one).

The baseline is the loop a user would write instead, in this process: ``torch.set_num_threads
(2)``, the same model from ``rudra_zmq.models.build_model``, the same synthetic data and
``to_float`` preprocessing, µ = 128, ``torch.optim.SGD(momentum=0.9)``. It is timed before
and after the distributed cases (load drifts on this shared box) and the two are pooled.

    rudra-zmq bench train-throughput                    # defaults below, ~4 minutes
    rudra-zmq bench train-throughput --cases default --epochs 6 --csv bench/out/train.csv
    rudra-zmq bench train-throughput --device cuda --cases lambda1 default   # GPU learners

``--device cuda``: the learners run with ``runtime.device=cuda`` and the baseline loop trains
on the GPU too (its batches prepared on the CPU as the learners' are); the goal line is for
the CPU cases of the issue, so it is not printed then.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import numpy as np

from . import common
from .train_run import compare_runs, distributed

# ----------------------------------------------------------------------------- defaults
MODEL, SHAPE, CLASSES = "cifar10_full", [3, 32, 32], 10
TRAIN_N, TEST_N = 8192, 512
MU = 128
LR, MOMENTUM, WD = 0.001, 0.9, 0.004
EPOCHS = 4.0  # per distributed run (8192 samples/epoch)
SKIP_S, TRIM_S = 5.0, 1.0  # steady-state window of the update records
BASELINE_S = 15.0  # timed seconds per baseline measurement (two of them)
BASELINE_THREADS = 2
WARMUP_STEPS = 3
GOAL = 0.95  # distributed images/s >= GOAL x baseline
# name -> (extra --set overrides, extra environment of the run, whether the goal applies)
PASSIVE = {"OMP_WAIT_POLICY": "passive"}
CASES = {
    "default": (["sync.learners=2"], {}, True),  # threads_per_learner 0 -> 1
    "tpl1": (["sync.learners=2", "runtime.threads_per_learner=1"], {}, False),
    "tpl2": (["sync.learners=2", "runtime.threads_per_learner=2"], {}, False),
    "tpl2_passive": (["sync.learners=2", "runtime.threads_per_learner=2"], PASSIVE, False),
    "ps1": (["sync.learners=2", "runtime.ps_threads=1"], {}, False),
    "lambda1": (["sync.learners=1"], {}, False),  # one learner on 2 threads
    # where per-message cost binds most: async, µ = 4, λ = 8
    "async_mu4_l8": (["sync.learners=8", "sync.protocol=async", "sync.batch_size=4"], {}, False),
    # the half-precision wire (float16 gradients and weights): the codec's kernels on every
    # message, at the paper's workload and where per-message cost binds most
    "float16": (
        ["sync.learners=2", "wire.gradient_dtype=float16", "wire.weights_dtype=float16"],
        {},
        False,
    ),
    "async_mu4_l8_float16": (
        [
            "sync.learners=8",
            "sync.protocol=async",
            "sync.batch_size=4",
            "wire.gradient_dtype=float16",
            "wire.weights_dtype=float16",
        ],
        {},
        False,
    ),
    # the same two with CurveZMQ on every socket (per-run keys): what encryption costs
    "curve": (["sync.learners=2", "security.curve=true"], {}, False),
    "async_mu4_l8_curve": (
        ["sync.learners=8", "sync.protocol=async", "sync.batch_size=4", "security.curve=true"],
        {},
        False,
    ),
}
DEFAULT_CASES = ["default", "tpl2", "tpl2_passive", "lambda1"]


def run_config(run_root, epochs):
    return {
        "name": "bench-throughput",
        "model": {"name": MODEL},
        "data": {
            "dataset": "synthetic",
            "synthetic_shape": SHAPE,
            "synthetic_train": TRAIN_N,
            "synthetic_test": TEST_N,
            "num_classes": CLASSES,
        },
        "sync": {"protocol": "softsync", "n": 1, "learners": 2, "batch_size": MU},
        "optimizer": {"lr": LR, "momentum": MOMENTUM, "weight_decay": WD},
        "train": {"epochs": float(epochs), "eval_every_epochs": 0.0},
        "runtime": {"run_dir": str(run_root)},
    }


# ----------------------------------------------------------------------------- baseline
def baseline(seconds, threads, data, device="cpu"):
    """Images/s (and per-step seconds) of a plain single-process training loop; blocks for
    about ``seconds``."""
    import torch

    from ..models import build_model, input_transform

    torch.set_num_threads(threads)
    x_tr, y_tr, mean, std = data
    model = build_model(MODEL, CLASSES, tuple(SHAPE), seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    loss_fn = torch.nn.CrossEntropyLoss()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y_tr))
    pos = 0

    def step():
        nonlocal pos, order
        if pos + MU > len(order):
            order, pos = rng.permutation(len(y_tr)), 0
        idx = order[pos : pos + MU]
        pos += MU
        xb = input_transform(MODEL)(x_tr[idx], mean, std).to(device)
        yb = torch.from_numpy(y_tr[idx]).to(device)
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(WARMUP_STEPS):
        step()
    times, t_start = [], time.perf_counter()
    while time.perf_counter() - t_start < seconds or len(times) < 5:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_start
    return {
        "images_per_s": len(times) * MU / total,
        "steps": len(times),
        "step_median_s": statistics.median(times),
        "seconds": total,
    }


def timed_baseline(when, args, data):
    """Run the baseline loop once and print its line; blocks about ``args.baseline_s``."""
    b = baseline(args.baseline_s, args.baseline_threads, data, args.device)
    print(
        f"{f'baseline ({when})':<19}{b['images_per_s']:7.1f} images/s  step "
        f"median {b['step_median_s'] * 1e3:6.1f} ms  ({b['steps']} steps)  loadavg "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    return b


def scaling(r, one):
    """' | 0.93 of 2 x 1-thread' where each learner has one thread and the reference ran."""
    threads = r["threads_per_learner"] or max(1, (os.cpu_count() or 1) // r["learners"])
    if one is None or threads != 1:
        return ""
    return (
        f" | {r['images_per_s'] / (r['learners'] * one['images_per_s']):4.2f} of "
        f"{r['learners']} x 1-thread reference"
    )


# ----------------------------------------------------------------------------- command
def add_arguments(ap) -> None:
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    ap.add_argument("--epochs", type=float, default=EPOCHS, help="epochs per distributed run")
    ap.add_argument("--skip-s", type=float, default=SKIP_S)
    ap.add_argument("--trim-s", type=float, default=TRIM_S)
    ap.add_argument("--baseline-s", type=float, default=BASELINE_S)
    ap.add_argument("--baseline-threads", type=int, default=BASELINE_THREADS)
    ap.add_argument(
        "--no-one-thread-ref",
        dest="one_thread_ref",
        action="store_false",
        help="skip the 1-thread reference loop (printed for scale, not a baseline)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    ap.add_argument(
        "--device",
        default="cpu",
        help="runtime.device of the learners and the baseline's device (cpu, cuda, cuda:N)",
    )
    ap.add_argument("--csv", metavar="PATH", help="also write one row per case here")
    ap.add_argument(
        "--against",
        metavar="CHECKOUT",
        help="also run every case with the "
        "rudra_zmq of another checkout (its extensions built in place, e.g. a git "
        "worktree of an earlier commit), in the order this, other, other, this; "
        "prints this/other",
    )


def run(args) -> int:
    """The baseline, every case, the baseline again, then the verdict; blocks until done."""
    import torch

    from ..data.datasets import load_dataset

    facts = common.machine_facts(
        env_keys=(
            "OMP_NUM_THREADS",
            "OMP_WAIT_POLICY",
            "GOMP_SPINCOUNT",
            "MKL_NUM_THREADS",
            "OPENBLAS_NUM_THREADS",
        ),
        torch=torch.__version__,
    )
    print(
        common.header_text(
            "training throughput benchmark",
            facts,
            notes=[
                f"{MODEL}, synthetic {SHAPE} x {TRAIN_N}, mu={MU}, SGD momentum {MOMENTUM}, wd {WD}; "
                f"runs: 1-softsync, {args.epochs:g} epochs, window = updates after {args.skip_s:g} s, "
                f"before the last {args.trim_s:g} s",
                f"device: {args.device}",
                f"baseline: one process, torch.set_num_threads({args.baseline_threads}), timed "
                f"before and after the runs and pooled; ratio = run / baseline (goal >= {GOAL})",
                "runs: the launcher gives each learner OMP_NUM_THREADS = torch threads = "
                "runtime.threads_per_learner (0: cores / lambda, at least 1), interop 1; the PS "
                "OMP_NUM_THREADS = runtime.ps_threads (0: all cores); loadavg includes our own runs",
            ],
        ),
        flush=True,
    )

    ds = load_dataset(
        "synthetic",
        synthetic_shape=tuple(SHAPE),
        synthetic_n=(TRAIN_N, TEST_N),
        num_classes=CLASSES,
    )
    data = (ds.x_train, ds.y_train, ds.mean, ds.std)
    one = None
    if args.one_thread_ref:  # reference only: what one learner's compute alone can do
        one = baseline(args.baseline_s, 1, data, args.device)
        print(
            f"reference 1 thread {one['images_per_s']:7.1f} images/s  step median "
            f"{one['step_median_s'] * 1e3:6.1f} ms  ({one['steps']} steps)  loadavg "
            f"{os.getloadavg()[0]:.2f}  (not the baseline; 2 x this = perfect 2-learner "
            f"scaling)",
            flush=True,
        )
    b1 = timed_baseline("before", args, data)
    config = functools.partial(run_config, epochs=args.epochs)
    results, others = {}, {}
    for name in args.cases:
        overrides, env, _ = CASES[name]
        sets = [*overrides, f"runtime.device={args.device}"]
        if args.against:
            results[name], others[name] = compare_runs(name, config, sets, env, args)
        else:
            results[name] = distributed(
                name, config, sets, env, args.skip_s, args.trim_s, args.keep
            )
        r = results[name]
        print(
            f"# ran {name}: lambda={r['learners']} threads_per_learner={r['threads_per_learner']}"
            f" ps_threads={r['ps_threads']} env={env or '-'}: {r['images_per_s']:.1f} images/s"
            f" over {r['window_s']:.1f} s ({r['window_updates']} updates), start-up "
            f"{r['startup_s']:.1f} s, wall {r['wall_s']:.1f} s, loadavg "
            f"{os.getloadavg()[0]:.2f}",
            flush=True,
        )
    b2 = timed_baseline("after", args, data)
    base = (b1["steps"] + b2["steps"]) * MU / (b1["seconds"] + b2["seconds"])

    rows = [
        {
            "case": "baseline",
            "images_per_s": base,
            "before": b1["images_per_s"],
            "after": b2["images_per_s"],
        }
    ]
    if one:
        rows.append({"case": "reference_1thread", "images_per_s": one["images_per_s"]})
    for name, r in results.items():
        ratio = r["images_per_s"] / base
        tpl = r["threads_per_learner"] or "0(auto)"
        print(
            f"train {name:<12} lambda={r['learners']} threads/learner={tpl:<7} "
            f"rudra-zmq {r['images_per_s']:7.1f} images/s (learner records "
            f"{r['learner_records_images_per_s']:7.1f}) | plain torch {base:7.1f} images/s | "
            f"ratio {ratio:4.2f}x" + scaling(r, one),
            flush=True,
        )
        rows.append({"case": name, "ratio": ratio, **r})
        if name in others:
            o = others[name]
            print(
                f"train {name:<12} this checkout {r['images_per_s']:7.1f} images/s "
                f"{r['runs']} | {args.against}: {o['images_per_s']:7.1f} images/s {o['runs']} "
                f"| this/other {r['images_per_s'] / o['images_per_s']:4.2f}x | other/plain "
                f"torch {o['images_per_s'] / base:4.2f}x",
                flush=True,
            )
            rows.append({"case": f"{name}@other", "ratio": o["images_per_s"] / base, **o})
    if args.csv:
        common.write_csv(args.csv, rows)
    goal = (
        f"goal: rudra-zmq (lambda=2, default threads) >= {GOAL:.2f}x plain torch"
        if args.device == "cpu"
        else "(the goal is for CPU learners)"
    )
    print(f"# {goal}  (loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for name, r in results.items():
        if CASES[name][2] and args.device == "cpu":
            ratio = r["images_per_s"] / base
            print(
                f"{'PASS' if ratio >= GOAL else 'MISS'}  {name}  want >= {GOAL:.2f}x  "
                f"got {ratio:.2f}x"
            )
    return 0
