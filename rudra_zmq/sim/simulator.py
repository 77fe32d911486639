"""A deterministic in-process simulator of a Rudra-base run: no sockets, threads or clocks.

It drives the same :class:`~rudra_zmq.sync.SyncEngine` as the parameter server with learners
whose compute times are simulated (a speed per learner, optional random jitter), so staleness
distributions, updates per epoch and — with ``train=True`` — the accuracy that a protocol and
learning-rate policy reach can be studied reproducibly on one core, for any λ (30 learners
need neither 30 processes nor 30 copies of torch).

With ``train=True`` each learner computes its real gradient (PyTorch) on the weights it last
pulled, on its own minibatches in the data server's order (``data_order``), and the PS's
optimizer state and update are the parameter server's own (``update.Updater``); only time is
simulated. A learner goes on with the newest weights when the engine's reply to its
gradient says, as the parameter server answers its PUSHPULL then: hardsync learners after the
update, softsync/async learners at once.

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

from .. import config as config_mod
from .. import kernels
from ..data.data_order import SampleStream, load_data
from ..data.datasets import dataset_size
from ..run_files import SUMMARY_FILE, config_path, metrics_path
from ..sync import SyncEngine, protocol_label
from ..update import Updater
from . import sim_batched


@dataclass
class SimResult:
    """What a simulation produced: per-update records and (if trained) evaluation records."""

    updates: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    sim_time: float = 0.0
    weights: np.ndarray | None = None  # final weights (train=True)

    def add_update(self, update, t: float) -> None:
        """Record ``update`` (a ``sync.Update``) made at simulated time ``t``."""
        self.updates.append(
            {
                "type": "update",
                "ts": update.timestamp,
                "t": t,
                "epoch": update.epoch,
                "mean_sigma": update.mean_sigma,
                "sigmas": list(update.sigmas),
                "lr": update.lr,
                "n_grads": len(update.sigmas),
            }
        )

    @property
    def mean_staleness(self) -> float:
        sig = [s for u in self.updates for s in u["sigmas"]]
        return float(np.mean(sig)) if sig else 0.0


class _Trainer:
    """Real gradients for simulated learners: one model, loaded with each learner's weights,
    fed each learner's minibatches in the data server's order (``data_order``).

    On a GPU (``runtime.device`` cuda) the models compute there and the preprocessed training
    and test images are uploaded once, so a batch is an index on the device; each batch loads
    its weights version (one host-to-device copy of the model) and returns its gradient to the
    host, where the PS's own update runs (untested on a GPU: none was at hand)."""

    def __init__(self, cfg):
        import torch

        from ..devices import learner_device
        from ..flat import FlatModel
        from ..models import build_model, input_transform, is_import_path

        self.torch, self.prep = torch, input_transform(cfg.model.name)
        self.device = learner_device(cfg.runtime.device, 0)
        self.ds = load_data(cfg)  # the same data, split and order as the data server's
        self._new_flat = lambda: FlatModel(
            build_model(cfg.model.name, cfg.data.num_classes, self.ds.shape, seed=cfg.model.seed),
            device=self.device,
        )
        self.flat = self._new_flat()
        self.exact_batches = sim_batched.exact_for(
            self.flat.module, not is_import_path(cfg.model.name)
        )
        self._local = threading.local()  # each worker thread computes on its own model
        self._local.flat = self.flat
        self.loss = torch.nn.CrossEntropyLoss()
        self.cfg = cfg
        self.n = len(self.ds.y_train)
        self.stream = SampleStream(self.n, cfg.train.seed)
        self._order_lock = threading.Lock()  # SampleStream's permutation cache
        self._build_lock = threading.Lock()
        self._on_device = None
        if self.device.type != "cpu":  # x and y of train and test, preprocessed, on the GPU
            self._on_device = [
                self._upload(x, y)
                for x, y in ((self.ds.x_train, self.ds.y_train), (self.ds.x_test, self.ds.y_test))
            ]

    def _upload(self, x, y, chunk: int = 4096):
        t = self.torch
        out = t.empty((len(y), *self.ds.shape), dtype=t.float32, device=self.device)
        for i in range(0, len(y), chunk):
            out[i : i + chunk].copy_(self.prep(x[i : i + chunk], self.ds.mean, self.ds.std))
        return out, t.from_numpy(y).to(self.device)

    def _batch(self, idx, train: bool = True):
        """(inputs, labels) of the samples ``idx`` (an index array, or a slice)."""
        if self._on_device is not None:
            x, y = self._on_device[0 if train else 1]
            if not isinstance(idx, slice):
                idx = self.torch.from_numpy(idx).to(self.device)
            return x[idx], y[idx]
        xs, ys = (self.ds.x_train, self.ds.y_train) if train else (self.ds.x_test, self.ds.y_test)
        return self.prep(xs[idx], self.ds.mean, self.ds.std), self.torch.from_numpy(ys[idx])

    def _flat(self):
        flat = getattr(self._local, "flat", None)
        if flat is None:
            # one at a time: two threads in build_model's fork_rng deadlocked (seen with
            # torch 2.14: one waits for the CPU generator's mutex holding the GIL)
            with self._build_lock:
                flat = self._local.flat = self._new_flat()
        return flat

    def gradient(
        self, weights: np.ndarray, learner: int, step: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The gradient of ``learner``'s minibatch at ``step`` on ``weights``, copied into
        ``out``, or (None) a view of this thread's flat gradient buffer, valid until its next
        call. Blocks (computes); thread-safe (each thread has its own model)."""
        grads = self._compute(weights, [(learner, step)])
        if out is None:
            return grads
        kernels.copy_into(out, grads)
        return out

    def group_gradient(self, weights: np.ndarray, members) -> np.ndarray:
        """The gradient of the mean loss over the minibatches of ``members`` ((learner, step)
        pairs) together, on ``weights``: 1/k of the sum of their k gradients, as a new
        array. Blocks (computes); thread-safe."""
        return self._compute(weights, members).copy()

    def _compute(self, weights, members) -> np.ndarray:
        flat = self._flat()
        s = self.cfg.sync
        with self._order_lock:
            idx = np.concatenate(
                [self.stream.batch(i, k, s.learners, s.batch_size) for i, k in members]
            )
        x, y = self._batch(idx)
        flat.load_weights(weights)
        flat.zero_grad()
        self.loss(flat.module(x), y).backward()
        flat.grads_to_host()
        return flat.grads

    def evaluate(self, weights: np.ndarray) -> tuple[float, float]:
        self.flat.load_weights(weights)
        errors, loss_sum = 0, 0.0
        with self.torch.no_grad():
            for i in range(0, len(self.ds.y_test), 500):
                x, y = self._batch(slice(i, i + 500), train=False)
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
        self.out = (
            [np.empty_like(trainer.flat.grads) for _ in range(learners)] if self.pool else None
        )
        self.pending: dict = {}

    def start(self, learner: int, weights: np.ndarray, step: int) -> None:
        """``learner`` starts its gradient on ``weights`` (left unchanged until ``take``)."""
        self.pending[learner] = (
            self.pool.submit(self.trainer.gradient, weights, learner, step, self.out[learner])
            if self.pool
            else (weights, step)
        )

    def take(self, learner: int) -> np.ndarray:
        """``learner``'s gradient (blocks until computed); valid until its next ``start``."""
        job = self.pending.pop(learner)
        return job.result() if self.pool else self.trainer.gradient(job[0], learner, job[1])

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)


GRADIENT_PATHS = ("auto", "batched", "per-gradient")


def simulate(
    cfg,
    *,
    speeds=None,
    jitter: float = 0.0,
    seed: int = 0,
    train: bool = False,
    max_updates: int | None = None,
    progress=None,
    workers: int | None = None,
    gradients: str = "auto",
) -> SimResult:
    """Simulate a run of ``cfg`` (Rudra-base) and return its records. Blocks.

    Args:
        speeds: relative compute time of each learner's gradient (default all 1.0).
        jitter: relative standard deviation of each gradient's compute time (0 = exact).
        train: compute real gradients and test error (else only the protocol is simulated).
        max_updates: stop after this many updates (default: ``train.epochs`` of data).
        progress: optional callable(str) for one line per evaluation.
        workers: threads computing gradients ahead; default: per-gradient, one per torch
            thread, at most λ; batched, ``sim_batched.default_workers``. Torch's thread count
            is divided among them for the run.
        gradients: ``per-gradient`` (one forward/backward per learner gradient,
            ``_Gradients``), ``batched`` (one per weights version per update,
            ``sim_batched``: the same values up to summation order, for models without
            batch normalization or dropout) or ``auto`` (batched where it is exact and an
            update has more than one gradient).
    """
    lam = cfg.sync.learners
    speeds = list(speeds) if speeds is not None else [1.0] * lam
    if len(speeds) != lam or min(speeds) <= 0:
        raise ValueError(
            f"speeds must give a positive compute time for each of the {lam} learners, got {speeds}"
        )
    if jitter < 0:
        raise ValueError(f"jitter must be >= 0, got {jitter}")
    if gradients not in GRADIENT_PATHS:
        raise ValueError(f"gradients is {gradients!r}; expected one of {', '.join(GRADIENT_PATHS)}")
    if not train:
        return _simulate(cfg, lam, speeds, jitter, seed, None, None, max_updates, progress)
    import torch

    trainer = _Trainer(cfg)
    if (
        gradients == "batched"
        and not trainer.exact_batches
        and not sim_batched.exact_for(trainer.flat.module, True)
    ):
        raise ValueError(
            f"model {cfg.model.name} has batch normalization or dropout: batched "
            "gradients would not be the per-gradient ones; use --gradients "
            "per-gradient"
        )
    c = SyncEngine.of(cfg).gradients_per_update
    # c = 1: every update is one gradient, nothing shares a batch (per-gradient was as fast)
    batched = gradients == "batched" or (gradients == "auto" and trainer.exact_batches and c > 1)
    threads = torch.get_num_threads()
    if workers is None:
        workers = sim_batched.default_workers(threads, lam, c) if batched else min(threads, lam)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    grads = (
        sim_batched.BatchedGradients(trainer, workers, lookahead=lam)
        if batched
        else _Gradients(trainer, lam, workers)
    )
    torch.set_num_threads(max(1, threads // workers))
    try:
        return _simulate(cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress)
    finally:
        grads.close()
        torch.set_num_threads(threads)


def _simulate(cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress):
    o = cfg.optimizer
    engine = SyncEngine.of(cfg, trainer.n if trainer else dataset_size(cfg.data))
    result = SimResult()
    events = _events(cfg, engine, lam, speeds, jitter, np.random.default_rng(seed), max_updates)
    if not trainer:
        for t, _, _, _, arrival, _ in events:
            if arrival.update is not None:
                result.add_update(arrival.update, t)
            result.sim_time = t
        return result
    w0 = trainer.flat.weights
    segments = trainer.flat.segments() if o.param_multipliers else [(0, w0.size, 1.0, 1.0)]
    updater = Updater(w0, segments, o)  # the PS's optimizer state
    evals = _Evals(cfg, trainer, result, progress)
    evals.record(updater.w, 0, 0.0, 0.0)
    if isinstance(grads, sim_batched.BatchedGradients):
        grads.run(events, updater, result, evals)
    else:
        _per_gradient(events, updater, grads, lam, result, evals)
    result.weights = updater.w.copy()
    return result


def _per_gradient(events, updater, grads, lam, result, evals) -> None:
    """Train gradient by gradient: each arrival is summed as the PS sums it (blocks)."""
    have = [updater.w.copy() for _ in range(lam)]
    for i in range(lam):
        grads.start(i, have[i], 0)
    for t, i, _, _, arrival, resumed in events:
        updater.receive([grads.take(i)], arrival.scale, arrival.update)
        if arrival.update is not None:
            result.add_update(arrival.update, t)
            evals.after(updater.w, arrival.update, t)
        for j, step, _ in resumed:  # pull the newest weights, start the next gradient
            kernels.copy_into(have[j], updater.w)
            grads.start(j, have[j], step)
        result.sim_time = t


def _events(cfg, engine, lam, speeds, jitter, rng, max_updates):
    """The run's timing, which does not depend on the gradients' values: yields, per gradient
    arrival in simulated-time order, ``(t, learner, step, version, arrival, resumed)``: the
    learner's step (its minibatch), the weights version it computed on, the engine's
    ``Arrival``, and ``(learner, step, version)`` of each learner that then pulls the newest
    weights and starts its next gradient: those whose reply (``Arrival.reply``) the engine
    now says is due, in arrival order. Ends after the last update of the run."""
    have_ts = [0] * lam
    steps = [0] * lam
    held: list = []  # (learner, sync.Reply) of the gradients not answered yet
    events = [(_duration(speeds[i], jitter, rng), i) for i in range(lam)]
    heapq.heapify(events)
    limit = max_updates if max_updates is not None else math.inf
    while events and engine.updates < limit:
        t, i = heapq.heappop(events)
        version = have_ts[i]
        arrival = engine.receive(i, version)
        step = steps[i]
        steps[i] += 1
        update = arrival.update
        if update is not None and update.epoch >= cfg.train.epochs and max_updates is None:
            yield t, i, step, version, arrival, ()
            return
        held.append((i, arrival.reply))
        resume = [j for j, reply in held if engine.due(reply)]
        if resume:
            held = [(j, reply) for j, reply in held if not engine.due(reply)]
        for j in resume:
            have_ts[j] = engine.timestamp
            heapq.heappush(events, (t + _duration(speeds[j], jitter, rng), j))
        yield t, i, step, version, arrival, tuple((j, steps[j], have_ts[j]) for j in resume)


class _Evals:
    """Test error at the start, every ``train.eval_every_epochs`` and at the end."""

    def __init__(self, cfg, trainer, result, progress):
        self.cfg, self.trainer, self.result, self.progress = cfg, trainer, result, progress
        self.next = cfg.train.eval_every_epochs or math.inf

    def after(self, w, update, t) -> None:
        """Evaluate ``w`` (the weights ``update`` produced at time ``t``) if one is due."""
        if update.epoch >= self.next or update.epoch >= self.cfg.train.epochs:
            while update.epoch >= self.next:
                self.next += self.cfg.train.eval_every_epochs
            self.record(w, update.timestamp, update.epoch, t)

    def record(self, w, ts, epoch, t) -> None:
        err, loss = self.trainer.evaluate(w)
        self.result.evals.append(
            {"type": "eval", "ts": ts, "t": t, "epoch": epoch, "test_error": err, "test_loss": loss}
        )
        if self.progress:
            self.progress(
                f"epoch {epoch:7.2f}  ts {ts:6d}  test error {100 * err:6.2f}%  loss {loss:.4f}"
            )


def _duration(speed: float, jitter: float, rng) -> float:
    return speed * max(0.05, 1.0 + jitter * rng.standard_normal()) if jitter else speed


def write_run(cfg, result: SimResult, run_dir: str | Path) -> Path:
    """Write config.yaml, metrics.jsonl, summary.csv and plots for a simulation."""
    from ..results import plots

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_mod.save(cfg, config_path(run_dir))
    with open(metrics_path(run_dir), "w") as f:
        for rec in sorted(result.updates + result.evals, key=lambda r: (r["t"], r["ts"])):
            f.write(json.dumps(rec) + "\n")
    metrics = plots.read_metrics(metrics_path(run_dir))
    plots.write_summary_csv(metrics, run_dir / SUMMARY_FILE)
    plots.plot_run(run_dir)
    return run_dir


def main_simulate(cfg, run_dir, *, jitter, speeds, seed, train, gradients="auto") -> int:
    """Entry point of ``rudra-zmq simulate``: simulate, print a summary, write the run dir."""
    t0 = time.time()
    if cfg.train.schedule_scale != 1:
        print(
            f"schedule scaled x{cfg.train.schedule_scale:g}: {cfg.train.epochs:g} epochs, lr "
            f"steps at {list(cfg.optimizer.lr_steps)} (not the config's own budget)"
        )
    res = simulate(
        cfg,
        speeds=speeds,
        jitter=jitter,
        seed=seed,
        train=train,
        gradients=gradients,
        progress=lambda line: print(line, flush=True),
    )
    s = cfg.sync
    print(
        f"simulated {protocol_label(s.protocol, s.n)}, "
        f"λ={s.learners}, µ={s.batch_size}: {len(res.updates)} updates, "
        f"<σ> = {res.mean_staleness:.2f}"
        + (f", final test error {100 * res.evals[-1]['test_error']:.2f}%" if res.evals else "")
        + f" ({time.time() - t0:.1f} s)"
    )
    out = write_run(cfg, res, run_dir)
    print(f"run directory: {out}")
    return 0
