"""The wire protocol: the only module that builds or parses rudra_zmq's ZeroMQ frames.

A message is one ZeroMQ multipart message: the routing id (ROUTER side only, added and
stripped by ZeroMQ), a msgpack header (<= MAX_HEADER_BYTES), then 0..N payload frames of raw
little-endian array bytes, sent zero-copy. Header keys are short because they travel with
every gradient: ``v`` protocol version (PROTOCOL_VERSION; a mismatch is refused), ``k`` kind
(:class:`Kind`), ``s`` sender (a learner id >= 0, negative for servers and tools, <= -100 for
tree nodes: :func:`node_sender`), ``q`` sequence number, ``ts`` weights timestamp, ``inc`` the
PS's incarnation, ``p`` one [dtype, count] per payload frame (PAYLOAD_DTYPES), ``x``
kind-specific fields (KIND_FIELDS, validated by type).

A model-sized vector (gradient, weights) may be split into several frames whose counts add up
to the model size, so the PS accumulates each frame at its offset with no reassembly copy
(:func:`chunk`). Their dtype is the run's (:class:`ModelDtypes`: gradients and weights each
one of MODEL_DTYPES, float32 ``f4`` by default); ``codec.py`` encodes and decodes them. Nothing here is
pickled: headers are msgpack with strict limits and payloads are raw arrays interpreted only
after their length and dtype were checked.
:func:`decode` validates a message completely before any role may act on it and raises
:class:`WireError` otherwise.

The kinds, their fields and payload frame counts, and the sender ids are tables in
``wire_kinds.py`` (re-exported here: callers write ``wire.Kind``); this module builds and
parses the frames and checks every message against those tables. Every kind and its fields,
and the tree (RELAY), broadcast (BCAST, CREDIT) and shared-memory variants: ``docs/wire.md``.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass

import msgpack
import numpy as np

from .wire_kinds import (
    GRADIENT_KINDS,
    KIND_FIELDS,
    MODEL_SIZED,
    PAYLOAD_FRAMES,
    WEIGHT_KINDS,
    Kind,
)
from .wire_kinds import SENDER_DATA as SENDER_DATA
from .wire_kinds import SENDER_PS as SENDER_PS
from .wire_kinds import WIRE_DTYPES as WIRE_DTYPES
from .wire_kinds import copy_holder_sender as copy_holder_sender
from .wire_kinds import node_id as node_id
from .wire_kinds import node_sender as node_sender
from .wire_kinds import sender_name as sender_name

PROTOCOL_VERSION = 9  # 9: a rejoining learner's HELLO carries its copy of the range, x{step};
#                               8: parts in any order (pushed as backward completes them);
#                               7: PUSHPULL and WEIGHTS x{at, more} (wire.parts);
#                               6: CHECK/RECEIPT (a slow reply is asked about, not resent);
#                               5: no x{wait} (the server's engine decides when a reply goes);
#                               4: METRIC/EVAL x{token}; 3: replies echo x{re}; HELLO x{had}
MAX_HEADER_BYTES = 64 * 1024
# Chunk model-sized payloads: loopback ZeroMQ moves 1-16 MiB frames faster than one huge one.
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
# bf16 frames are bfloat16 as their uint16 bit patterns: NumPy has no bfloat16 dtype
PAYLOAD_DTYPES = {
    "f4": np.dtype("<f4"),
    "f2": np.dtype("<f2"),
    "bf16": np.dtype("<u2"),
    "u1": np.dtype("u1"),
    "i8": np.dtype("<i8"),
}
MODEL_DTYPES = ("f4", "f2", "bf16")  # what a run's model-sized payloads may travel as
_DTYPE_CODES = {v: k for k, v in PAYLOAD_DTYPES.items()}


@dataclass(frozen=True)
class ModelDtypes:
    """The wire codes (MODEL_DTYPES) a run's model-sized payloads travel as: ``gradients``
    (PUSH, PUSHPULL, RELAY) and ``weights`` (WELCOME, WEIGHTS, BCAST); EVAL is always f4."""

    gradients: str = "f4"
    weights: str = "f4"

    def __post_init__(self):
        for what, code in (("gradients", self.gradients), ("weights", self.weights)):
            if code not in MODEL_DTYPES:
                raise ValueError(f"{what} dtype {code!r} is not one of {MODEL_DTYPES}")

    def of(self, kind: Kind) -> str | None:
        """The code ``kind``'s model-sized payloads must have (None: not model-sized)."""
        if kind in GRADIENT_KINDS:
            return self.gradients
        if kind in WEIGHT_KINDS:
            return self.weights
        return "f4" if kind in MODEL_SIZED or kind == Kind.HELLO else None


FLOAT32 = ModelDtypes()  # every run's default

MAX_CLOCK = 16384  # entries in one RELAY's clock (the header must stay < 64 KiB)

_UNPACK_LIMITS = dict(
    max_str_len=16 * 1024, max_bin_len=0, max_array_len=64 * 1024, max_map_len=256, max_ext_len=0
)


class WireError(ValueError):
    """A message that failed validation. ``code`` is a short machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class Message:
    """A validated message. ``payloads`` are read-only NumPy views of the frames (no copy)."""

    kind: Kind
    sender: int
    seq: int
    ts: int
    inc: int
    fields: dict
    payloads: list

    @property
    def payload_numel(self) -> int:
        return sum(int(p.shape[0]) for p in self.payloads)

    @property
    def in_shm(self) -> bool:
        """A PUSH/PUSHPULL whose gradient is in a shared slot (x{slot}), or a WEIGHTS that says
        to read the shared board (x{board: true}): no payload (validated)."""
        return _in_shm(self.kind, self.fields)

    @property
    def is_part(self) -> bool:
        """One part of a model-sized vector (x{at} or x{more}: ``wire.parts``; validated)."""
        return _is_part(self.fields)

    @property
    def clock(self) -> list[tuple[int, int]]:
        """A RELAY's vector clock as (learner, gradient timestamp) pairs (validated)."""
        return [(e[0], e[1]) for e in self.fields.get("clock", ())]


def chunk(vector: np.ndarray, max_bytes: int = DEFAULT_CHUNK_BYTES) -> list[np.ndarray]:
    """Split a 1-D contiguous array into views of at most ``max_bytes`` each (no copy)."""
    if max_bytes <= 0:
        raise ValueError(f"chunk size must be positive, got {max_bytes}")
    step = max(1, max_bytes // vector.itemsize)
    n = vector.shape[0]
    if n <= step:
        return [vector]
    return [vector[i : i + step] for i in range(0, n, step)]


_SHOW = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 60, 60, 6, 6


def _show(value) -> str:
    """A peer's value quoted in an error message: bounded in depth and length, so a deeply
    nested or huge value can neither crash the refusal nor make its reply too large."""
    return _SHOW.repr(value)


def encode(
    kind: Kind, sender: int, seq: int, ts: int = 0, inc: int = 0, payloads=(), **fields
) -> list:
    """Build the frames of one message: [header, *payloads] (payload arrays are not copied).

    Send the result with ``socket.send_multipart(frames, copy=False)``. Raises ValueError if a
    field or payload does not fit the kind (a programming error, never network input).
    """
    spec = KIND_FIELDS[kind]
    for name in fields:
        if name not in spec:
            raise ValueError(f"{kind.name} has no field {name!r}")
    descr = []
    for arr in payloads:
        code = _DTYPE_CODES.get(arr.dtype)
        if code is None or arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError(
                f"{kind.name}: payloads must be 1-D contiguous {list(PAYLOAD_DTYPES)}, got "
                f"{arr.dtype} shape {arr.shape}"
            )
        descr.append([code, int(arr.shape[0])])
    header = {
        "v": PROTOCOL_VERSION,
        "k": int(kind),
        "s": int(sender),
        "q": int(seq),
        "ts": int(ts),
        "inc": int(inc),
        "p": descr,
        "x": fields,
    }
    return [msgpack.packb(header, use_bin_type=True), *payloads]


def _buffer(frame):
    # zmq.Frame (copy=False receive) exposes .buffer; bytes/memoryview are buffers already.
    try:
        return frame.buffer
    except AttributeError:
        return frame


def _nbytes(buf) -> int:
    # len() of a typed buffer (a float32 array) counts elements, not bytes.
    return memoryview(buf).nbytes


_INT_KEYS = ("v", "k", "s", "q", "ts", "inc")
_HEADER_KEYS = frozenset(_INT_KEYS + ("p", "x"))
_KINDS = {int(k): k for k in Kind}


def decode(
    frames,
    *,
    kinds=None,
    numel: int | None = None,
    learners: int | None = None,
    slots: bool = False,
    dtypes: ModelDtypes = FLOAT32,
) -> Message:
    """Validate and parse one message (without the ROUTER routing id).

    Args:
        frames: the message's frames (``zmq.Frame``, bytes or memoryview).
        kinds: if given, the kinds this receiver accepts.
        numel: if given, the model size that model-sized payloads must add up to.
        learners: if given, λ: learner ids in a RELAY clock or HELLO subtree must be below it
            (and a clock may list at most λ gradients).
        slots: accept a PUSH/PUSHPULL whose gradient is in a shared-memory slot (x{slot}, no
            payload); only a leaf with ``architecture.leaf_shm`` does.
        dtypes: the wire codes of this run's model-sized payloads (gradients; weights and
            BCAST chunks): the run's ``codec.dtypes(cfg)``; float32 by default.

    Raises :class:`WireError` naming what was wrong. Does not block; thread-safe.
    """
    if not isinstance(dtypes, ModelDtypes):
        raise TypeError(f"dtypes must be a wire.ModelDtypes, got {type(dtypes).__name__}")
    if not frames:
        raise WireError("empty", "empty message (no header frame)")
    raw = _buffer(frames[0])
    if _nbytes(raw) > MAX_HEADER_BYTES:
        raise WireError(
            "header_too_large", f"header of {_nbytes(raw):,} bytes exceeds {MAX_HEADER_BYTES:,}"
        )
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError("bad_header", f"header is not valid msgpack: {exc}") from None
    if not isinstance(h, dict):
        raise WireError("bad_header", f"header must be a map, got {type(h).__name__}")
    for key in _INT_KEYS:
        val = h.get(key)
        if type(val) is not int:
            raise WireError(
                "bad_header", f"header field {key!r} must be an integer, got {_show(val)}"
            )
    if h["v"] != PROTOCOL_VERSION:
        raise WireError(
            "version",
            f"protocol version {h['v']} is not {PROTOCOL_VERSION} "
            "(are all roles running the same rudra_zmq release?)",
        )
    kind = _KINDS.get(h["k"])  # a dict lookup: Kind(k) costs microseconds per message
    if kind is None:
        raise WireError("bad_kind", f"unknown message kind {h['k']}")
    if kinds is not None and kind not in kinds:
        names = ", ".join(sorted(k.name for k in kinds))
        raise WireError("unexpected_kind", f"{kind.name} is not accepted here (expects {names})")
    if not _HEADER_KEYS.issuperset(h):
        raise WireError(
            "bad_header", f"unknown header fields {_show(sorted(map(repr, set(h) - _HEADER_KEYS)))}"
        )
    fields = h.get("x", {})
    if not isinstance(fields, dict):
        raise WireError("bad_header", f"field map 'x' must be a map, got {type(fields).__name__}")
    _check_fields(kind, fields)
    _check_learner_lists(kind, fields, learners)
    if "slot" in fields and not slots:
        raise WireError(
            "unexpected_field",
            f"{kind.name} x{{slot}} (a gradient in shared "
            "memory) goes only to a leaf that accepted it in its WELCOME",
        )
    payloads = _check_payloads(kind, h.get("p", []), frames[1:], numel, fields, dtypes)
    return Message(kind, h["s"], h["q"], h["ts"], h["inc"], fields, payloads)


def _check_fields(kind: Kind, fields: dict) -> None:
    spec = KIND_FIELDS[kind]
    for name, val in fields.items():
        if name not in spec:
            raise WireError("bad_field", f"{kind.name} has no field {_show(name)}")
        types, _ = spec[name]
        if type(val) not in types:
            raise WireError(
                "bad_field",
                f"{kind.name} field {name!r} has type "
                f"{type(val).__name__}, expected {types[0].__name__}",
            )
    for name, (_, required) in spec.items():
        if required and name not in fields:
            raise WireError("bad_field", f"{kind.name} is missing field {name!r}")


def _check_learner_lists(kind: Kind, fields: dict, learners: int | None) -> None:
    """RELAY clocks are non-empty lists of [learner, ts] int pairs, HELLO subtrees lists of
    learner ids; ids in 0..learners-1, timestamps >= 0, lengths bounded."""
    limit = MAX_CLOCK if learners is None else min(MAX_CLOCK, learners)
    top = "" if learners is None else f" (λ = {learners})"
    if kind == Kind.RELAY:
        clock = fields["clock"]
        if not 1 <= len(clock) <= limit:
            raise WireError(
                "bad_clock", f"RELAY clock has {len(clock)} entries; expected 1..{limit}{top}"
            )
        for e in clock:
            if not (isinstance(e, list) and len(e) == 2 and all(type(v) is int for v in e)):
                raise WireError(
                    "bad_clock",
                    f"RELAY clock entry {_show(e)} is not a [learner, timestamp] pair of integers",
                )
        ids, what = [e[0] for e in clock], "RELAY clock"
        if min(e[1] for e in clock) < 0:
            raise WireError("bad_clock", f"RELAY clock has a negative timestamp: {_show(clock)}")
    elif kind == Kind.HELLO and "subtree" in fields:
        ids, what = fields["subtree"], "HELLO subtree"
        if not 1 <= len(ids) <= limit or any(type(v) is not int for v in ids):
            raise WireError(
                "bad_field",
                f"HELLO subtree must list 1..{limit} learner ids{top}, got {_show(ids)}",
            )
    else:
        return
    bad = [i for i in ids if i < 0 or (learners is not None and i >= learners)]
    if bad:
        span = f"0..{learners - 1}{top}" if learners is not None else "ids >= 0"
        raise WireError(
            "bad_clock" if kind == Kind.RELAY else "bad_field",
            f"{what} names learner {bad[0]}, outside {span}",
        )


def _is_part(fields: dict) -> bool:
    return "at" in fields or "more" in fields


def _in_shm(kind: Kind, fields: dict) -> bool:
    return (kind in (Kind.PUSH, Kind.PUSHPULL) and "slot" in fields) or (
        kind == Kind.WEIGHTS and fields.get("board", False)
    )


def _check_payloads(kind: Kind, descr, frames, numel, fields, dtypes):
    in_shm = _in_shm(kind, fields)
    if in_shm and fields.get("slot", 0) not in (0, 1):
        raise WireError("bad_field", f"{kind.name}: slot must be 0 or 1, got {_show(fields)}")
    lo, hi = (0, 0) if in_shm else PAYLOAD_FRAMES[kind]
    if not isinstance(descr, list) or len(descr) != len(frames):
        raise WireError(
            "bad_payload",
            f"{kind.name}: header describes "
            f"{len(descr) if isinstance(descr, list) else _show(descr)} payload frames "
            f"but {len(frames)} arrived",
        )
    if not lo <= len(frames) <= hi:
        raise WireError(
            "bad_payload", f"{kind.name} carries {lo}..{hi} payload frames, got {len(frames)}"
        )
    out, want = [], dtypes.of(kind)
    for i, (d, frame) in enumerate(zip(descr, frames)):
        if (
            not isinstance(d, list)
            or len(d) != 2
            or type(d[0]) is not str
            or d[0] not in PAYLOAD_DTYPES
            or type(d[1]) is not int
            or d[1] < 0
        ):
            raise WireError(
                "bad_payload",
                f"{kind.name}: payload {i} descriptor {_show(d)} is not "
                f"[dtype in {list(PAYLOAD_DTYPES)}, count >= 0]",
            )
        dtype = PAYLOAD_DTYPES[d[0]]
        buf = _buffer(frame)
        nbytes = _nbytes(buf)
        if nbytes != d[1] * dtype.itemsize:
            raise WireError(
                "bad_length",
                f"{kind.name}: payload {i} has {nbytes:,} bytes, its header says {d[1]:,} x {d[0]}",
            )
        if want is not None and d[0] != want:
            raise WireError(
                "bad_dtype",
                f"{kind.name}: its payloads are {want} in this run, payload {i} is {d[0]} "
                "(is the sender running other wire.gradient_dtype/weights_dtype?)",
            )
        out.append(np.frombuffer(buf, dtype=dtype))
    if (
        numel is not None
        and (kind in MODEL_SIZED or (kind == Kind.HELLO and frames))
        and not in_shm
    ):
        _check_numel(kind, sum(d[1] for d in descr), numel, fields)
    return out


def _check_numel(kind: Kind, total: int, numel: int, fields: dict) -> None:
    """A whole vector carries ``numel`` floats; a part (x{at}) elements at.. of it, not past
    the end, at least one with x{more} (parts come in any order: the last sent, without
    x{more}, may lie anywhere; a reply whose parts all went ahead carries none)."""
    if _is_part(fields):
        at, more = fields.get("at", 0), fields.get("more", False)
        end = at + total
        if at < 0 or end > numel or (more and total < 1):
            raise WireError(
                "bad_length",
                f"{kind.name} carries a part of {total:,} floats at {at:,}"
                f"{' (more to come)' if more else ' (the last)'}; the vector has {numel:,} "
                "(is the sender running another model config or wire.parts?)",
            )
        return
    if total != numel:
        raise WireError(
            "bad_length",
            f"{kind.name} carries {total:,} floats; the model has "
            f"{numel:,} (is the sender running another model "
            "config?)",
        )
