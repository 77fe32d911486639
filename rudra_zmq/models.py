"""The networks learners train, by name, and their per-parameter learning-rate multipliers.

``build_model(name, num_classes, in_shape)`` is the only constructor the rest of the package
uses; ``MODEL_NAMES`` lists what it knows. ``input_transform(name)`` is how that model wants its
uint8 images as floats: every role that feeds a model (learners, the statistics server's
evaluation, the simulator) preprocesses through it. ``param_multipliers(model)`` gives, for each tensor in
``model.parameters()`` order, ``(numel, lr_mult, decay_mult)``: the parameter server applies
them per segment of the flat weight vector (see ``rudra_zmq.flat.FlatModel.segments``).

Models:
  cifar10_full  Caffe's ``examples/cifar10/cifar10_full_train_test.prototxt``, layer for layer,
                with its fillers and its ``lr_mult``/``decay_mult`` (89,578 parameters at 3x32x32).
  digits_cnn    two 3x3 convolutions and a linear layer for sklearn's 8x8 digits (~10k params).
  alexnet       torchvision's AlexNet (ImageNet-shaped configs, 3x224x224).
  mlp           Flatten -> Linear -> ReLU -> Linear, for any input shape (tests, benchmarks).

Your own model: ``name`` may be an import path ``package.module:function`` (``user_code``).
The function takes ``(num_classes, input_shape)`` and returns a ``torch.nn.Module`` of float32
CPU parameters; an attribute ``input_transform`` on the function (an ``InputTransform``, one of
``TRANSFORM_KINDS``, or a callable like ``InputTransform.__call__``) says how it wants its
images, else they are standardized. ``check_model`` builds it once and runs it on a batch.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .data.datasets import to_float
from .user_code import UserCodeError, is_import_path, resolve
from .user_code import call as _call_user

MODEL_NAMES = ("cifar10_full", "digits_cnn", "alexnet", "mlp")

MLP_HIDDEN = 64

# Set by build_model on the modules it makes: parameter name -> (lr_mult, decay_mult).
# Parameters missing from it (and modules not built here) get (1.0, 1.0).
_MULTS_ATTR = "rudra_param_mults"
_BUILD_LOCK = threading.Lock()  # build_model: one build at a time per process


class WithinChannelLRN(nn.Module):
    """Caffe's LRN layer with ``norm_region: WITHIN_CHANNEL``.

    y = x / (1 + alpha * mean_{local_size x local_size}(x^2))^beta, where the mean runs over a
    zero-padded square window of the same channel and always divides by local_size^2 (Caffe
    builds it from an AVE pooling layer with pad (local_size-1)/2, whose divisor counts padding).
    PyTorch's ``nn.LocalResponseNorm`` is the ACROSS_CHANNELS variant, hence this class.
    """

    def __init__(self, local_size: int = 3, alpha: float = 5e-5, beta: float = 0.75):
        super().__init__()
        if local_size < 1 or local_size % 2 == 0:
            raise ValueError(f"WithinChannelLRN: local_size must be odd and >= 1, got {local_size}")
        self.local_size, self.alpha, self.beta = local_size, alpha, beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` (N, C, H, W). Blocks (runs the computation)."""
        avg = F.avg_pool2d(
            x * x, self.local_size, stride=1, padding=self.local_size // 2, count_include_pad=True
        )
        return x / (1.0 + self.alpha * avg).pow(self.beta)

    def extra_repr(self) -> str:
        return f"local_size={self.local_size}, alpha={self.alpha}, beta={self.beta}"


def _caffe_pool_out(size: int, kernel: int = 3, stride: int = 2) -> int:
    # Caffe rounds pooling output up (ceil) where PyTorch's default rounds down.
    return int(math.ceil((size - kernel) / stride)) + 1


class Cifar10Full(nn.Module):
    """Caffe's cifar10_full network; see the module docstring. Input (N, C, H, W) floats."""

    def __init__(self, num_classes: int = 10, in_shape: tuple[int, int, int] = (3, 32, 32)):
        super().__init__()
        c, h, w = in_shape
        if min(h, w) < 3:
            raise ValueError(f"cifar10_full needs images of at least 3x3, got in_shape={in_shape}")
        self.conv1 = nn.Conv2d(c, 32, 5, padding=2)
        self.pool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.norm1 = WithinChannelLRN(3, 5e-5, 0.75)
        self.conv2 = nn.Conv2d(32, 32, 5, padding=2)
        # count_include_pad is moot with pad 0: like Caffe, PyTorch then divides the windows
        # that overhang the right/bottom edge (ceil mode) by the pixels actually covered.
        self.pool2 = nn.AvgPool2d(3, stride=2, ceil_mode=True)
        self.norm2 = WithinChannelLRN(3, 5e-5, 0.75)
        self.conv3 = nn.Conv2d(32, 64, 5, padding=2)
        self.pool3 = nn.AvgPool2d(3, stride=2, ceil_mode=True)
        for _ in range(3):
            h, w = _caffe_pool_out(h), _caffe_pool_out(w)
        self.ip1 = nn.Linear(64 * h * w, num_classes)
        # Caffe fillers: gaussian weights (conv1 deliberately tiny), constant-0 biases.
        for layer, std in (
            (self.conv1, 1e-4),
            (self.conv2, 0.01),
            (self.conv3, 0.01),
            (self.ip1, 0.01),
        ):
            nn.init.normal_(layer.weight, 0.0, std)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores (N, num_classes), no softmax. Blocks."""
        x = self.norm1(F.relu(self.pool1(self.conv1(x))))
        x = self.norm2(self.pool2(F.relu(self.conv2(x))))
        x = self.pool3(F.relu(self.conv3(x)))
        return self.ip1(torch.flatten(x, 1))


# Copied from the prototxt: conv1/conv2 say `param { lr_mult: 1 } param { lr_mult: 2 }` (so
# decay_mult keeps its default 1, biases included); conv3 has no param block at all (all 1);
# only ip1 sets decay_mult (250 on the weights, 0 on the bias).
CIFAR10_FULL_MULTS = {
    "conv1.weight": (1.0, 1.0),
    "conv1.bias": (2.0, 1.0),
    "conv2.weight": (1.0, 1.0),
    "conv2.bias": (2.0, 1.0),
    "conv3.weight": (1.0, 1.0),
    "conv3.bias": (1.0, 1.0),
    "ip1.weight": (1.0, 250.0),
    "ip1.bias": (2.0, 0.0),
}


class DigitsCNN(nn.Module):
    """conv3x3(16) -> ReLU -> conv3x3(32) -> ReLU -> maxpool 2 -> Linear. Sized for 1x8x8."""

    def __init__(self, num_classes: int = 10, in_shape: tuple[int, int, int] = (1, 8, 8)):
        super().__init__()
        c, h, w = in_shape
        if min(h, w) < 2:
            raise ValueError(f"digits_cnn needs images of at least 2x2, got in_shape={in_shape}")
        self.conv1 = nn.Conv2d(c, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * (h // 2) * (w // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores (N, num_classes). Blocks."""
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


def _mlp(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(in_shape), MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(MLP_HIDDEN, num_classes),
    )


def _alexnet(num_classes: int, in_shape: tuple[int, int, int]) -> nn.Module:
    if in_shape[0] != 3 or min(in_shape[1:]) < 63:
        raise ValueError(
            f"alexnet takes 3-channel images of at least 63x63 (ImageNet: 3x224x224),"
            f" got in_shape={in_shape}"
        )
    import torchvision  # imported here: it is slow to import and only AlexNet needs it

    return torchvision.models.alexnet(weights=None, num_classes=num_classes)


_BUILDERS = {
    "cifar10_full": lambda k, s: Cifar10Full(k, s),
    "digits_cnn": lambda k, s: DigitsCNN(k, s),
    "alexnet": _alexnet,
    "mlp": _mlp,
}
_MULTS = {"cifar10_full": CIFAR10_FULL_MULTS}


@dataclass(frozen=True)
class InputTransform:
    """uint8 images (..., C, H, W) -> the float32 input a model was designed for.

    ``standardize``: (x / 255 - mean) / std per channel (torchvision's convention; AlexNet,
    digits_cnn, mlp). ``caffe_mean``: x - 255 * mean per channel, on the 0..255 scale, as Caffe's
    CIFAR-10 example feeds cifar10_full: its N(0, 1e-4) conv1 filler and its LRN assume inputs
    of that size, and on standardized inputs (~60x smaller) the model does not learn at all.
    ``mean``/``std`` are the training set's per-channel statistics on the 0..1 scale.
    """

    kind: str = "standardize"

    def __call__(self, x, mean, std) -> torch.Tensor:
        """A new float32 tensor of ``x`` preprocessed. Blocks (computes); thread-safe."""
        if self.kind == "caffe_mean":
            return to_float(x, mean, (1.0 / 255.0,) * len(mean))
        return to_float(x, mean, std)


INPUT_TRANSFORMS = {"cifar10_full": InputTransform("caffe_mean")}
TRANSFORM_KINDS = ("standardize", "caffe_mean")


def input_transform(name: str):
    """The preprocessing model ``name`` was designed for (see InputTransform); for a user model
    what its function declares (the module docstring). Does not block (a user model's module
    is imported on first use). Raises ValueError (UserCodeError for user code)."""
    if is_import_path(name):
        declared = getattr(resolve(name, "model.name"), "input_transform", "standardize")
        if isinstance(declared, str) and declared in TRANSFORM_KINDS:
            return InputTransform(declared)
        if callable(declared):  # an InputTransform, or the user's own (x, mean, std) -> tensor
            return declared
        raise UserCodeError(
            f"model.name {name!r} declares input_transform={declared!r}; use "
            f"one of {', '.join(TRANSFORM_KINDS)}, or a function (x_uint8, "
            "mean, std) -> float32 tensor"
        )
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    return INPUT_TRANSFORMS.get(name, InputTransform())


def build_model(
    name: str, num_classes: int, in_shape: tuple[int, int, int], seed: int | None = 0
) -> nn.Module:
    """Construct model ``name`` for ``num_classes`` classes and inputs of shape ``in_shape``.

    With an integer ``seed`` the initial weights depend only on (name, num_classes, in_shape,
    seed), and the global torch RNG is left untouched; ``seed=None`` draws from the global RNG.
    ``name`` may be an import path ``package.module:function`` (the module docstring).
    Blocks while it initializes (AlexNet: about a second); thread-safe: builds in threads of
    one process take turns (two threads in ``fork_rng`` deadlocked in torch 2.14: one held the
    CPU generator's mutex waiting for the GIL, the other the GIL waiting for the mutex; and a
    seeded build's draws must not interleave with another's). Raises ValueError for an unknown
    name or a shape the model cannot take, UserCodeError for user code that fails.
    """
    user = is_import_path(name)
    if not user and name not in _BUILDERS:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}, or an "
            "import path package.module:function"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    shape = tuple(in_shape)
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"in_shape must be three positive ints (C, H, W), got {in_shape!r}")
    build = functools.partial(_build_user, name) if user else _BUILDERS[name]
    with _BUILD_LOCK:  # one at a time: the global RNG is shared by the process's threads
        if seed is None:
            model = build(num_classes, shape)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = build(num_classes, shape)
    setattr(model, _MULTS_ATTR, dict(_MULTS.get(name, {})))
    return model


def _build_user(name: str, num_classes: int, shape: tuple[int, int, int]) -> nn.Module:
    model = _call_user(name, "model.name", num_classes, shape)
    if not isinstance(model, nn.Module):
        raise UserCodeError(
            f"model.name {name!r} returned a {type(model).__name__} for "
            f"({num_classes}, {shape}); it must return a torch.nn.Module"
        )
    params = list(model.named_parameters())
    if not params:
        raise UserCodeError(
            f"model.name {name!r} returned a {type(model).__name__} without "
            "parameters: there is nothing to train"
        )
    bad = [(n, p) for n, p in params if p.dtype != torch.float32 or p.device.type != "cpu"]
    if bad:
        n, p = bad[0]
        raise UserCodeError(
            f"model.name {name!r}: parameter {n!r} is {p.dtype} on {p.device}; "
            "build the model on the CPU in float32 (learners move it to "
            "runtime.device)"
        )
    return model


@functools.lru_cache(maxsize=8)
def check_model(name: str, num_classes: int, in_shape: tuple[int, int, int]) -> int:
    """Build model ``name`` and run it on a batch of two zero images of ``in_shape``; return
    its parameter count. Raises UserCodeError (ValueError) when it cannot be built or its
    output is not (2, num_classes). Remembered per process: each distinct model is checked
    once. Blocks while it builds and runs the model."""
    model = build_model(name, num_classes, in_shape, seed=0)
    batch = tuple(in_shape)
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros((2, *batch), dtype=torch.float32))
    except Exception as exc:
        raise UserCodeError(
            f"model.name {name!r}: the model it returned fails on a batch of "
            f"(2, {', '.join(map(str, batch))}) images (the dataset's shape): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserCodeError(
            f"model.name {name!r}: its output on a batch of 2 is {got}; a "
            f"model must return class scores (2, {num_classes}) "
            "(data.num_classes)"
        )
    return sum(p.numel() for p in model.parameters())


def param_multipliers(model: nn.Module) -> list[tuple[int, float, float]]:
    """(numel, lr_mult, decay_mult) for each tensor of ``model.parameters()``, in that order.

    Models from ``build_model`` carry their multipliers; any other module gets (1.0, 1.0)
    everywhere. Does not block.
    """
    mults = getattr(model, _MULTS_ATTR, None) or {}
    # named_parameters() and parameters() walk the same tensors in the same order.
    return [(p.numel(), *mults.get(n, (1.0, 1.0))) for n, p in model.named_parameters()]


__all__ = [
    "MODEL_NAMES",
    "build_model",
    "check_model",
    "param_multipliers",
    "input_transform",
    "InputTransform",
    "TRANSFORM_KINDS",
    "WithinChannelLRN",
    "Cifar10Full",
    "DigitsCNN",
    "CIFAR10_FULL_MULTS",
]
