"""The simulator's speed at small µ and many learners beside the baseline (µ = 128, λ = 1).

Cases (cifar10_full on CIFAR-10, the paper's solver, ``configs/cifar10_baseline.yaml``):
the baseline µ = 128, λ = 1 through the simulator, and Table 2's µ = 4, λ = 30 points
(1-softsync and 30-softsync with α0/⟨σ⟩, and hardsync), each through the simulator's
per-gradient path (one forward/backward per learner gradient, computed ahead on one worker
thread per core) and its batched path (one per weights version per update,
``sim_batched``). A plain PyTorch loop of µ = 128 with torch.optim.SGD is the reference of
what the cores do without the simulator. Every case gets every core and trains ``--samples``
samples; the cases alternate ``--repeat`` times in this one run (the machine is shared) and
each round prints samples/s; the verdict is each µ = 4 case's median ratio to the baseline
simulated in the same rounds (goal of the batched path: >= 0.9).

    rudra-zmq bench sim-speed --data ../shared/data/cifar10-jpeg.tar.gz
"""

from __future__ import annotations

import math
import os
import statistics
import time

from .. import kernels
from . import common

CONFIG = os.path.join("configs", "cifar10_baseline.yaml")  # in the source tree
SAMPLES = 8000  # per measurement
REPEAT = 3
BASELINE = (
    "baseline µ=128 λ=1",
    (
        "sync.protocol=hardsync",
        "sync.learners=1",
        "sync.batch_size=128",
        "optimizer.lr_policy=constant",
    ),
)
SMALL = [
    ("1-softsync µ=4 λ=30", ("sync.protocol=softsync", "sync.n=1")),
    ("30-softsync µ=4 λ=30", ("sync.protocol=softsync", "sync.n=30")),
    ("hardsync µ=4 λ=30", ("sync.protocol=hardsync",)),
]
SMALL_COMMON = ("sync.learners=30", "sync.batch_size=4", "optimizer.lr_policy=staleness")
PATHS = ("per-gradient", "batched")


def find_config(path: str | None) -> str:
    """``path``, else ``configs/cifar10_baseline.yaml`` of the source tree this package runs
    from or of the current directory; ValueError if none exists."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for p in [path] if path else [os.path.join(repo, CONFIG), CONFIG]:
        if os.path.isfile(p):
            return p
    raise ValueError(f"config {path or CONFIG} not found (give --config)")


def config(path: str, data_root: str, overrides=()):
    from ..config import load_config

    return load_config(path, [f"data.root={data_root}", "train.eval_every_epochs=0", *overrides])


def time_simulator(cfg, samples: int, gradients: str) -> tuple[float, float]:
    """Samples per second of the simulator, from the end of its initial evaluation to its
    return, in wall time and in this process's CPU time (every thread's; blocks while it
    trains about ``samples`` samples)."""
    from ..sim.simulator import simulate
    from ..sync import SyncEngine

    s = cfg.sync
    c = SyncEngine.of(cfg).gradients_per_update
    updates = max(1, math.ceil(samples / (s.batch_size * c)))
    marks = []
    res = simulate(
        cfg,
        train=True,
        max_updates=updates,
        gradients=gradients,
        progress=lambda line: marks.append((time.perf_counter(), time.process_time())),
    )
    trained = sum(u["n_grads"] for u in res.updates) * s.batch_size
    return (
        trained / (time.perf_counter() - marks[0][0]),
        trained / (time.process_time() - marks[0][1]),
    )


def time_plain_loop(cfg, ds, samples: int) -> tuple[float, float]:
    """Samples per second (wall, CPU) of one process training µ-sample minibatches with
    torch.optim.SGD (blocks while it trains)."""
    import torch

    from ..data.data_order import SampleStream
    from ..models import build_model, input_transform

    o, mu = cfg.optimizer, cfg.sync.batch_size
    model = build_model(cfg.model.name, cfg.data.num_classes, ds.shape, seed=0)
    prep, loss_fn = input_transform(cfg.model.name), torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(
        model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
    )
    stream = SampleStream(len(ds.y_train), cfg.train.seed)
    steps = max(1, samples // mu)
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        idx = stream.indices(step * mu, mu)
        opt.zero_grad()
        loss_fn(
            model(prep(ds.x_train[idx], ds.mean, ds.std)), torch.from_numpy(ds.y_train[idx])
        ).backward()
        opt.step()
    return steps * mu / (time.perf_counter() - t0), steps * mu / (time.process_time() - c0)


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="CIFAR-10 root (e.g. the JPEG tarball)")
    p.add_argument("--config", help=f"the base config (default {CONFIG} of the source tree)")
    p.add_argument(
        "--samples", type=int, default=SAMPLES, help=f"samples per measurement (default {SAMPLES})"
    )
    p.add_argument("--repeat", type=int, default=REPEAT, help=f"rounds (default {REPEAT})")
    p.add_argument(
        "--cases",
        default="1-softsync,30-softsync,hardsync",
        help="µ = 4 cases to run (default all: 1-softsync,30-softsync,hardsync)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (default 0: every core); 1 measures the cost per "
        "sample where other work shares the cores",
    )
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help=f"simulator paths for the µ = 4 cases (default {','.join(PATHS)})",
    )


def run(args) -> int:
    """``--repeat`` rounds of every case; one line per measurement, then the verdict. Blocks."""
    import torch

    from ..data.data_order import load_data

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    path = find_config(args.config)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [c for c in wanted if not any(n.startswith(c + " ") for n, _ in SMALL)] + [
        p for p in paths if p not in PATHS
    ]
    if bad:
        raise ValueError(
            f"unknown case or path {bad[0]!r}; cases: 1-softsync, 30-softsync, "
            f"hardsync; paths: {', '.join(PATHS)}"
        )
    base = config(path, args.data, BASELINE[1])
    small = [
        (n, config(path, args.data, SMALL_COMMON + o))
        for n, o in SMALL
        if any(n.startswith(c + " ") for c in wanted)
    ]
    ds = load_data(base)
    print(common.kernels_line())
    print(
        f"cifar10_full, {args.samples} samples per measurement, {threads} threads, "
        f"{args.repeat} rounds; samples/s in wall time [in CPU time] (ratios to the baseline "
        "simulated in the same round)"
    )
    rates: dict[str, list] = {}
    for r in range(args.repeat):
        b = time_simulator(base, args.samples, "batched")
        rates.setdefault(BASELINE[0], []).append(b)
        plain = time_plain_loop(base, ds, args.samples)
        rates.setdefault("plain loop µ=128", []).append(plain)
        line = [
            f"{BASELINE[0]} {b[0]:5.0f} [{b[1]:5.0f}]   plain loop µ=128 "
            f"{plain[0]:5.0f} [{plain[1]:5.0f}]"
        ]
        for name, cfg in small:
            for p in paths:
                v = time_simulator(cfg, args.samples, p)
                rates.setdefault(f"{name}, {p}", []).append((v[0] / b[0], v[1] / b[1]))
                line.append(
                    f"{name}, {p}: {v[0]:5.0f} [{v[1]:5.0f}]  ratio "
                    f"{v[0] / b[0]:.2f} [{v[1] / b[1]:.2f}]"
                )
        print(f"  round {r + 1}: " + "\n           ".join(line), flush=True)
    n = len(ds.y_train)
    med = statistics.median(w for w, _ in rates[BASELINE[0]])
    print(
        f"baseline simulated: {med:.0f} samples/s, {n / med:.0f} s per epoch of {n:,}; "
        "median ratios to it, wall [CPU]:"
    )
    for key, vals in rates.items():
        if key in (BASELINE[0], "plain loop µ=128"):
            continue
        wall, cpu = (statistics.median(v[k] for v in vals) for k in (0, 1))
        print(
            f"  {key}: {wall:.2f} [{cpu:.2f}] ({n / (wall * med):.0f} s per epoch)"
            + (
                "  goal >= 0.9: " + ("met" if wall >= 0.9 else "NOT met")
                if key.endswith("batched")
                else ""
            )
        )
    return 0
