"""The simulator's real gradients (``train=True``): ``Trainer``, one torch model fed each
simulated learner's minibatches in the data server's order, and ``Gradients``, the per-gradient
path that computes them ahead of the simulated clock on a thread pool."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import kernels
from ..data.data_order import SampleStream, load_data
from . import sim_batched


class Trainer:
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
        if flat is None:  # build_model takes turns across threads
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


class Gradients:
    """The gradients of the learners in flight, computed ahead of the simulated clock.

    A learner's gradient depends only on the weights it pulled and its minibatch, both fixed
    when it starts, so with ``workers`` > 1 a thread pool computes it right then, each worker
    on its own model copy with 1/workers of the torch threads: on CPUs, small minibatches
    use one core each better than a few cores together. The values are those of computing
    one at a time with that thread count; with 1 worker each is computed when it arrives.
    """

    def __init__(self, trainer: Trainer, learners: int, workers: int):
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
