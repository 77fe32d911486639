"""The parameter server's optimizer state and update: weights, momentum, gradient sum.

Pure computation on flat float32 buffers with the compiled kernels (GIL released): no
sockets, no protocol. The parameter server (``server/ps.py``) decides *when* to update (the
sync engine) and sends the results; this module does the arithmetic:

- ``add``: one message's gradient frames summed into ``acc`` in place, each at its offset
  (optionally scaled by the staleness policy), decoded by ``codec.add`` (float32 frames are
  read in place; half-precision ones widened as they are added);
- ``step``: one momentum-SGD update (Caffe semantics, per-segment lr/decay multipliers) from
  ``acc`` or straight from received frames. The new weights go to a free buffer
  (``versions.WeightVersions``), never over the current version, which may still be in a
  zero-copy send.

Not thread-safe: owned by the parameter server's thread.
"""

from __future__ import annotations

import numpy as np

from .. import codec, kernels
from ..shape import Share
from .versions import WeightVersions


class Updater:
    """Weights (as immutable versions), momentum ``v`` and gradient sum ``acc`` of the share
    ``share`` of one model's flat vector (``shape.Share``: a range or stripes; the whole
    vector by default).

    Every buffer, gradient and offset here is relative to the share's local vector (its
    stripes end to end): element 0 is the model's element ``share.lo``. Per-element arithmetic
    with the segments clipped to each stripe makes the update of a share identical to those
    elements of the whole-vector update.

    Args:
        weights: the model's initial flat weights (only the share's elements are copied).
        segments: (start, stop, lr_mult, decay_mult) ranges covering the model's weights in
            order; kept clipped to the share (``Share.clip``).
        optimizer: the config's OptimizerConfig (momentum, weight_decay).
        share: what this updater owns; None for the whole vector.
    """

    def __init__(self, weights: np.ndarray, segments, optimizer, share: Share | None = None):
        total = weights.shape[0]
        starts, stops = [a for a, *_ in segments], [b for _, b, *_ in segments]
        if starts != [0] + stops[:-1] or stops[-1] != total:
            # the update writes a fresh buffer: a gap would leave garbage in the new weights
            raise ValueError(
                f"parameter segments {list(zip(starts, stops))[:4]}... must cover "
                f"0..{total} in order without gaps"
            )
        self.share = Share.whole(total) if share is None else share
        if self.share.total != total:
            raise ValueError(
                f"range {self.share} is of another vector than the model's "
                f"{total:,} weights: was it planned for another model?"
            )
        own = self.share.gather(weights)
        self.versions = WeightVersions(np.ascontiguousarray(own, dtype=np.float32).copy())
        self.numel = self.share.numel
        self.v = np.zeros_like(self.w)
        self.acc = np.zeros_like(self.w)
        self.segments = self.share.clip(segments)
        self.optimizer = optimizer
        self._next: np.ndarray | None = None  # the next version while parts are written

    @property
    def w(self) -> np.ndarray:
        """The current weights. Never written again (the next update writes another buffer),
        so they are safe to send zero-copy; do not modify them."""
        return self.versions.current

    def add(self, payloads, scale: float = 1.0) -> None:
        """acc += scale * (the contiguous gradient pieces ``payloads``, frames of any model
        dtype). Does not block beyond the kernels."""
        codec.add(self.acc, payloads, scale)

    def step(self, sources, g_scale: float, lr: float, zero_acc: bool) -> None:
        """One update from gradient ``sources`` (contiguous pieces covering the share, e.g.
        ``[self.acc]`` with ``zero_acc``, or received frames): the new weights go to a free buffer, which then becomes the current
        version; one kernel call per piece and parameter segment they share. Does not block
        beyond the kernels."""
        out = self.versions.next_buffer()
        self._step_into(out, sources, 0, g_scale, lr, zero_acc)
        self.versions.publish(out)

    def _step_into(self, out, sources, off: int, g_scale: float, lr: float, zero_acc: bool):
        """The update of the elements ``sources`` cover, from ``off`` on, written into ``out``."""
        o, w = self.optimizer, self.w
        for src in sources:
            end = off + src.shape[0]
            for start, stop, lr_mult, decay_mult in self.segments:
                a, b = max(start, off), min(stop, end)
                if a >= b:
                    continue
                g = src[a - off : b - off]
                if o.momentum:
                    kernels.sgd_momentum_step(
                        w[a:b],
                        self.v[a:b],
                        g,
                        lr * lr_mult,
                        o.momentum,
                        o.weight_decay * decay_mult,
                        g_scale,
                        zero_acc,
                        out=out[a:b],
                    )
                else:
                    kernels.sgd_step(
                        w[a:b],
                        g,
                        lr * lr_mult,
                        o.weight_decay * decay_mult,
                        g_scale,
                        zero_acc,
                        out=out[a:b],
                    )
            off = end

    # ------------------------------------------------------------------ parts (wire.parts)
    def add_at(self, lo: int, payloads) -> None:
        """acc[lo:...] += the contiguous ``payloads`` (one part of a gradient)."""
        n = sum(p.shape[0] for p in payloads)
        codec.add(self.acc[lo : lo + n], payloads)

    def step_part(self, lo: int, hi: int, g_scale: float, lr: float) -> np.ndarray:
        """The update of elements lo..hi from ``acc`` (zeroed there), written into the next
        version, which stays unpublished until ``publish_parts``; returns that slice of it
        (safe to send zero-copy: the buffer is never written again once published)."""
        if self._next is None:
            self._next = self.versions.next_buffer()
        self._step_into(self._next, [self.acc[lo:hi]], lo, g_scale, lr, True)
        return self._next[lo:hi]

    @property
    def parts_pending(self) -> bool:
        """Whether some parts of the next version are written and it is not yet published
        (momentum there has moved on: not a state to checkpoint)."""
        return self._next is not None

    def publish_parts(self) -> None:
        """Make the version the parts were written into current (every part was stepped)."""
        self.versions.publish(self._next)
        self._next = None

    def receive(self, payloads, scale: float, update, count: int = 1) -> None:
        """Account one message holding the sum of ``count`` gradients (contiguous pieces
        ``payloads``, each to be scaled by ``scale``) and apply ``update`` (a ``sync.Update``
        or None) if it completes one. When the message alone makes the update (async, c = 1;
        or one relayed sum) and its frames are float32, the step reads them directly, with no
        pass over ``acc``; other frames are decoded into ``acc`` first. Does not block beyond
        the kernels."""
        direct = codec.floats(payloads)
        if update is not None and len(update.learners) == count and direct is not None:
            self.step(direct, update.g_scale * scale, update.lr, False)
            return
        self.add(payloads, scale)
        if update is not None:
            self.step([self.acc], update.g_scale, update.lr, True)
