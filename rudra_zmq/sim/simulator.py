"""A deterministic in-process simulator of a Rudra-base run: no sockets, threads or clocks.

It drives the same :class:`~rudra_zmq.sync.SyncEngine` as the parameter server with learners
whose compute times are simulated (a speed per learner, optional random jitter), so staleness
distributions, updates per epoch and — with ``train=True`` — the accuracy that a protocol and
learning-rate policy reach can be studied reproducibly on one core, for any λ (30 learners
need neither 30 processes nor 30 copies of torch).

With ``train=True`` each learner computes its real gradient (PyTorch, ``sim_trainer``) on the
weights it last pulled, on its own minibatches in the data server's order (``data_order``), and
the PS's optimizer state and update are the parameter server's own (``update.Updater``); only
time is simulated. A learner goes on with the newest weights when the engine's reply to its
gradient says, as the parameter server answers its PUSHPULL then: hardsync learners after the
update, softsync/async learners at once.

Results go to a run directory in the statistics server's ``metrics.jsonl`` schema (``t`` is
simulated seconds), so ``plots.plot_run`` draws them like a real run.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import config as config_mod
from .. import kernels
from ..data.datasets import dataset_size
from ..run_files import SUMMARY_FILE, config_path, metrics_path, sim_checkpoint_path
from ..server.update import Updater
from ..sync import Rejoin, SyncEngine, protocol_label
from . import sim_batched, sim_checkpoint
from .sim_trainer import Gradients, Trainer


@dataclass
class SimResult:
    """What a simulation produced: per-update records and (if trained) evaluation records."""

    updates: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    sim_time: float = 0.0
    weights: np.ndarray | None = None  # final weights (train=True)

    def add_update(self, update, t: float) -> None:
        """Record ``update`` (a ``sync.Update``) made at simulated time ``t``."""
        self.updates.append(update.record(t))

    @property
    def mean_staleness(self) -> float:
        sig = [s for u in self.updates for s in u["sigmas"]]
        return float(np.mean(sig)) if sig else 0.0


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
    checkpoint: str | Path | None = None,
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
            ``sim_trainer.Gradients``), ``batched`` (one per weights version per update,
            ``sim_batched``: the same values up to summation order, for models without
            batch normalization or dropout) or ``auto`` (batched where it is exact and an
            update has more than one gradient).
        checkpoint: with ``train``, a file to checkpoint to after every evaluation
            (``sim_checkpoint``); when it exists, the simulation resumes from it (raises
            ``sim_checkpoint.CheckpointError`` if it is another simulation's).
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
        return _simulate(cfg, lam, speeds, jitter, seed, None, None, max_updates, progress, None)
    half = [k for k in ("gradient_dtype", "weights_dtype") if getattr(cfg.wire, k) != "float32"]
    if half:  # its figures would pass for the half wire's without having rounded anything
        raise ValueError(
            f"wire.{half[0]}={getattr(cfg.wire, half[0])}: the simulator trains on a float32 "
            "wire (it does not round gradients or weights); simulate with float32, or measure "
            "the half wire with `rudra-zmq run`"
        )
    import torch

    trainer = Trainer(cfg)
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
        else Gradients(trainer, lam, workers)
    )
    torch.set_num_threads(max(1, threads // workers))
    try:
        return _simulate(
            cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress, checkpoint
        )
    finally:
        grads.close()
        torch.set_num_threads(threads)


def _simulate(cfg, lam, speeds, jitter, seed, trainer, grads, max_updates, progress, checkpoint):
    o = cfg.optimizer
    engine = SyncEngine.of(cfg, trainer.n if trainer else dataset_size(cfg.data))
    result = SimResult()
    events = _events(cfg, engine, lam, speeds, jitter, np.random.default_rng(seed), max_updates)
    if not trainer:
        for t, _, _, _, arrival, _ in events:
            if arrival is not None and arrival.update is not None:
                result.add_update(arrival.update, t)
            result.sim_time = t
        return result
    batched = isinstance(grads, sim_batched.BatchedGradients)
    path = "batched" if batched else "per-gradient"
    print_ = sim_checkpoint.fingerprint(cfg, seed=seed, jitter=jitter, speeds=speeds, path=path)
    resume = None
    if checkpoint is not None and Path(checkpoint).exists():
        resume = sim_checkpoint.load(Path(checkpoint), print_)
    w0 = trainer.flat.weights if resume is None else resume.w
    segments = trainer.flat.segments() if o.param_multipliers else [(0, w0.size, 1.0, 1.0)]
    updater = Updater(w0, segments, o)  # the PS's optimizer state
    evals = _Evals(cfg, trainer, result, progress)
    if resume is None:
        evals.record(updater.w, 0, 0.0, 0.0)
    else:  # what the gradients made up to update resume.ts
        kernels.copy_into(updater.v, resume.v)
        result.evals, evals.next = list(resume.evals), resume.evals_next
        if progress:
            progress(f"resumed from {checkpoint}: update {resume.ts}, epoch {resume.epoch:.2f}")
    saver = None
    if checkpoint is not None:
        saver = sim_checkpoint.Saver(Path(checkpoint), print_, updater, evals)
    if batched:
        grads.run(events, updater, result, evals, saver, resume)
    else:
        _per_gradient(events, updater, grads, lam, result, evals, saver, resume)
    result.weights = updater.w.copy()
    return result


def _per_gradient(events, updater, grads, lam, result, evals, saver, resume) -> None:
    """Train gradient by gradient: each arrival is summed as the PS sums it (blocks). With
    ``resume`` (a ``sim_checkpoint.SimState``), the timing is replayed up to its update
    without computing, and the learners start on the weights versions it holds."""
    have = [updater.w.copy() for _ in range(lam)]
    have_ts, steps = [0] * lam, [0] * lam  # each learner's gradient in flight
    computing = [True] * lam  # False: its gradient arrived and it waits for its reply
    if resume is not None:
        for t, i, _, _, arrival, resumed in events:
            computing[i] = False
            for j, step, version in resumed:
                steps[j], have_ts[j], computing[j] = step, version, True
            update = arrival.update if arrival is not None else None
            if update is not None:
                result.add_update(update, t)
            result.sim_time = t
            if update is not None and update.timestamp == resume.ts:
                break
        for j in range(lam):
            if computing[j]:
                kernels.copy_into(have[j], resume.versions[have_ts[j]])
    for i in range(lam):
        if computing[i]:
            grads.start(i, have[i], steps[i])
    for t, i, _, _, arrival, resumed in events:
        grad = grads.take(i)
        computing[i], evaluated = False, False
        if arrival is not None:
            updater.receive([grad], arrival.scale, arrival.update)
        if arrival is not None and arrival.update is not None:
            result.add_update(arrival.update, t)
            evaluated = evals.after(updater.w, arrival.update, t)
        for j, step, version in resumed:  # pull the newest weights, start the next gradient
            kernels.copy_into(have[j], updater.w)
            have_ts[j], computing[j] = version, True
            grads.start(j, have[j], step)
        result.sim_time = t
        if saver is not None and arrival is not None and arrival.update and saver.due(evaluated):
            versions = {have_ts[j]: have[j] for j in range(lam) if computing[j]}
            saver.save(arrival.update, versions)


def _events(cfg, engine, lam, speeds, jitter, rng, max_updates):
    """The run's timing, which does not depend on the gradients' values: yields, per gradient
    arrival in simulated-time order, ``(t, learner, step, version, arrival, resumed)``: the
    learner's step (its minibatch), the weights version it computed on, the engine's
    ``Arrival`` (None: the engine refused the gradient, and the learner starts the same step
    again on the newest weights), and ``(learner, step, version)`` of each learner that then
    pulls the newest
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
        try:
            arrival = engine.receive(i, version)
        except Rejoin:  # refused, as the PS refuses it: the same minibatch on the newest weights
            have_ts[i] = engine.timestamp
            heapq.heappush(events, (t + _duration(speeds[i], jitter, rng), i))
            yield t, i, steps[i], version, None, ((i, steps[i], have_ts[i]),)
            continue
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

    def after(self, w, update, t) -> bool:
        """Evaluate ``w`` (the weights ``update`` produced at time ``t``) if one is due;
        returns whether it did."""
        if update.epoch >= self.next or update.epoch >= self.cfg.train.epochs:
            while update.epoch >= self.next:
                self.next += self.cfg.train.eval_every_epochs
            self.record(w, update.timestamp, update.epoch, t)
            return True
        return False

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


def main_simulate(
    cfg, run_dir, *, jitter, speeds, seed, train, gradients="auto", resume=False
) -> int:
    """Entry point of ``rudra-zmq simulate``: simulate, print a summary, write the run dir.
    With ``train`` it checkpoints to the run dir after each evaluation, and continues from
    there with ``resume`` (else an unfinished simulation's checkpoint there is refused)."""
    t0 = time.time()
    checkpoint = sim_checkpoint_path(run_dir) if train else None
    if checkpoint is not None and checkpoint.exists() and not resume:
        where = sim_checkpoint.describe(checkpoint) or "unreadable"
        raise ValueError(
            f"{run_dir} holds an unfinished simulation's checkpoint ({where}): add --resume "
            "to continue it, or choose another --run-dir"
        )
    if resume and (checkpoint is None or not checkpoint.exists()):
        raise ValueError(
            f"--resume: {run_dir} holds no simulator checkpoint "
            f"({sim_checkpoint_path(run_dir).name}; only `simulate --train` writes one)"
        )
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
        checkpoint=checkpoint,
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
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)  # the run directory is complete
    print(f"run directory: {out}")
    return 0
