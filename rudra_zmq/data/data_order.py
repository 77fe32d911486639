"""Which samples each learner trains on: the run's dataset and its sample order.

The order of samples is one endless stream: the concatenation of per-epoch permutations, the
permutation of epoch ``e`` seeded by ``(train.seed, e)``. Learner ``i``'s minibatch at its step
``k`` is the stream positions ``[(k*λ + i)*µ, (k*λ + i + 1)*µ)`` (λ = ``sync.learners``,
µ = ``sync.batch_size``)::

    stream   | L0 k=0 | L1 k=0 | ... | Lλ-1 k=0 | L0 k=1 | L1 k=1 | ...
             |<- µ  ->|

So λ learners of µ each see exactly the batches one learner of λ·µ would, whatever their
timing, and no two batches overlap. The data server serves it over ZeroMQ
(``data/server.py``); the simulator reads it directly. No sockets here.
"""

from __future__ import annotations

import collections

import numpy as np

from . import datasets

PERM_CACHE_EPOCHS = 4  # epoch permutations kept (learners may straddle an epoch boundary)


def load_data(cfg) -> datasets.Dataset:
    """The run's dataset as every role sees it (train and test split). Blocks while loading.

    The dataset seed is the loader's default, not ``train.seed``: the data (the digits split,
    the synthetic images) stays the same when only the sample order changes. Raises ValueError
    when the data has more classes than ``data.num_classes``.
    """
    d = cfg.data
    ds = datasets.load_configured(d)
    if ds.num_classes > d.num_classes:
        raise ValueError(
            f"data.num_classes is {d.num_classes} but {d.dataset} has "
            f"{ds.num_classes} classes; set data.num_classes={ds.num_classes}"
        )
    return ds


class SampleStream:
    """Stream positions -> sample indices over concatenated per-epoch permutations.

    The permutation of epoch ``e`` comes from ``np.random.default_rng((seed, e))``; the last
    few are cached. Not thread-safe (the cache); does not block beyond computing a permutation.
    """

    def __init__(self, n: int, seed: int, cache_epochs: int = PERM_CACHE_EPOCHS):
        if n < 1:
            raise ValueError(f"cannot stream an empty dataset (n={n})")
        self.n = n
        self.seed = seed % 2**63  # SeedSequence takes non-negative integers only
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._cache_epochs = cache_epochs

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (int64, length n). Do not modify it."""
        perm = self._cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._cache[epoch] = perm
            if len(self._cache) > self._cache_epochs:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(epoch)
        return perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices of stream positions [start, start + count), crossing epochs if needed."""
        out = np.empty(count, dtype=np.int64)
        filled, pos = 0, start
        while filled < count:
            epoch, off = divmod(pos, self.n)
            take = min(count - filled, self.n - off)
            out[filled : filled + take] = self.permutation(epoch)[off : off + take]
            filled += take
            pos += take
        return out

    def batch(self, learner: int, step: int, learners: int, batch_size: int) -> np.ndarray:
        """Sample indices of learner ``learner``'s minibatch at its ``step`` in a run of
        ``learners`` learners of ``batch_size`` each (the strided order above). No checks."""
        return self.indices((step * learners + learner) * batch_size, batch_size)


__all__ = ["SampleStream", "load_data", "PERM_CACHE_EPOCHS"]
