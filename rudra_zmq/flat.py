"""One flat float32 buffer for a model's weights and one for its gradients.

``FlatModel(module)`` moves every parameter of ``module`` into ``weights`` (a 1-D float32 NumPy
array) and every gradient into ``grads``; ``p.data`` and ``p.grad`` become views into them.
Autograd then accumulates each backward pass straight into ``grads`` (in place: a defined
``.grad`` is added to, not replaced), so a learner pushes ``grads`` as one zero-copy frame and
pulls new weights with one ``load_weights`` copy, with no per-layer packing.

Layout: parameters lie in ``module.parameters()`` order, back to back, each C-contiguous.

The views break silently if anything rebinds ``p.data`` or ``p.grad``. The usual culprit is
``module.zero_grad()`` / ``optimizer.zero_grad()``, whose default ``set_to_none=True`` drops the
gradient views (the next backward then allocates fresh, unshared tensors); ``.to()``,
``.half()`` or ``.cuda()`` replace ``p.data``, and ``backward(create_graph=True)`` replaces
``p.grad`` (it accumulates out of place). Use ``FlatModel.zero_grad()``; ``check_views()``
detects the rest.
Buffers (e.g. BatchNorm running statistics) are not part of the flat weights.

On a GPU (``FlatModel(module, device="cuda:0")``) the parameters and gradients are views into
two flat buffers on the GPU, and ``weights``/``grads`` are pinned host copies, the ones that
go on the wire: ``grads_to_host()`` after backward and ``weights_to_device()`` after writing
``weights`` each move the whole model in one transfer (``load_weights`` does the latter
itself). On CPU both are no-ops: the host arrays are the model's own buffers.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn

from . import kernels
from .models import param_multipliers


class FlatModel:
    """A module whose parameters and gradients live in two contiguous float32 arrays.

    Attributes: ``module``; ``weights`` and ``grads`` (1-D float32 NumPy arrays: on CPU they
    share memory with the module's parameters and gradients, on a GPU they are its host
    copies); ``layout``, a list of (name, start, stop, shape); ``device``.
    Not thread-safe: writing ``weights`` while another thread runs the module races with it.
    """

    def __init__(
        self,
        module: nn.Module,
        multipliers: list[tuple[int, float, float]] | None = None,
        device=None,
        staged: bool | None = None,
    ):
        """Move ``module``'s parameters into fresh flat buffers (copying their current values)
        and zero the gradients. ``multipliers`` defaults to ``models.param_multipliers(module)``.
        ``device`` (default CPU): where the module computes; the module (with its buffers) is
        moved there. ``staged`` (default: on any device but the CPU) keeps the module's flat
        buffers apart from the host arrays, as on a GPU; ``staged=True`` on CPU runs that path
        without a GPU (tests). Blocks for the copy. Raises ValueError/TypeError for a module it
        cannot flatten.
        """
        named = list(module.named_parameters())
        if not named:
            raise ValueError(f"{type(module).__name__} has no parameters to flatten")
        for name, p in named:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError(
                    f"parameter {name!r} is {p.dtype} on {p.device}; FlatModel needs "
                    "float32 CPU parameters (build the model on CPU, in float32)"
                )
        self.module = module
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else bool(staged)
        if self.device.type != "cpu":
            module.to(self.device)  # buffers too; the parameters are rebound below
            named = list(module.named_parameters())
        self.layout: list[tuple[str, int, int, tuple[int, ...]]] = []
        start = 0
        for name, p in named:
            self.layout.append((name, start, start + p.numel(), tuple(p.shape)))
            start += p.numel()
        # Host arrays through torch (pinned for a GPU, so its copies run at full speed); the
        # NumPy views keep the tensors alive, and torch writes land in NumPy.
        pin = self.device.type == "cuda"
        self._hw = torch.empty(start, dtype=torch.float32, pin_memory=pin)
        self._hg = torch.zeros(start, dtype=torch.float32, pin_memory=pin)
        self.weights, self.grads = self._hw.numpy(), self._hg.numpy()
        if self.staged:
            self._w = torch.empty(start, dtype=torch.float32, device=self.device)
            self._g = torch.zeros(start, dtype=torch.float32, device=self.device)
        else:
            self._w, self._g = self._hw, self._hg
        with torch.no_grad():
            for (_name, a, b, shape), (_, p) in zip(self.layout, named):
                self._w[a:b].copy_(p.detach().reshape(-1))
                p.data = self._w[a:b].view(shape)
                p.grad = self._g[a:b].view(shape)
            if self.staged:
                self._hw.copy_(self._w)
        mults = param_multipliers(module) if multipliers is None else list(multipliers)
        if [m[0] for m in mults] != [b - a for _, a, b, _ in self.layout]:
            raise ValueError(
                f"multipliers give sizes {[m[0] for m in mults]} but the parameters "
                f"have {[b - a for _, a, b, _ in self.layout]}"
            )
        self._mults = [(float(lr), float(decay)) for _, lr, decay in mults]

    @property
    def numel(self) -> int:
        """Number of float32 parameters."""
        return int(self.weights.shape[0])

    @property
    def nbytes(self) -> int:
        """Size of ``weights`` (and of ``grads``) in bytes."""
        return int(self.weights.nbytes)

    @property
    def signature(self) -> str:
        """16 hex digits identifying the parameter names, shapes and dtype (not the values).

        Stable across processes and runs, so the parameter server can refuse a learner that
        runs another model. Does not block.
        """
        text = ";".join(f"{n}:{'x'.join(map(str, s))}" for n, _, _, s in self.layout)
        return hashlib.sha256(f"float32|{text}".encode()).hexdigest()[:16]

    def zero_grad(self) -> None:
        """Set every gradient to 0 in place, keeping the views. Blocks (one memset).

        Use this instead of ``module.zero_grad()``/``optimizer.zero_grad()``, which set
        gradients to None by default and so cut them off from ``grads``.
        """
        if self.staged:
            self._g.zero_()
        else:
            self.grads.fill(0.0)

    def grads_to_host(self) -> None:
        """Copy the module's gradient into ``grads`` (one device-to-host transfer; on CPU
        nothing: they are the same memory). Blocks until the copy is done, so ``grads`` may go
        on the wire at once."""
        if self.staged:
            self._hg.copy_(self._g)

    def weights_to_device(self) -> None:
        """Copy ``weights`` into the module's parameters (one host-to-device transfer; on CPU
        nothing). Call after writing ``weights`` directly; ``load_weights`` calls it. Blocks
        until ``weights`` may be written again."""
        if self.staged:
            self._w.copy_(self._hw)

    def check_views(self) -> None:
        """Raise RuntimeError naming the first parameter whose data or grad no longer aliases
        the flat buffers (rebound by zero_grad(set_to_none=True), .to(), .half(), ...).
        Does not block; cheap enough to call once per iteration.
        """
        if (
            self._hw.data_ptr() != self.weights.ctypes.data
            or self._hg.data_ptr() != self.grads.ctypes.data
        ):
            raise RuntimeError(
                "FlatModel's tensors no longer share memory with weights/grads "
                "(were the arrays replaced? assign into them with [:] instead)"
            )
        wbase, gbase = self._w.data_ptr(), self._g.data_ptr()
        params = dict(self.module.named_parameters())
        for name, a, _, shape in self.layout:
            p = params.get(name)
            if p is None:
                raise RuntimeError(
                    f"parameter {name!r} is gone from the module; rebuild the "
                    "FlatModel after changing the module's structure"
                )
            for what, t, base in (("data", p.data, wbase), ("grad", p.grad, gbase)):
                if t is None:
                    raise RuntimeError(
                        f"parameter {name!r} has grad None: something called zero_grad() with "
                        "set_to_none=True (the default). Call FlatModel.zero_grad() instead, or "
                        "optimizer.zero_grad(set_to_none=False)"
                    )
                if (
                    t.device != self._w.device
                    or t.dtype != torch.float32
                    or t.data_ptr() != base + 4 * a
                    or tuple(t.shape) != shape
                    or not t.is_contiguous()
                ):
                    raise RuntimeError(
                        f"parameter {name!r}: its {what} no longer aliases the flat {what} "
                        f"buffer (now {t.dtype} {tuple(t.shape)} on {t.device}); it was rebound "
                        "(by .to()/.half(), backward(create_graph=True), or a set_to_none "
                        "zero_grad before backward). Rebuild the FlatModel from the module"
                    )

    def load_weights(self, src) -> None:
        """Copy ``src`` into ``weights`` in place (the module sees the new values at once).

        ``src``: a 1-D float32 ndarray, or any buffer (bytes, memoryview, zmq.Frame) holding
        ``numel`` float32 values; read-only is fine. Raises ValueError naming both sizes when
        the length differs. Blocks for the copy, which releases the GIL.
        """
        if isinstance(src, np.ndarray):
            arr = src
            if arr.dtype != np.float32 or arr.ndim != 1:
                raise ValueError(
                    f"load_weights takes a 1-D float32 array, got {arr.dtype} with "
                    f"shape {arr.shape}"
                )
        else:
            try:
                view = memoryview(src)
            except TypeError:
                raise TypeError(
                    f"load_weights takes an ndarray or a buffer, got {type(src).__name__}"
                ) from None
            if view.nbytes % 4:
                raise ValueError(
                    f"load_weights got {view.nbytes:,} bytes, not a whole number of "
                    f"float32 values; the model has {self.numel:,} "
                    f"({self.nbytes:,} bytes)"
                )
            arr = np.frombuffer(view, dtype=np.float32)
        if arr.shape[0] != self.numel:
            raise ValueError(
                f"load_weights got {arr.shape[0]:,} floats; the model has "
                f"{self.numel:,} (signature {self.signature}; is the sender running "
                "another model config?)"
            )
        if np.may_share_memory(arr, self.weights):
            if arr.ctypes.data == self.weights.ctypes.data and arr.strides == (4,):
                return  # loading weights into themselves
            raise ValueError("load_weights: src overlaps the weights buffer; pass a copy")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        kernels.copy_into(self.weights, arr)
        self.weights_to_device()

    def segments(self) -> list[tuple[int, int, float, float]]:
        """(start, stop, lr_mult, decay_mult) ranges of ``weights``, covering it in order, with
        adjacent parameters of equal multipliers merged. Does not block.
        """
        out: list[tuple[int, int, float, float]] = []
        for (_, a, b, _), (lr, decay) in zip(self.layout, self._mults):
            if out and out[-1][1] == a and out[-1][2:] == (lr, decay):
                out[-1] = (out[-1][0], b, lr, decay)
            else:
                out.append((a, b, lr, decay))
        return out

    def __repr__(self) -> str:
        return (
            f"FlatModel({type(self.module).__name__}, numel={self.numel:,}, "
            f"signature={self.signature})"
        )


__all__ = ["FlatModel"]
