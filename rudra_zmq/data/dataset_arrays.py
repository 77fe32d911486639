"""The ``Dataset`` record: one dataset's images and labels in memory, and ``make_dataset``,
which builds one from arrays and computes the per-channel mean/std of the training images.

Every source builds its Dataset here: the named datasets (:mod:`rudra_zmq.data.datasets`) and the
user's own (:mod:`rudra_zmq.data.user_data`). No package imports; pure; nothing blocks beyond the
arithmetic on the arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Dataset:
    """Images and labels of one dataset, held in memory. ``mean``/``std`` are per channel of
    the training images on the 0..1 scale (feed them to ``to_float``)."""

    name: str
    x_train: np.ndarray  # uint8 (N, C, H, W)
    y_train: np.ndarray  # int64 (N,)
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self):
        k = len(self.classes)
        for split, x, y in (
            ("train", self.x_train, self.y_train),
            ("test", self.x_test, self.y_test),
        ):
            if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != self.x_train.shape[1:]:
                raise ValueError(
                    f"{self.name}: x_{split} is {x.dtype} {x.shape}; both splits "
                    "need uint8 (N, C, H, W) with one image shape"
                )
            if (
                y.dtype != np.int64
                or y.shape != x.shape[:1]
                or (y.size and not 0 <= y.min() <= y.max() < k)
            ):
                raise ValueError(
                    f"{self.name}: y_{split} must be int64 ({x.shape[0]},) with "
                    f"labels in 0..{k - 1}, got {y.dtype} {y.shape}"
                )
        if not len(self.mean) == len(self.std) == self.x_train.shape[1]:
            raise ValueError(f"{self.name}: mean/std need one value per channel")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def channel_stats(x: np.ndarray):
    """Exact per-channel mean and std (0..1 scale) of uint8 images via a 256-bin histogram,
    which avoids a float64 copy of the whole training set."""
    v = np.arange(256, dtype=np.float64) / 255.0
    mean, std = [], []
    for c in range(x.shape[1]):
        h = np.bincount(x[:, c].ravel(), minlength=256).astype(np.float64)
        n = max(h.sum(), 1.0)
        m = float(h @ v / n)
        mean.append(m)
        std.append(float(math.sqrt(max(h @ (v * v) / n - m * m, 0.0))))
    return tuple(mean), tuple(std)


def make_dataset(name, x_tr, y_tr, x_te, y_te, classes) -> Dataset:
    """The Dataset of these arrays (images made contiguous), with the training images'
    per-channel mean/std. Raises ValueError (``Dataset``) for arrays of the wrong kind."""
    mean, std = channel_stats(x_tr)
    return Dataset(
        name,
        np.ascontiguousarray(x_tr),
        y_tr,
        np.ascontiguousarray(x_te),
        y_te,
        list(classes),
        mean,
        std,
    )


__all__ = ["Dataset", "channel_stats", "make_dataset"]
