"""A deterministic in-process simulator of a Rudra-base run: no sockets, threads or clocks.

It drives the same :class:`~rudra_zmq.sync.SyncEngine` as the parameter server with learners
whose compute times are simulated (a speed per learner, optional random jitter), so staleness
distributions, updates per epoch and — with ``train=True`` — the accuracy that a protocol and
learning-rate policy reach can be studied reproducibly on one core, for any λ (30 learners
need neither 30 processes nor 30 copies of torch).

With ``train=True`` each learner computes its real gradient (PyTorch) on the weights it last
pulled, on its own minibatches in the data server's order (``data_order``), and the PS's
optimizer state and update are the parameter server's own (``update.Updater``); only time is
simulated. Hardsync learners wait
for the update after their push; softsync/async learners go on at once with the newest
weights, as in the real system's PUSHPULL.

Results go to a run directory in the statistics server's ``metrics.jsonl`` schema (``t`` is
simulated seconds), so ``plots.plot_run`` draws them like a real run.
"""
from __future__ import annotations

import heapq
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import config as config_mod
from . import kernels
from .data_order import SampleStream, load_data
from .datasets import dataset_size
from .sync import LRSchedule, SyncEngine, learners_wait, protocol_label
from .update import Updater


@dataclass
class SimResult:
    """What a simulation produced: per-update records and (if trained) evaluation records."""

    updates: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    sim_time: float = 0.0
    weights: np.ndarray | None = None  # final weights (train=True)

    @property
    def mean_staleness(self) -> float:
        sig = [s for u in self.updates for s in u["sigmas"]]
        return float(np.mean(sig)) if sig else 0.0


class _Trainer:
    """Real gradients for simulated learners: one model, loaded with each learner's weights,
    fed each learner's minibatches in the data server's order (``data_order``)."""

    def __init__(self, cfg):
        import torch

        from .flat import FlatModel
        from .models import build_model, input_transform

        self.torch, self.prep = torch, input_transform(cfg.model.name)
        self.ds = load_data(cfg)  # the same data, split and order as the data server's
        self._new_flat = lambda: FlatModel(build_model(
            cfg.model.name, cfg.data.num_classes, self.ds.shape, seed=cfg.model.seed))
        self.flat = self._new_flat()
        self._local = threading.local()   # each worker thread computes on its own model
        self._local.flat = self.flat
        self.loss = torch.nn.CrossEntropyLoss()
        self.cfg = cfg
        self.n = len(self.ds.y_train)
        self.stream = SampleStream(self.n, cfg.train.seed)
        self._order_lock = threading.Lock()   # SampleStream's permutation cache

    def gradient(self, weights: np.ndarray, learner: int, step: int,
                 out: np.ndarray | None = None) -> np.ndarray:
        """The gradient of ``learner``'s minibatch at ``step`` on ``weights``, copied into
        ``out``, or (None) a view of this thread's flat gradient buffer, valid until its next
        call. Blocks (computes); thread-safe (each thread has its own model)."""
        flat = getattr(self._local, "flat", None)
        if flat is None:
            flat = self._local.flat = self._new_flat()
        s = self.cfg.sync
        with self._order_lock:
            idx = self.stream.batch(learner, step, s.learners, s.batch_size)
        x = self.prep(self.ds.x_train[idx], self.ds.mean, self.ds.std)
        y = self.torch.from_numpy(self.ds.y_train[idx])
        kernels.copy_into(flat.weights, weights)
        flat.zero_grad()
        self.loss(flat.module(x), y).backward()
        if out is None:
            return flat.grads
        kernels.copy_into(out, flat.grads)
        return out

    def evaluate(self, weights: np.ndarray) -> tuple[float, float]:
        kernels.copy_into(self.flat.weights, weights)
        errors, loss_sum = 0, 0.0
        with self.torch.no_grad():
            for i in range(0, len(self.ds.y_test), 500):
                x = self.prep(self.ds.x_test[i:i + 500], self.ds.mean, self.ds.std)
                y = self.torch.from_numpy(self.ds.y_test[i:i + 500])
                out = self.flat.module(x)
                loss_sum += float(self.loss(out, y)) * len(y)
                errors += int((out.argmax(1) != y).sum())
        n = len(self.ds.y_test)
        return errors / n, loss_sum / n


class _Gradients:
    """The gradients of the learners in flight, computed ahead of the simulated clock.

    A learner's gradient depends only on the weights it pulled and its minibatch, both fixed
    when it starts, so with ``workers`` > 1 a thread pool computes it right then, each worker
    on its own model copy with 1/workers of the torch threads: on CPUs, small minibatches
    use one core each better than a few cores together. The values are those of computing
    one at a time with that thread count; with 1 worker each is computed when it arrives.
    """

    def __init__(self, trainer: _Trainer, learners: int, workers: int):
        self.trainer = trainer
        self.pool = ThreadPoolExecutor(workers, "sim-gradient") if workers > 1 else None
        self.out = [np.empty_like(trainer.flat.grads) for _ in range(learners)] \
            if self.pool else None
        self.pending: dict = {}

    def start(self, learner: int, weights: np.ndarray, step: int) -> None:
        """``learner`` starts its gradient on ``weights`` (left unchanged until ``take``)."""
        self.pending[learner] = (self.pool.submit(self.trainer.gradient, weights, learner, step,
                                                  self.out[learner])
                                 if self.pool else (weights, step))

    def take(self, learner: int) -> np.ndarray:
        """``learner``'s gradient (blocks until computed); valid until its next ``start``."""
        job = self.pending.pop(learner)
        return job.result() if self.pool else self.trainer.gradient(job[0], learner, job[1])

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)


def simulate(cfg, *, speeds=None, jitter: float = 0.0, seed: int = 0, train: bool = False,
             max_updates: int | None = None, progress=None,
             workers: int | None = None) -> SimResult:
    """Simulate a run of ``cfg`` (Rudra-base) and return its records. Blocks; CPU only.

    Args:
        speeds: relative compute time of each learner's gradient (default all 1.0).
        jitter: relative standard deviation of each gradient's compute time (0 = exact).
        train: compute real gradients and test error (else only the protocol is simulated).
        max_updates: stop after this many updates (default: ``train.epochs`` of data).
        progress: optional callable(str) for one line per evaluation.
        workers: threads computing gradients ahead (``_Gradients``); default: one per torch
            thread, at most λ. Torch's thread count is divided among them for the run.
    """
    lam = cfg.sync.learners
    speeds = list(speeds) if speeds is not None else [1.0] * lam
    if len(speeds) != lam or min(speeds) <= 0:
        raise ValueError(f"speeds must give a positive compute time for each of the {lam} "
                         f"learners, got {speeds}")
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    if not train:
        return _simulate(cfg, lam, speeds, jitter, seed, None, None, max_updates, progress)
    import torch

    trainer = _Trainer(cfg)
    threads = torch.get_num_threads()
    workers = min(threads, lam) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    grads = _Gradients(trainer, lam, workers)
    torch.set_num_threads(max(1, threads // workers))
    try:
        return _simulate(cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress)
    finally:
        grads.close()
        torch.set_num_threads(threads)


def _simulate(cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress):
    o = cfg.optimizer
    epoch_size = trainer.n if trainer else dataset_size(cfg.data)
    engine = SyncEngine(cfg.sync.protocol, lam,
                        LRSchedule(o.lr, o.lr_policy, tuple(o.lr_steps), o.lr_gamma),
                        n=cfg.sync.n, batch_size=cfg.sync.batch_size, epoch_size=epoch_size)
    rng = np.random.default_rng(seed)
    result = SimResult()
    if trainer:
        w0 = trainer.flat.weights
        segments = trainer.flat.segments() if o.param_multipliers else [(0, w0.size, 1.0, 1.0)]
        updater = Updater(w0, segments, o)   # the PS's optimizer state
        have = [w0.copy() for _ in range(lam)]
        next_eval = cfg.train.eval_every_epochs or math.inf
        _record_eval(result, trainer, updater.w, engine, 0.0, progress)
        for i in range(lam):
            grads.start(i, have[i], 0)

    have_ts = [0] * lam
    steps = [0] * lam
    waiting: list[int] = []
    events = [(_duration(speeds[i], jitter, rng), i) for i in range(lam)]
    heapq.heapify(events)
    limit = max_updates if max_updates is not None else math.inf
    while events and engine.updates < limit:
        t, i = heapq.heappop(events)
        arrival = engine.receive(i, have_ts[i])
        if trainer:
            updater.receive([grads.take(i)], arrival.scale, arrival.update)
        steps[i] += 1
        update = arrival.update
        if update is not None:
            result.updates.append({"type": "update", "ts": update.timestamp, "t": t,
                                   "epoch": update.epoch, "mean_sigma": update.mean_sigma,
                                   "sigmas": list(update.sigmas), "lr": update.lr,
                                   "n_grads": len(update.sigmas)})
            if trainer and (update.epoch >= next_eval or update.epoch >= cfg.train.epochs):
                while update.epoch >= next_eval:
                    next_eval += cfg.train.eval_every_epochs
                _record_eval(result, trainer, updater.w, engine, t, progress)
            if update.epoch >= cfg.train.epochs and max_updates is None:
                break
        if learners_wait(cfg.sync.protocol):
            waiting.append(i)
            if update is None:
                continue
            resume, waiting = waiting, []
        else:
            resume = [i]
        for j in resume:  # pull the newest weights, start the next gradient
            have_ts[j] = engine.timestamp
            if trainer:
                kernels.copy_into(have[j], updater.w)
                grads.start(j, have[j], steps[j])
            heapq.heappush(events, (t + _duration(speeds[j], jitter, rng), j))
        result.sim_time = t
    if trainer:
        result.weights = updater.w.copy()
    return result


def _duration(speed: float, jitter: float, rng) -> float:
    return speed * max(0.05, 1.0 + jitter * rng.standard_normal()) if jitter else speed


def _record_eval(result, trainer, w, engine, t, progress):
    err, loss = trainer.evaluate(w)
    result.evals.append({"type": "eval", "ts": engine.timestamp, "t": t, "epoch": engine.epoch,
                         "test_error": err, "test_loss": loss})
    if progress:
        progress(f"epoch {engine.epoch:7.2f}  ts {engine.timestamp:6d}  "
                 f"test error {100 * err:6.2f}%  loss {loss:.4f}")


def write_run(cfg, result: SimResult, run_dir: str | Path) -> Path:
    """Write config.yaml, metrics.jsonl, summary.csv and plots for a simulation."""
    from . import plots

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_mod.save(cfg, run_dir / "config.yaml")
    with open(run_dir / "metrics.jsonl", "w") as f:
        for rec in sorted(result.updates + result.evals, key=lambda r: (r["t"], r["ts"])):
            f.write(json.dumps(rec) + "\n")
    metrics = plots.read_metrics(run_dir / "metrics.jsonl")
    plots.write_summary_csv(metrics, run_dir / "summary.csv")
    plots.plot_run(run_dir)
    return run_dir


def main_simulate(cfg, run_dir, *, jitter, speeds, seed, train) -> int:
    """Entry point of ``rudra-zmq simulate``: simulate, print a summary, write the run dir."""
    t0 = time.time()
    res = simulate(cfg, speeds=speeds, jitter=jitter, seed=seed, train=train,
                   progress=lambda line: print(line, flush=True))
    s = cfg.sync
    print(f"simulated {protocol_label(s.protocol, s.n)}, "
          f"λ={s.learners}, µ={s.batch_size}: {len(res.updates)} updates, "
          f"<σ> = {res.mean_staleness:.2f}"
          + (f", final test error {100 * res.evals[-1]['test_error']:.2f}%" if res.evals else "")
          + f" ({time.time() - t0:.1f} s)")
    out = write_run(cfg, res, run_dir)
    print(f"run directory: {out}")
    return 0
