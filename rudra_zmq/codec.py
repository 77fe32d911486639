"""The payload codec: how a model-sized float32 vector travels as payload frames, and back.

Gradients, weights and relayed sums are float32 in memory everywhere (one flat buffer per
model, ``flat.py``); this module is the one place that turns such a vector into the frames of a
message and folds received frames back into float32:

- encoding belongs to a codec object, the run's (:func:`of`): :class:`Float32` hands out views
  of the vector itself (zero-copy, as ``wire.chunk``); the vector must then stay unchanged
  until ZeroMQ has sent it, which the callers already ensure (immutable weight versions, the
  learner's reply, the tree node's second sum buffer);
- decoding goes by each frame's dtype, so frames and float32 shared-memory slots mix freely:
  :func:`load` (out = frames), :func:`add` (acc += scale * frames) and :func:`floats` (the
  frames themselves when they are float32 already, so an update can read them in place).

Formats (``wire.MODEL_DTYPES``), each frame a 1-D array:

    wire code  frame array             decoded by                      encoded by
    f4         float32                 kernels.copy_into, accumulate   a view (no copy)
    f2         float16                 kernels.widen_f16, accum..._f16  kernels.narrow_f16
    bf16       uint16 (bfloat16 bits)  kernels.widen_bf16, ..._bf16    kernels.narrow_bf16

Every run sends f4 today. Decoding f2 and bf16 is here and tested; a compressed wire adds an
encoding codec class and a config value (docs/wire.md, "Payload codec"). Copies on the f4
path: none when sending; one when a learner loads weights (frame -> its model buffer, which it
must own and write); none when a server sums or applies gradients (kernels read the frames).

Functions do not block beyond the kernels, which release the GIL. Thread-safe as long as two
threads do not write one destination at once.
"""

from __future__ import annotations

import numpy as np

from . import kernels, wire

_F4, _F2, _BF16 = (wire.PAYLOAD_DTYPES[c] for c in ("f4", "f2", "bf16"))


class Float32:
    """Float32 on the wire, as in memory: frames are views of the vector. Stateless."""

    code = "f4"  # the wire code of its frames (wire.decode(..., model_dtype=code))

    def encode(self, vector: np.ndarray, chunk_bytes: int) -> list[np.ndarray]:
        """``vector`` (1-D contiguous float32) as frames of at most ``chunk_bytes``: views,
        no copy. Do not write ``vector`` until ZeroMQ has sent them."""
        if vector.dtype != _F4:
            raise ValueError(f"the float32 codec encodes float32 vectors, got {vector.dtype}")
        return wire.chunk(vector, chunk_bytes)


FLOAT32 = Float32()


def of(cfg) -> Float32:
    """The codec ``cfg``'s run sends model-sized payloads with: float32 for every run until a
    config value selects a compressed one (docs/wire.md)."""
    return FLOAT32


def _pieces(pieces):
    """(offset, piece) for contiguous pieces, checking each piece's dtype."""
    off = 0
    for part in pieces:
        if part.dtype not in (_F4, _F2, _BF16):
            raise ValueError(
                f"a model-sized payload of dtype {part.dtype}: the codec decodes "
                f"float32, float16 and bfloat16 (uint16 bits) frames"
            )
        yield off, part
        off += part.shape[0]


def load(out: np.ndarray, pieces) -> None:
    """out[:] = the contiguous ``pieces`` (frames of any model dtype, in order from element 0),
    widened to float32. One pass; the f4 copy is ``kernels.copy_into``."""
    for off, part in _pieces(pieces):
        dst = out[off : off + part.shape[0]]
        if part.dtype == _F4:
            kernels.copy_into(dst, part)
        elif part.dtype == _F2:
            kernels.widen_f16(dst, part)
        else:
            kernels.widen_bf16(dst, part)


def add(acc: np.ndarray, pieces, scale: float = 1.0) -> None:
    """acc += scale * the contiguous ``pieces`` (frames of any model dtype), in place, each at
    its offset; no temporary (the half kernels widen as they add)."""
    for off, part in _pieces(pieces):
        dst = acc[off : off + part.shape[0]]
        if part.dtype == _F4:
            if scale == 1.0:
                kernels.accumulate(dst, part)
            else:
                kernels.accumulate_scaled(dst, part, scale)
        elif part.dtype == _F2:
            kernels.accumulate_f16(dst, part, scale)
        else:
            kernels.accumulate_bf16(dst, part, scale)


def floats(pieces) -> list | None:
    """``pieces`` themselves if every one is float32 (to be read in place, no copy), else None
    (decode them first with :func:`load` or :func:`add`)."""
    pieces = list(pieces)
    return pieces if all(p.dtype == _F4 for p in pieces) else None
