"""The wire protocol's vocabulary: every message kind (:class:`Kind`), the fields and payload
frames each carries (KIND_FIELDS, PAYLOAD_FRAMES), the sender ids of the header's ``s``, and
the dtype names a run's config gives its model-sized payloads (WIRE_DTYPES).

Tables only: ``wire.py``, which re-exports these names (callers write ``wire.Kind``), builds
and parses the frames and checks a message against them.
"""

from __future__ import annotations

import enum

# wire.gradient_dtype / wire.weights_dtype values -> the payload code their frames carry
WIRE_DTYPES = {"float32": "f4", "float16": "f2", "bfloat16": "bf16"}

SENDER_PS, SENDER_DATA, SENDER_STATS, SENDER_TOOL = -1, -2, -3, -4
SENDER_NODE0 = -100  # tree node k sends as SENDER_NODE0 - k


def node_sender(node: int) -> int:
    """The sender id of tree node ``node`` (>= 0)."""
    return SENDER_NODE0 - node


def node_id(sender: int) -> int | None:
    """The tree node id behind ``sender``, or None if it is not a tree node."""
    return SENDER_NODE0 - sender if sender <= SENDER_NODE0 else None


def sender_name(sender: int) -> str:
    """``"learner 3"``, ``"tree node 0"``, ``"parameter server"``... for messages."""
    if sender >= 0:
        return f"learner {sender}"
    if node_id(sender) is not None:
        return f"tree node {node_id(sender)}"
    return {
        SENDER_PS: "parameter server",
        SENDER_DATA: "data server",
        SENDER_STATS: "statistics server",
    }.get(sender, f"sender {sender}")


def copy_holder_sender(name: str) -> int | None:
    """The sender id behind ``"learner L"`` or ``"tree node N"`` as :func:`sender_name`
    writes them (the roles whose copy a restarted server takes its range from), or None for
    any other text. Pure."""
    word, _, n = name.rpartition(" ")
    if word not in ("learner", "tree node") or not (n.isascii() and n.isdigit()) or len(n) > 9:
        return None
    return int(n) if word == "learner" else node_sender(int(n))


class Kind(enum.IntEnum):
    """Message kinds. Requests get exactly one reply from the server they were sent to."""

    HELLO = 1  # learner/node -> PS: x{model, numel, subtree?, had?, step?}; WELCOME or ERROR;
    #            a rejoining learner's carries its copy of the range (float32, at ``had``)
    WELCOME = 2  # PS -> learner: weights payload; x{learners, protocol, step?}; to a tree
    #                  node x{steps?}: [learner, step] for each learner below it
    # Replies (WELCOME, ACK, WEIGHTS, UPTODATE, STOP, ERROR) may carry x{re}: the seq of the
    # request they answer, so a client drops a late answer to a request it sent again.
    PUSH = 3  # learner -> PS: gradient payload, ts = weights it was computed on; ACK
    ACK = 4  # PS -> learner: x{sigma}
    PULL = 5  # learner -> PS: ts = weights it has; WEIGHTS or UPTODATE, when the sync
    #                  engine says (hardsync: after the update the learner's gradient is in)
    PUSHPULL = 6  # PUSH and PULL in one round trip; reply WEIGHTS or UPTODATE with x{sigma}
    WEIGHTS = 7  # PS -> learner: weights payload at ts
    UPTODATE = 8  # PS -> learner: no newer weights than the pull's ts
    STOP = 9  # any server -> client: training is over; x{reason}
    ERROR = 10  # reply to a refused request: x{code, error}
    BATCH_REQ = 11  # learner -> data server: x{step}; reply BATCH
    BATCH = 12  # data server -> learner: [images u1, labels i8]; x{shape, epoch, step, mean?, std?}
    METRIC = 13  # any -> stats server (one-way): x{metric: map}
    EVAL = 14  # PS -> stats server (one-way): weights payload at ts; x{epoch}
    BYE = 15  # learner -> PS: leaving cleanly; reply ACK
    RELAY = 16  # tree node -> parent: sum of gradients, x{clock}; like PUSHPULL
    BCAST = 17  # broadcast chunk of weights version ts: x{chunk, offset, total}; one-way
    CREDIT = 18  # broadcast member -> upstream: may send k more chunks; x{credit, reset}
    # (19 and 20 were protocol version 1's parts, removed)
    CHECK = 21  # client -> PS/tree node: "did you get request q?" (q = that request's seq),
    #                  sent when it is unanswered for runtime.retry_s; a header, never a payload
    RECEIPT = 22  # server -> client: x{re, got}: whether request re reached this server


# Kind-specific fields: name -> allowed Python types, and whether it is required.
_INT, _FLOAT, _STR, _BOOL, _LIST, _MAP = (int,), (int, float), (str,), (bool,), (list,), (dict,)
KIND_FIELDS: dict[Kind, dict[str, tuple[tuple, bool]]] = {
    Kind.HELLO: {
        "model": (_STR, True),
        "numel": (_INT, True),
        "subtree": (_LIST, False),
        "shm": (_STR, False),
        "had": (_INT, False),
        "range": (_LIST, False),  # [lo, hi]: the range a learner (or node) expects (none: all)
        "step": (_INT, False),  # a rejoining learner's next data step
    },
    Kind.WELCOME: {
        "learners": (_INT, True),
        "protocol": (_STR, True),
        "shm": (_STR, False),
        "step": (_INT, False),
        "steps": (_LIST, False),
        "re": (_INT, False),
    },
    Kind.PUSH: {"slot": (_INT, False)},
    Kind.ACK: {"sigma": (_INT, False), "re": (_INT, False)},
    Kind.PULL: {},
    # x{at, more}: one part of a gradient (wire.parts): its payload is elements at.. of the
    # vector; ``more`` on every part but the one sent last (parts go in any order: as
    # backward completes them, the last layers' first); the request is answered once all are in
    Kind.PUSHPULL: {"slot": (_INT, False), "at": (_INT, False), "more": (_BOOL, False)},
    # x{at}: the payload is the elements from at that did not go ahead (the rest went ahead;
    # none if all did); x{at, more}: one part of the reply ahead of the rest, in any order,
    # to the request x{re} still awaiting it
    Kind.WEIGHTS: {
        "sigma": (_INT, False),
        "board": (_BOOL, False),
        "re": (_INT, False),
        "at": (_INT, False),
        "more": (_BOOL, False),
    },
    Kind.UPTODATE: {"sigma": (_INT, False), "re": (_INT, False)},
    Kind.STOP: {"reason": (_STR, True), "re": (_INT, False)},
    Kind.ERROR: {"code": (_STR, True), "error": (_STR, True), "re": (_INT, False)},
    Kind.BATCH_REQ: {"step": (_INT, True)},
    Kind.BATCH: {
        "shape": (_LIST, True),
        "epoch": (_FLOAT, True),
        "step": (_INT, True),
        "mean": (_LIST, False),
        "std": (_LIST, False),
    },  # per-channel, 0..1 scale
    Kind.METRIC: {"metric": (_MAP, True), "token": (_STR, False)},  # token: from the PS
    Kind.EVAL: {
        "epoch": (_FLOAT, True),
        "token": (_STR, False),
        "range": (_LIST, False),  # [lo, hi]: the range of the server that sent it
        "final": (_BOOL, False),  # ... and whether these are its final weights
    },
    Kind.BYE: {},
    Kind.RELAY: {"clock": (_LIST, True)},
    Kind.BCAST: {"chunk": (_INT, True), "offset": (_INT, True), "total": (_INT, True)},
    Kind.CREDIT: {"credit": (_INT, True), "reset": (_BOOL, True)},
    Kind.CHECK: {},
    Kind.RECEIPT: {"re": (_INT, True), "got": (_BOOL, True)},
}
# How many payload frames each kind carries: (min, max); model-sized kinds may be chunked.
MAX_FRAMES = 4096  # payload frames of one model-sized message
MODEL_SIZED = {Kind.WELCOME, Kind.PUSH, Kind.PUSHPULL, Kind.WEIGHTS, Kind.EVAL, Kind.RELAY}
PAYLOAD_FRAMES = {k: (0, 0) for k in Kind}
PAYLOAD_FRAMES.update({k: (1, MAX_FRAMES) for k in MODEL_SIZED})
PAYLOAD_FRAMES[Kind.BATCH] = (2, 2)
# a rejoining learner's copy of the range (none, or the whole range in float32): what a server
# restarted without a checkpoint takes its range back from (docs/fault-tolerance.md)
PAYLOAD_FRAMES[Kind.HELLO] = (0, MAX_FRAMES)
PAYLOAD_FRAMES[Kind.BCAST] = (1, 1)
# Model-sized payloads in the run's wire dtypes (``wire.gradient_dtype``, ``wire.weights_dtype``);
# EVAL stays float32: the statistics server evaluates the PS's own (master) weights.
GRADIENT_KINDS = frozenset({Kind.PUSH, Kind.PUSHPULL, Kind.RELAY})
WEIGHT_KINDS = frozenset({Kind.WELCOME, Kind.WEIGHTS, Kind.BCAST})
