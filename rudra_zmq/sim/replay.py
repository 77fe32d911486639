"""``rudra-zmq replay RUN_DIR``: a real Rudra-base run recomputed in one process from the
parameter server's arrivals log (``arrival_log``) and the data order, to the same weights.

The PS recorded each gradient's (learner, timestamp it was computed on, step), each eviction
and each rejoin, in the order its sync engine took them. Replay feeds the same events to a
fresh ``SyncEngine`` (so every update, α and momentum is the run's), computes each gradient
with the simulator's ``Trainer`` on the weights version it was computed on and the learner's
minibatch at that step (``data_order``: the data server's), with the learners' torch thread
count, and sums and applies them with the PS's own ``Updater``. On CPU this ends with the run's
weights bit for bit (``tests/test_replay.py``): the learners' arithmetic is torch's with the
same inputs and threads, the PS's is the same kernels in the same order.

Refused with the reason: a PS tree (its nodes sum gradients before the root sees them), data
augmentation (the trainer does not augment), a run whose PS restarted (the updates lost since
its checkpoint are not in the log). ``--until TS`` stops at the update that made timestamp TS
and shows it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, load_config
from ..devices import learner_threads
from ..results.record_fields import DamagedRecord
from ..results.records import load_final
from ..run_files import ARRIVALS_FILE, PS_FINAL_FILE, WEIGHTS_FILE, config_path
from ..server import arrival_log
from ..server.update import Updater
from ..shape import ClusterShape
from ..sync import SyncEngine

GRADIENT, LEAVE, JOIN = arrival_log.GRADIENT, arrival_log.LEAVE, arrival_log.JOIN


class ReplayError(ValueError):
    """A run that replay cannot reproduce, with the reason."""


@dataclass
class Replayed:
    """What a replay reached: the weights after the update of ``timestamp`` (the last one,
    or ``--until``'s), that update (None at timestamp 0), and the events and gradients used;
    ``final``: the run's own final weights (``weights.npy``; None with ``until``)."""

    weights: np.ndarray
    timestamp: int
    update: object
    events: int
    gradients: int
    final: np.ndarray | None = None


def _check(cfg) -> None:
    if cfg.architecture.kind != "base":
        raise ReplayError(
            f"architecture.kind={cfg.architecture.kind}: replay takes Rudra-base runs (a "
            "tree node sums its learners' gradients before the root's engine sees them)"
        )
    if cfg.data.augment:
        raise ReplayError(
            "data.augment is on: the simulator's trainer does not augment, so it cannot "
            "recompute these gradients"
        )


def _last_updates(cfg, events, n, run_dir: Path) -> tuple[int, dict, int]:
    """A first pass of the engine alone over ``events``: the index of the last event that
    completes an update (gradients after it never reached the weights), per weights
    timestamp the index of the last gradient computed on it, and the timestamp the log ends
    at. Raises ReplayError for events the engine refuses (a damaged log, or another run's
    config)."""
    engine, last, uses = SyncEngine.of(cfg, n), -1, {}
    for i, (kind, learner, ts, _) in enumerate(events.tolist()):
        try:
            if kind == GRADIENT:
                uses[ts] = i
                update = engine.receive(learner, ts).update
            elif kind == LEAVE:
                update = engine.leave(learner)
            else:
                engine.join(learner)
                update = None
        except ValueError as exc:
            raise ReplayError(
                f"{run_dir / ARRIVALS_FILE} event {i} is refused by the sync engine of "
                f"{config_path(run_dir)}: {exc} (the log is damaged, or the config is not "
                "the run's)"
            ) from None
        if update is not None:
            last = i
    return last, uses, engine.timestamp


def _final_weights(run_dir: Path, numel: int, timestamp: int) -> np.ndarray:
    """The run's final weights (``weights.npy``), once ``ps_final.json`` says they are at
    ``timestamp``, where the arrivals log ends. Raises ReplayError naming the file and what
    is wrong with it: missing, damaged, not ``numel`` float32 values, or a log that ends
    elsewhere (truncated, or another run's). Reads two files."""
    try:
        final = load_final(run_dir)
    except DamagedRecord as exc:
        raise ReplayError(str(exc)) from None
    if final is None:
        raise ReplayError(
            f"{run_dir / PS_FINAL_FILE} does not exist: the run did not finish, so there are "
            "no final weights to compare with (replay --until TS shows the weights at TS)"
        )
    if final["timestamp"] != timestamp:
        raise ReplayError(
            f"{run_dir / ARRIVALS_FILE}, replayed with {config_path(run_dir)}, ends at "
            f"timestamp {timestamp} but {run_dir / PS_FINAL_FILE} says training ended at "
            f"{final['timestamp']}: the log is truncated or damaged, or one of the three "
            "files is another run's (the sync settings decide when an update is made)"
        )
    path = run_dir / WEIGHTS_FILE
    try:
        w = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ReplayError(f"{path} does not exist: the run's final weights are missing") from None
    except (OSError, ValueError, EOFError) as exc:
        raise ReplayError(f"{path} cannot be read as .npy ({exc}): damaged") from None
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.shape != (numel,):
        what = f"{w.dtype} {w.shape}" if isinstance(w, np.ndarray) else type(w).__name__
        raise ReplayError(
            f"{path} holds {what}, not the model's {numel:,} float32 values (damaged, or "
            "another model's)"
        )
    return w


def replay(run_dir, until: int | None = None, threads: int | None = None) -> Replayed:
    """Recompute the run in ``run_dir`` up to the update of timestamp ``until`` (default: its
    last). ``threads``: torch threads per gradient (default: the run's learners' count).
    Everything it reads is checked before the first gradient is computed: the config, the
    arrivals log (``arrival_log.read``, then the engine), and without ``until`` the run's
    ``ps_final.json`` and ``weights.npy``. Blocks (computes every gradient); raises
    ReplayError, ConfigError or FileNotFoundError."""
    import torch

    from .sim_trainer import Trainer

    run_dir = Path(run_dir)
    cfg = load_config(config_path(run_dir))
    _check(cfg)
    logs = [s.files_dir(run_dir) for s in ClusterShape.of(cfg).servers]  # each server's own
    if len(logs) != 1:  # what replay supports, not a layout: it recomputes one engine
        raise ReplayError(
            f"architecture.servers={len(logs)}: replay takes runs of one server (each "
            f"server logs its own arrivals, in {logs[1].parent}/server-I/arrivals.bin, "
            "which replay does not join yet)"
        )
    try:
        restarts = (load_final(run_dir) or {}).get("restarts", [])
    except DamagedRecord as exc:
        raise ReplayError(str(exc)) from None
    copied = [r for r in restarts if r["from"].startswith("learner")]
    if copied:  # its weights came from a learner's copy, which the log does not hold
        raise ReplayError(
            f"{run_dir / PS_FINAL_FILE}: the parameter server restarted at ts "
            f"{copied[0]['ts']} from {copied[0]['from']}'s copy of its weights, which the "
            "arrivals log does not hold: replay recomputes runs whose restarts were from "
            "checkpoints"
        )
    try:
        events = arrival_log.read(logs[0])
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    torch.set_num_threads(threads or learner_threads(cfg))
    try:
        trainer = Trainer(cfg)
    except ValueError as exc:  # a model or data set the config names that is not one
        raise ReplayError(f"{config_path(run_dir)}: {exc}") from None
    last, uses, reached = _last_updates(cfg, events, trainer.n, run_dir)
    o = cfg.optimizer
    w0 = trainer.flat.weights
    final = None if until is not None else _final_weights(run_dir, w0.size, reached)
    segments = trainer.flat.segments() if o.param_multipliers else [(0, w0.size, 1.0, 1.0)]
    updater, engine = Updater(w0, segments, o), SyncEngine.of(cfg, trainer.n)
    versions = {0: updater.w.copy()}
    done = Replayed(updater.w, 0, None, 0, 0, final)
    for i, (kind, learner, ts, step) in enumerate(events[: last + 1].tolist()):
        update = None
        if kind == GRADIENT:
            arrival = engine.receive(learner, ts)
            update = arrival.update
            g = trainer.gradient(versions[ts], learner, step)
            updater.receive([g], arrival.scale, update)
            done.gradients += 1
            if uses.get(ts) == i:
                versions.pop(ts, None)  # no later gradient is computed on it
        elif kind == LEAVE:
            update = engine.leave(learner)
            if update is not None:
                updater.receive((), 1.0, update, 0)
        else:
            engine.join(learner)
        done.events = i + 1
        if update is not None:
            done.timestamp, done.update = update.timestamp, update
            if uses.get(update.timestamp, -1) > i:
                versions[update.timestamp] = updater.w.copy()
            if until is not None and update.timestamp >= until:
                break
    if until is not None and done.timestamp < until:
        raise ReplayError(f"--until {until}: the run's last update made timestamp {done.timestamp}")
    done.weights = updater.w.copy()
    return done


def add_parser(sub) -> None:
    """Register ``rudra-zmq replay`` on the CLI's subparsers."""
    p = sub.add_parser(
        "replay",
        help="recompute a Rudra-base run from its PS's arrivals log, to the same weights",
        description="Feed the parameter server's recorded arrivals (learner, timestamp, "
        "step; RUN/arrivals.bin) to the sync engine and recompute every gradient from the "
        "data order: the run's weights, bit for bit on CPU, or the weights at one update.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--until", type=int, metavar="TS", help="stop at the update that made TS")
    p.add_argument("--out", metavar="FILE", help="save the replayed weights (.npy)")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    """Replay, compare with RUN/weights.npy (or show --until's update). Returns 0, 1 when
    the final weights differ from the run's, 2 when the run cannot be replayed."""
    try:
        r = replay(args.run_dir, until=args.until)
    except (ReplayError, ConfigError, FileNotFoundError) as exc:
        print(f"rudra-zmq replay: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        np.save(args.out, r.weights)
    print(f"replayed {r.events:,} events ({r.gradients:,} gradients) to timestamp {r.timestamp}")
    if args.until is not None:
        u = r.update
        print(
            f"update {u.timestamp}: learners {list(u.learners)}, computed on "
            f"{list(u.timestamps)}, σ {list(u.sigmas)}, ⟨σ⟩ {u.mean_sigma:.2f}, α {u.lr:.6g}, "
            f"epoch {u.epoch:.3f}"
        )
        return 0
    final = r.final
    if np.array_equal(final, r.weights):
        print(f"the same weights as {WEIGHTS_FILE}, bit for bit ({final.size:,} values)")
        return 0
    diff = np.abs(final.astype(np.float64) - r.weights)
    print(
        f"the weights differ from {WEIGHTS_FILE}: {int((diff > 0).sum()):,} of {final.size:,} "
        f"values, max |difference| {diff.max():.3g}"
    )
    return 1
