"""The simulator's speed beside one learner process training the same samples.

Case: cifar10_full on CIFAR-10, µ = 4, λ = 30, 30-softsync with α0/⟨σ⟩ -- the configuration the
paper's Table 2 studies and the costliest to run for real (30 learner processes). The simulator
(``simulator.simulate(train=True)``) computes every learner's real gradient and the PS's real
update, by default ahead on one worker thread per core (also timed with ``workers=1``, one
gradient at a time on every core); the baseline is a plain PyTorch loop of one process
training µ = 4 minibatches of the same data with the same input transform and momentum-SGD.
Both get every core. They alternate
``--repeat`` times in this one run (the machine is shared); each prints samples/s, and the
verdict is the median ratio simulator / baseline (goal: >= 1, no slower).

    rudra-zmq bench sim-speed --data ../shared/data/cifar10-jpeg.tar.gz
"""
from __future__ import annotations

import os
import statistics
import time

from .. import kernels

CONFIG = os.path.join("configs", "cifar10_30softsync.yaml")   # in the source tree
GRADIENTS = 2000      # per measurement: 8,000 samples at µ = 4
REPEAT = 3


def find_config(path: str | None) -> str:
    """``path``, else ``configs/cifar10_30softsync.yaml`` of the source tree this package runs
    from or of the current directory; ValueError if none exists."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for p in ([path] if path else [os.path.join(repo, CONFIG), CONFIG]):
        if os.path.isfile(p):
            return p
    raise ValueError(f"config {path or CONFIG} not found (give --config)")


def config(path: str, data_root: str):
    from ..config import load_config

    return load_config(path, [f"data.root={data_root}", "train.eval_every_epochs=0"])


def time_simulator(cfg, gradients: int, workers: int | None) -> float:
    """Samples/s of the simulator, from the end of its initial evaluation to its return
    (blocks while it trains)."""
    from ..simulator import simulate

    marks = []
    simulate(cfg, train=True, max_updates=gradients,   # async: one gradient per update
             progress=lambda line: marks.append(time.perf_counter()), workers=workers)
    return gradients * cfg.sync.batch_size / (time.perf_counter() - marks[0])


def time_plain_loop(cfg, ds, gradients: int) -> float:
    """Samples/s of one process training µ-sample minibatches with torch.optim.SGD (blocks
    while it trains)."""
    import torch

    from ..data_order import SampleStream
    from ..models import build_model, input_transform

    o, mu = cfg.optimizer, cfg.sync.batch_size
    model = build_model(cfg.model.name, cfg.data.num_classes, ds.shape, seed=0)
    prep, loss_fn = input_transform(cfg.model.name), torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum,
                          weight_decay=o.weight_decay)
    stream = SampleStream(len(ds.y_train), cfg.train.seed)
    t0 = time.perf_counter()
    for step in range(gradients):
        idx = stream.indices(step * mu, mu)
        opt.zero_grad()
        loss_fn(model(prep(ds.x_train[idx], ds.mean, ds.std)),
                torch.from_numpy(ds.y_train[idx])).backward()
        opt.step()
    return gradients * mu / (time.perf_counter() - t0)


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="CIFAR-10 root (e.g. the JPEG tarball)")
    p.add_argument("--config", help=f"the case (default {CONFIG} of the source tree)")
    p.add_argument("--gradients", type=int, default=GRADIENTS,
                   help=f"gradients per measurement (default {GRADIENTS})")
    p.add_argument("--repeat", type=int, default=REPEAT, help=f"rounds (default {REPEAT})")


def run(args) -> int:
    """``--repeat`` rounds of simulator, simulator with one worker, plain loop; blocks."""
    import torch

    from ..data_order import load_data

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    cfg = config(find_config(args.config), args.data)
    ds = load_data(cfg)
    print(f"cifar10_full, µ={cfg.sync.batch_size}, λ={cfg.sync.learners}, "
          f"{cfg.sync.n}-softsync, {args.gradients} gradients per measurement, "
          f"{threads} threads")
    sims, ones, plains = [], [], []
    for i in range(args.repeat):
        sims.append(time_simulator(cfg, args.gradients, None))
        ones.append(time_simulator(cfg, args.gradients, 1))
        plains.append(time_plain_loop(cfg, ds, args.gradients))
        print(f"  round {i + 1}: simulator {sims[-1]:5.0f} samples/s (one gradient at a time: "
              f"{ones[-1]:5.0f})   one learner process {plains[-1]:5.0f} samples/s   ratio "
              f"{sims[-1] / plains[-1]:.2f}", flush=True)
    ratio = statistics.median(s / b for s, b in zip(sims, plains))
    n = len(ds.y_train)
    print(f"time per epoch ({n:,} samples): simulator {n / statistics.median(sims):.0f} s "
          f"(one gradient at a time {n / statistics.median(ones):.0f} s), one learner process "
          f"{n / statistics.median(plains):.0f} s; median ratio {ratio:.2f} "
          f"({'no slower' if ratio >= 1 else 'SLOWER'})")
    return 0
