"""The simulator's batched gradients: one forward/backward per weights version per update.

An update averages c gradients, each the mean loss gradient over µ samples. The gradients of
one update that were computed on the same weights version arrive at the same PS timestamp, so
they have the same staleness and the same scale (every learning-rate policy, ``per_gradient``
included), and their sum is k times the gradient of the mean loss over their k·µ samples
together. ``BatchedGradients`` computes exactly that: per update, one batch per weights
version it draws on, instead of one minibatch of µ per gradient. The values equal the
per-gradient path's up to float summation order (tested), provided every sample's loss
depends on that sample alone: no batch normalization, no dropout (``exact_for``).

The simulated timing does not depend on the gradients' values, so the simulator's event
stream (``simulator._events``) runs up to ``lookahead`` updates ahead of the training: a
batch is computed as soon as its weights version exists, on ``workers`` threads (each its
own model copy) -- this is what keeps many small, stale updates (30-softsync, c = 1) busy on
every core. The weights versions still to be used are kept in a dict (one copy each), and
dropped once no learner holds them and no batch still needs them.

Not thread-safe: one simulator drives it; its worker threads only compute.
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Modules whose output for a sample depends on the other samples of the batch or on a random
# draw: a batched forward is then not the per-gradient path's computation.
_BATCH_DEPENDENT = (
    "_BatchNorm",
    "_DropoutNd",
    "SyncBatchNorm",
    "AlphaDropout",
    "FeatureAlphaDropout",
)


def exact_for(module, builtin: bool) -> bool:
    """Whether batching gradients computes the per-gradient values for ``module``: a built-in
    model (``builtin``) with no batch-normalization or dropout layer (cifar10_full's LRN is
    per sample and per channel). A user model is not assumed exact: its forward may call
    dropout itself. Pure."""
    if not builtin:
        return False
    for m in module.modules():
        if any(c.__name__ in _BATCH_DEPENDENT for c in type(m).__mro__):
            return False
    return True


def default_workers(threads: int, learners: int, per_update: int) -> int:
    """Worker threads for the batched path: about as many as updates can be computed at once
    (λ/c: 1 for hardsync and 1-softsync, whose one big batch per update uses every thread;
    λ for 30-softsync), at most one per thread. Pure."""
    return max(1, min(threads, learners // max(per_update, 1)))


class _Group:
    """The gradients of one update computed on one weights version: their (learner, step)
    pairs, their common scale, and (once computed) k times their mean gradient's source."""

    __slots__ = ("version", "members", "scale", "job")

    def __init__(self, version: int, scale: float):
        self.version, self.scale, self.members, self.job = version, scale, [], None


class BatchedGradients:
    """Computes the updates' gradient sums by weights version; see the module docstring.

    Args:
        trainer: the simulator's ``sim_trainer.Trainer`` (``group_gradient``, ``flat``).
        workers: threads computing batches ahead (1: each batch when its update is applied).
        lookahead: updates the event stream may run ahead of the training.
    """

    def __init__(self, trainer, workers: int, lookahead: int):
        self.trainer = trainer
        self.pool = ThreadPoolExecutor(workers, "sim-batch") if workers > 1 else None
        self.lookahead = max(1, lookahead)
        self.store: dict[int, np.ndarray] = {}  # weights versions still needed
        self.held = Counter()  # version -> learners holding it at the events' frontier
        self.refs = Counter()  # version -> batches on it not applied yet
        self.unready: dict[int, list] = {}  # version -> batches waiting for it to exist
        self.applied = 0  # the newest version the training has produced
        self.saver = None  # a sim_checkpoint.Saver, for run()

    def run(self, events, updater, result, evals, saver=None, resume=None) -> None:
        """Consume the simulator's events, applying each update with ``updater`` and recording
        it in ``result`` and ``evals`` (as ``simulator._per_gradient`` does), checkpointing
        with ``saver`` (a ``sim_checkpoint.Saver``) after each evaluation. With ``resume``
        (a ``sim_checkpoint.SimState``), the updates up to its own are replayed without
        computing; its weights versions serve the batches after it. Blocks."""
        lam = self.trainer.cfg.sync.learners
        self.saver = saver
        self.held[0] = lam
        if resume is None:
            self.store[0] = updater.w.copy()
        else:
            self.store, self.applied = dict(resume.versions), resume.ts
        pending: deque = deque()  # (t, update, groups) decided by the events, not applied
        forming: dict[int, _Group] = {}
        for t, i, step, version, arrival, resumed in events:
            if arrival is None:  # refused (stages.py, bounded staleness): restarted
                self.held[version] -= 1
                for _, _, v in resumed:
                    self.held[v] += 1
                continue
            g = forming.get(version)
            if g is None:
                g = forming[version] = _Group(version, arrival.scale)
            elif g.scale != arrival.scale:  # same version, same update: same σ
                raise RuntimeError(
                    f"gradients of version {version} in one update got scales "
                    f"{g.scale} and {arrival.scale}"
                )
            g.members.append((i, step))
            self.held[version] -= 1
            for _, _, v in resumed:
                self.held[v] += 1
            result.sim_time = t
            if arrival.update is None:
                continue
            result.add_update(arrival.update, t)
            groups, forming = list(forming.values()), {}
            if resume is not None and arrival.update.timestamp <= resume.ts:
                continue  # applied before the checkpoint
            for g in groups:
                self.refs[g.version] += 1
                if g.version <= self.applied:
                    self._submit(g)
                else:
                    self.unready.setdefault(g.version, []).append(g)
            pending.append((t, arrival.update, groups))
            while len(pending) > self.lookahead:
                self._apply(*pending.popleft(), updater, evals)
        while pending:
            self._apply(*pending.popleft(), updater, evals)

    def _submit(self, g: _Group) -> None:
        if self.pool:
            g.job = self.pool.submit(self.trainer.group_gradient, self.store[g.version], g.members)

    def _apply(self, t, update, groups, updater, evals) -> None:
        last = len(groups) - 1
        for n, g in enumerate(groups):
            grad = (
                g.job.result()
                if g.job is not None
                else self.trainer.group_gradient(self.store[g.version], g.members)
            )
            k = len(g.members)  # grad is the mean over k gradients' samples: sum = k * grad
            if n < last:
                updater.add([grad], g.scale * k)
            else:
                updater.receive([grad], g.scale * k, update, count=k)
            self.refs[g.version] -= 1
        self.applied = update.timestamp
        evaluated = evals.after(updater.w, update, t)
        if self.held[self.applied] > 0 or self.applied in self.unready:
            self.store[self.applied] = updater.w.copy()
            for g in self.unready.pop(self.applied, ()):
                self._submit(g)
        for v in [v for v in self.store if self.refs[v] <= 0 and self.held[v] <= 0]:
            del self.store[v]
        if self.saver is not None and self.saver.due(evaluated):  # + the versions still needed
            self.saver.save(update, self.store)

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)
