"""Train your own model on your own data through the Python API (docs/api.md).

    python examples/custom_model.py

The model and the data are two functions of this file, named in the config by import path
(``custom_model:tiny_cnn``, ``custom_model:stripes``). Every role runs in its own process and
imports this file as the module ``custom_model``; ``rudra_zmq.train`` hands them the folder it
is in (PYTHONPATH). About 30 s on 2 cores, most of it starting the roles.
"""

import numpy as np
import torch
from torch import nn

import rudra_zmq


def tiny_cnn(num_classes, input_shape):
    """The model: called with the number of classes and the image shape (C, H, W)."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * (h // 2) * (w // 2), num_classes),
    )


tiny_cnn.input_transform = "standardize"  # (x/255 - mean)/std per channel, the default


def stripes(seed=0):
    """The data: 12x12 grayscale images of a horizontal (0), vertical (1) or diagonal (2)
    stripe pattern in noise, as uint8 (N, C, H, W) with integer labels, train and test."""
    rng = np.random.default_rng(seed)
    i, j = np.mgrid[:12, :12]
    patterns = np.stack([(i % 4 < 2), (j % 4 < 2), ((i + j) % 4 < 2)]).astype(np.float32)

    def draw(n):
        y = rng.integers(0, 3, n)
        x = 40 * patterns[y] + rng.normal(100, 50, (n, 12, 12))
        return np.clip(x, 0, 255).astype(np.uint8)[:, None], y

    x_train, y_train = draw(1200)
    x_test, y_test = draw(300)
    return {
        "x_train": x_train,
        "y_train": y_train,
        "x_test": x_test,
        "y_test": y_test,
        "classes": ["horizontal", "vertical", "diagonal"],
    }


CONFIG = {
    "name": "custom_model",
    "model": {"name": "custom_model:tiny_cnn", "seed": 0},
    "data": {"dataset": "custom_model:stripes", "num_classes": 3},
    "sync": {"protocol": "softsync", "n": 1, "learners": 2, "batch_size": 16},
    "optimizer": {"lr": 0.05, "lr_policy": "staleness", "momentum": 0.9},
    "train": {"epochs": 3, "eval_every_epochs": 1},
}

if __name__ == "__main__":
    torch.set_num_threads(1)
    result = rudra_zmq.train(CONFIG, overrides={"runtime.threads_per_learner": 1})
    print(
        f"test error {100 * result.final_error:.1f}% after {result.epochs:.1f} epochs, "
        f"<σ> {result.mean_sigma:.2f}; run directory {result.run_dir}"
    )
    assert result.final_error < 0.1, "the stripes are easy to tell apart: it should learn them"
