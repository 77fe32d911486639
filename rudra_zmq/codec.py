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

A run picks its codes with ``wire.gradient_dtype`` and ``wire.weights_dtype`` (float32,
float16, bfloat16; :func:`for_gradients`, :func:`for_weights`, :func:`dtypes`). A half codec
(:class:`Half`) narrows into a buffer of its own per message (ZeroMQ holds it until sent), with
error feedback on the gradient side: the rounding error of one gradient is added to the next,
so nothing is lost over time, only delayed by a step. A push made before its gradient is final
(parts leaving during backward) takes its frames from :meth:`Half.parts_later`: each part is
narrowed when ready, with its own slice of the residual, into the same bits. The PS and tree
nodes still sum and update in float32 (master weights). Copies on the f4 path: none when
sending; one when a learner loads weights (frame -> its model buffer, which it must own and
write); none when a server sums or applies gradients (kernels read the frames).

Functions do not block beyond the kernels, which release the GIL. Thread-safe as long as two
threads do not write one destination at once.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np

from . import kernels, wire

_F4, _F2, _BF16 = (wire.PAYLOAD_DTYPES[c] for c in ("f4", "f2", "bf16"))


def _check_vector(code: str, vector) -> None:
    if not isinstance(vector, np.ndarray) or vector.dtype != _F4 or vector.ndim != 1:
        raise ValueError(
            f"the {code} codec encodes 1-D float32 vectors, got "
            f"{getattr(vector, 'dtype', type(vector).__name__)}"
        )


class Float32:
    """Float32 on the wire, as in memory: frames are views of the vector. Stateless."""

    code = "f4"  # the wire code of its frames (wire.ModelDtypes)
    copies = False  # frames are views: the vector must stay unwritten until sent

    def encode(self, vector: np.ndarray, chunk_bytes: int, key=None) -> list[np.ndarray]:
        """``vector`` (1-D contiguous float32) as frames of at most ``chunk_bytes``: views,
        no copy. Do not write ``vector`` until ZeroMQ has sent them. ``key``: unused."""
        _check_vector(self.code, vector)
        return wire.chunk(vector, chunk_bytes)

    def narrowed(self, vector: np.ndarray, key=None) -> np.ndarray:
        """``vector`` itself (1-D contiguous float32): nothing to narrow."""
        _check_vector(self.code, vector)
        return vector

    def forget(self) -> None:
        """Nothing kept between encodes."""

    def parts_later(self, pieces, numel: int, chunk_bytes: int) -> list[tuple]:
        """One message's parts before their values are final: ``pieces`` is (at, piece) per
        part, ``piece`` a float32 view of the live vector that goes at offset ``at`` of a
        message of ``numel`` floats. Returns (at, frames, fill) per part: the frames are views
        of the piece itself, read when sent, so ``fill`` has nothing to do. Does not copy."""
        return [(at, wire.chunk(piece, chunk_bytes), _nothing) for at, piece in pieces]


def _nothing() -> None:
    """A float32 part's fill: its frames are the vector's own floats."""


FLOAT32 = Float32()


class Half:
    """float16 (``f2``) or bfloat16 (``bf16``) on the wire: each encode narrows the vector into
    a new buffer (so the caller may write the vector at once) and returns views of it.

    ``feedback`` (gradients): a float32 residual of the vector's size keeps each encode's
    rounding error and adds it to the next vector (error feedback). ``key`` (weights): an
    encode of the same vector object under the same key (the PS's timestamp) returns the
    frames of the last one, so one version sent to many learners is narrowed once.
    Not thread-safe: one owner (a learner, a tree node, the PS's thread)."""

    copies = True

    def __init__(self, code: str, feedback: bool = False):
        if code not in ("f2", "bf16"):
            raise ValueError(f"a half codec is f2 or bf16, got {code!r}")
        self.code, self.feedback = code, feedback
        self.residual: np.ndarray | None = None  # created at the first encode (feedback only)
        self._dtype = wire.PAYLOAD_DTYPES[code]
        if feedback:
            self._narrow = (
                kernels.narrow_f16_feedback if code == "f2" else kernels.narrow_bf16_feedback
            )
        else:
            self._narrow = kernels.narrow_f16 if code == "f2" else kernels.narrow_bf16
        self._last = (None, None, None)  # (key, weakref to the vector, its half buffer)

    def encode(self, vector: np.ndarray, chunk_bytes: int, key=None) -> list[np.ndarray]:
        """``vector`` (1-D contiguous float32) narrowed (:meth:`narrowed`), as frames of at
        most ``chunk_bytes``: views of the half buffer."""
        return wire.chunk(self.narrowed(vector, key), chunk_bytes)

    def forget(self) -> None:
        """The last encoded gradient was refused (the server asked this learner to rejoin):
        drop its rounding residual, which belongs to a gradient never applied."""
        self.residual = None

    def narrowed(self, vector: np.ndarray, key=None) -> np.ndarray:
        """``vector`` narrowed into a new half buffer (bfloat16 as uint16 bits). With feedback,
        the residual is added first and updated. Blocks for one pass (the kernel releases the
        GIL); allocates the half buffer, unless ``key`` names the last vector encoded."""
        _check_vector(self.code, vector)
        last_key, ref, last = self._last
        if key is not None and key == last_key and ref() is vector:
            return last
        out = np.empty(vector.shape[0], self._dtype)
        self._narrow_at(out, vector, 0)
        if key is not None:
            self._last = (key, weakref.ref(vector), out)
        return out

    def parts_later(self, pieces, numel: int, chunk_bytes: int) -> list[tuple]:
        """One message's parts before their values are final (a gradient during backward):
        ``pieces`` is (at, piece) per part, ``piece`` a float32 view of the live vector that
        goes at offset ``at`` of a message of ``numel`` floats. Returns (at, frames, fill) per
        part: the frames are views of one new half buffer of ``numel``; ``fill()`` narrows the
        piece, as it is then, into its place, with feedback from (and into) its own slice
        ``residual[at : at + len]``. Once every part is filled, in any order, the buffer and
        the residual hold the bits :meth:`narrowed` gives for the pieces end to end: the
        kernels work element by element. Allocates the buffer; each fill blocks for one pass
        over its piece (the kernel releases the GIL)."""
        out = np.empty(numel, self._dtype)
        parts = []
        for at, piece in pieces:
            _check_vector(self.code, piece)
            n = piece.shape[0]
            if at < 0 or at + n > numel:
                raise ValueError(
                    f"a part of {n:,} floats at {at:,} does not fit a message of {numel:,}"
                )
            frames = wire.chunk(out[at : at + n], chunk_bytes)
            parts.append((at, frames, functools.partial(self._narrow_at, out, piece, at)))
        return parts

    def _narrow_at(self, out: np.ndarray, piece: np.ndarray, at: int) -> None:
        """out[at : at + len(piece)] = piece narrowed, with feedback from its slice of the
        residual (one of ``out``'s size: made, or remade for a new size, here)."""
        dst = out[at : at + piece.shape[0]]
        if not self.feedback:
            self._narrow(dst, piece)
            return
        if self.residual is None or self.residual.shape != out.shape:
            self.residual = np.zeros(out.shape[0], np.float32)
        self._narrow(dst, piece, self.residual[at : at + piece.shape[0]])


def encode_parts(wire_codec, vector: np.ndarray, bounds, chunk_bytes: int) -> list[tuple]:
    """``vector`` encoded once by ``wire_codec`` (a half codec narrows the whole, its error
    feedback included, in one pass) and cut at ``bounds`` (``shape.part_bounds``): one
    ``(offset, frames)`` per part, the frames views of at most ``chunk_bytes``."""
    whole = wire_codec.narrowed(vector)
    return [(a, wire.chunk(whole[a:b], chunk_bytes)) for a, b in zip(bounds, bounds[1:])]


def _codec(code: str, feedback: bool = False):
    return FLOAT32 if code == "f4" else Half(code, feedback)


def dtypes(cfg) -> wire.ModelDtypes:
    """The wire codes of ``cfg``'s gradients and weights (``wire.*_dtype``), for
    ``wire.decode``."""
    w = cfg.wire
    return wire.ModelDtypes(wire.WIRE_DTYPES[w.gradient_dtype], wire.WIRE_DTYPES[w.weights_dtype])


def for_gradients(cfg):
    """A codec for one sender's gradients (a learner's, or a tree node's relayed sums): float32
    views, or a :class:`Half` of its own (with ``wire.error_feedback``)."""
    return _codec(dtypes(cfg).gradients, cfg.wire.error_feedback)


def for_weights(cfg):
    """A codec for the weights a server sends (the PS; BCAST chunks): float32 views, or a
    :class:`Half` that narrows each version once (pass its timestamp as ``key``)."""
    return _codec(dtypes(cfg).weights)


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
