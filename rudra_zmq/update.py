"""The parameter server's optimizer state and update: weights, momentum, gradient sum.

Pure computation on flat float32 buffers with the compiled kernels (GIL released): no
sockets, no protocol. The parameter server (``roles/ps.py``) decides *when* to update (the
sync engine) and sends the results; this module does the arithmetic:

- ``add``: one message's gradient frames summed into ``acc`` in place, each at its offset
  (optionally scaled by the staleness policy);
- ``step``: one momentum-SGD update (Caffe semantics, per-segment lr/decay multipliers) from
  ``acc`` or straight from received frames. The new weights go to a free buffer
  (``versions.WeightVersions``), never over the current version, which may still be in a
  zero-copy send; a callback may receive each part of the new weights as soon as it is final
  (streamed replies, ``runtime.stream_parts``);
- ``begin_parts``/``step_part``/``commit_parts``: the same update computed part by part from
  a gradient that is still arriving (cut-through), into spare buffers until it is committed.

Not thread-safe: owned by the parameter server's thread.
"""
from __future__ import annotations

import numpy as np

from . import kernels
from .versions import WeightVersions

# Streamed replies use parts of at least this size: smaller parts cost more per-message work
# than the overlap saves (bench/RESULTS.md: at 1M parameters, 1 MiB parts were no faster in
# Python; with the compiled hot path, 8, 16 or 32 parts at 10M were alike within the noise).
STREAM_MIN_PART_BYTES = 4 << 20


def stream_part_floats(numel: int, chunk_bytes: int, stream_parts: int) -> int:
    """Floats per part of a streamed WEIGHTS reply: at most ``stream_parts`` parts, each at
    least STREAM_MIN_PART_BYTES and at most a chunk (a chunk smaller than that minimum wins:
    no frame is larger than ``runtime.chunk_mib``); ``numel`` (no streaming) for
    ``stream_parts == 1`` or a model that fits in one part. Pure; thread-safe."""
    if stream_parts <= 1:
        return numel
    part = max(-(-numel // stream_parts), STREAM_MIN_PART_BYTES // 4)
    return min(part, max(1, chunk_bytes // 4), numel)


class Updater:
    """Weights (as immutable versions), momentum ``v`` and gradient sum ``acc`` of one model.

    Args:
        weights: the initial weights (copied).
        segments: (start, stop, lr_mult, decay_mult) ranges covering the weights in order.
        optimizer: the config's OptimizerConfig (momentum, weight_decay).
        part_floats: floats per part when ``step`` streams (see ``stream_part_floats``).
    """

    def __init__(self, weights: np.ndarray, segments, optimizer, part_floats: int):
        self.versions = WeightVersions(np.ascontiguousarray(weights, dtype=np.float32).copy())
        self.numel = self.w.shape[0]
        self.v = np.zeros_like(self.w)
        self._v_spare = None          # the second momentum buffer of cut-through updates
        self.acc = np.zeros_like(self.w)
        starts, stops = [a for a, *_ in segments], [b for _, b, *_ in segments]
        if starts != [0] + stops[:-1] or stops[-1] != self.numel:
            # the update writes a fresh buffer: a gap would leave garbage in the new weights
            raise ValueError(f"parameter segments {list(zip(starts, stops))[:4]}... must cover "
                             f"0..{self.numel} in order without gaps")
        self.segments = segments
        self.optimizer = optimizer
        self.part_floats = part_floats

    @property
    def w(self) -> np.ndarray:
        """The current weights. Never written again (the next update writes another buffer),
        so they are safe to send zero-copy; do not modify them."""
        return self.versions.current

    def add(self, payloads, scale: float = 1.0) -> None:
        """acc += scale * (the contiguous gradient pieces ``payloads``). Does not block."""
        off = 0
        for part in payloads:
            n = part.shape[0]
            if scale == 1.0:
                kernels.accumulate(self.acc[off:off + n], part)
            else:
                kernels.accumulate_scaled(self.acc[off:off + n], part, scale)
            off += n

    def step(self, sources, g_scale: float, lr: float, zero_acc: bool, on_part=None) -> None:
        """One update from gradient ``sources`` (contiguous pieces covering the model, e.g.
        ``[self.acc]`` with ``zero_acc``, or received frames): the new weights go to a free
        buffer, which then becomes the current version. With ``on_part(lo, hi, out, last,
        n_parts)`` the update runs part by part (``part_floats``) and the callback gets each
        part ``out[lo:hi]`` as soon as it is final. Does not block beyond the kernels."""
        w, out = self.w, self.versions.next_buffer()
        step = self.part_floats if on_part is not None else self.numel
        parts = range(0, self.numel, step)
        for lo in parts:
            hi = min(lo + step, self.numel)
            self.step_range(sources, w, out, lo, hi, g_scale, lr, zero_acc)
            if on_part is not None:
                on_part(lo, hi, out, hi == self.numel, len(parts))
        self.versions.publish(out)

    def receive(self, payloads, scale: float, update, count: int = 1, on_part=None) -> None:
        """Account one message holding the sum of ``count`` gradients (contiguous pieces
        ``payloads``, each to be scaled by ``scale``) and apply ``update`` (a ``sync.Update``
        or None) if it completes one. When the message alone makes the update (async, c = 1;
        or one relayed sum) the step reads the frames directly, with no pass over ``acc``.
        ``on_part`` as in ``step``. Does not block beyond the kernels."""
        if update is not None and len(update.learners) == count:
            self.step(payloads, update.g_scale * scale, update.lr, False, on_part)
            return
        self.add(payloads, scale)
        if update is not None:
            self.step([self.acc], update.g_scale, update.lr, True, on_part)

    # ------------------------------------------------------------ cut-through updates
    # A gradient pushed in parts (GPART..., then PUSHPULL x{parts}) can be applied part by part
    # as the parts arrive, before the last one is even received. Nothing the server holds may
    # change until the whole gradient is validated, so both results go to spare buffers: the
    # weights to the next version's buffer (as in ``step``), the momentum to a second momentum
    # buffer. ``commit`` adopts both; dropping them (``abort``) leaves w and v bit-identical.

    def begin_parts(self) -> tuple[np.ndarray, np.ndarray]:
        """Buffers (out, v_out) for one update computed part by part (``step_part``)."""
        if self._v_spare is None:
            self._v_spare = np.empty_like(self.v)
        return self.versions.next_buffer(), self._v_spare

    def step_part(self, piece: np.ndarray, lo: int, out: np.ndarray, v_out: np.ndarray,
                  g_scale: float, lr: float) -> None:
        """The update of weights [lo, lo + len(piece)) from gradient ``piece`` into ``out`` and
        ``v_out``; w, v and acc are only read. Does not block beyond the kernel."""
        self.step_range([piece], self.w, out, lo, lo + piece.shape[0], g_scale, lr, False,
                        v_out=v_out, base=lo)

    def commit_parts(self, out: np.ndarray, v_out: np.ndarray) -> None:
        """Adopt an update whose every part ``step_part`` computed: ``out`` becomes the current
        weights, ``v_out`` the momentum (the old momentum becomes the spare)."""
        self.versions.publish(out)
        if self.optimizer.momentum:   # (plain SGD never wrote v_out)
            self.v, self._v_spare = v_out, self.v

    def abort_parts(self, out: np.ndarray) -> None:
        """Drop a part-by-part update: weights and momentum stay as they were."""
        self.versions.give_back(out)

    def step_range(self, sources, w, out, lo, hi, g_scale, lr, zero_acc, v_out=None,
                   base: int = 0) -> None:
        """The update of weights [lo, hi): every source piece and parameter segment in it.
        ``sources`` are contiguous gradient pieces starting at offset ``base``; the new
        momentum goes to ``v_out`` (None: ``v`` in place)."""
        o = self.optimizer
        off = base
        for src in sources:
            end = off + src.shape[0]
            if end > lo and off < hi:
                for start, stop, lr_mult, decay_mult in self.segments:
                    a, b = max(start, off, lo), min(stop, end, hi)
                    if a >= b:
                        continue
                    g = src[a - off:b - off]
                    if o.momentum:
                        kernels.sgd_momentum_step(
                            w[a:b], self.v[a:b], g, lr * lr_mult, o.momentum,
                            o.weight_decay * decay_mult, g_scale, zero_acc, out=out[a:b],
                            v_out=None if v_out is None else v_out[a:b])
                    else:
                        kernels.sgd_step(w[a:b], g, lr * lr_mult, o.weight_decay * decay_mult,
                                         g_scale, zero_acc, out=out[a:b])
            off = end
