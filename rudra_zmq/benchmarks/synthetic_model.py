"""A synthetic model for the LAN benchmarks: L layers of real parameter tensors whose forward
and backward sleep, so that real training code (PyTorch's ``DistributedDataParallel`` with
its bucketing and overlap, or rudra_zmq's own learner) runs on it with compute of a chosen
length and a model of a chosen size, on a machine whose cores must stay free for the links.

Layer i holds ``numel_i`` float32 parameters (``params`` split evenly over ``layers``). Its
forward adds the first ``num_classes`` of them to the activations (N, num_classes) and sleeps
``forward_ms / layers``; its backward sleeps ``backward_ms / layers`` and writes a dense
gradient of the whole tensor (each element a small multiple of the upstream gradient's mean,
the first ``num_classes`` the exact gradient of the addition), so the gradient a layer hands
autograd is as large as a real layer's and is ready when a real one would be: the last layer
first, as backward runs. A sleep releases the GIL, so a communication thread (gloo's, or
ZeroMQ's I/O thread) runs meanwhile, as it would beside real compute on other cores.

Registered for rudra_zmq's learners as an import path (``model.name``, ``models.py``'s user
model path): ``rudra_zmq.benchmarks.synthetic_model:lan_1s`` (issue 42's setting: 10M
parameters in 20 layers, forward 333 ms, backward 667 ms) and ``...:lan_100ms`` (the same in
100 ms). Importing this module imports torch.
"""

from __future__ import annotations

import time

import torch
from torch import nn

LAYERS = 20
PARAMS = 10_000_000
FORWARD_MS = 333.0
BACKWARD_MS = 667.0


class _Sleep(torch.autograd.Function):
    """y = h + w[:k]; forward and backward each sleep a fixed time (seconds)."""

    @staticmethod
    def forward(ctx, h, w, forward_s: float, backward_s: float):
        ctx.backward_s, ctx.k, ctx.n = backward_s, h.shape[1], w.numel()
        if forward_s > 0:
            time.sleep(forward_s)
        return h + w[: h.shape[1]]

    @staticmethod
    def backward(ctx, g):
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        gw = torch.full((ctx.n,), 1e-4, dtype=g.dtype).mul_(g.mean())
        gw[: ctx.k] = g.sum(0)
        return g, gw, None, None


class SleepLayer(nn.Module):
    """One layer: ``numel`` parameters, forward sleeping ``forward_s``, backward ``backward_s``."""

    def __init__(self, numel: int, forward_s: float, backward_s: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Blocks ``forward_s``."""
        return _Sleep.apply(h, self.weight, self.forward_s, self.backward_s)


class SleepModel(nn.Module):
    """``layers`` SleepLayers over ``params`` parameters in all; input (N, C, H, W) images,
    output class scores (N, num_classes). Blocks ``forward_ms`` per forward, ``backward_ms``
    per backward. Raises ValueError when a layer would hold fewer than ``num_classes``."""

    def __init__(
        self,
        num_classes: int = 10,
        params: int = PARAMS,
        layers: int = LAYERS,
        forward_ms: float = FORWARD_MS,
        backward_ms: float = BACKWARD_MS,
    ):
        super().__init__()
        if layers < 1 or params // layers < num_classes:
            raise ValueError(
                f"synthetic model: {params:,} parameters in {layers} layers leave fewer than "
                f"num_classes={num_classes} per layer; give more parameters or fewer layers"
            )
        if forward_ms < 0 or backward_ms < 0:
            raise ValueError(
                f"synthetic model: compute times must be >= 0, got {forward_ms}, {backward_ms}"
            )
        sizes = [params // layers] * layers
        sizes[-1] += params - sum(sizes)
        f, b = forward_ms / 1000 / layers, backward_ms / 1000 / layers
        self.num_classes = num_classes
        self.layers = nn.ModuleList(SleepLayer(n, f, b) for n in sizes)
        for i, layer in enumerate(self.layers):  # distinct, reproducible weights
            with torch.no_grad():
                layer.weight.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores of the images ``x``. Blocks the forward time."""
        h = x.flatten(1).mean(1, keepdim=True).expand(-1, self.num_classes)
        for layer in self.layers:
            h = layer(h)
        return h


def lan_1s(num_classes: int, in_shape) -> SleepModel:
    """Issue 42's model: 10M parameters in 20 layers, forward 333 ms, backward 667 ms."""
    return SleepModel(num_classes)


def lan_100ms(num_classes: int, in_shape) -> SleepModel:
    """The same model with 100 ms of compute: forward 33.3 ms, backward 66.7 ms."""
    return SleepModel(num_classes, forward_ms=FORWARD_MS / 10, backward_ms=BACKWARD_MS / 10)


MODULE_NAME = "lan_sleep_model"  # write_module's file, in the folder it is given


def write_module(
    folder: str, params: int, layers: int, forward_ms: float, backward_ms: float
) -> str:
    """Write ``folder/lan_sleep_model.py``, a user model (``models.py``'s import path) that
    builds ``SleepModel`` with these sizes and times, and return its ``model.name``
    (``lan_sleep_model:model``): with ``folder`` on the path (``PYTHONPATH``), ``rudra-zmq
    run``/``launch`` and every role of the LAN bench build the very module real DDP runs.
    Blocks on the file system only."""
    import os

    text = (
        '"""Written by rudra_zmq.benchmarks.synthetic_model.write_module."""\n\n'
        "from rudra_zmq.benchmarks.synthetic_model import SleepModel\n\n\n"
        "def model(num_classes, in_shape):\n"
        f"    return SleepModel(num_classes, {int(params)}, {int(layers)}, "
        f"{float(forward_ms)!r}, {float(backward_ms)!r})\n"
    )
    with open(os.path.join(folder, f"{MODULE_NAME}.py"), "w") as f:
        f.write(text)
    return f"{MODULE_NAME}:model"
