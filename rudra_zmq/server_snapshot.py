"""A parameter server's checkpoint contents: what ``ServerState`` saves and how a restarted
server continues from it as a new incarnation. Pure data handling, no files (``checkpoint.py``
writes them atomically, ``roles/ps_checkpoint.py`` decides when)."""

from __future__ import annotations

import re

import numpy as np

from . import record_fields as fields
from .span import Span
from .versions import WeightVersions

COUNTERS = ("invalid", "duplicates", "evictions", "lost_updates")  # what a checkpoint keeps
ARRAYS = ("w", "v", "acc")  # weights, momentum, the gradient sum being built


def snapshot(state) -> tuple[dict, dict]:
    """(arrays, meta): everything a restarted server needs, for ``checkpoint.save``. The
    arrays are the live buffers of ``span`` (no copy): save them before the next update;
    meta ``numel`` is the model's size and ``range`` the span [lo, hi]. Pure."""
    u, c = state.updater, state.counters
    meta = {
        "numel": state.model_numel,
        "range": [state.span.lo, state.span.hi],
        "signature": state.signature,
        "engine": state.engine.state_dict(),
        "incarnations": state.incarnations,
        "applied": {str(k): list(v) for k, v in state.applied.items()},
        "steps": {str(k): v for k, v in state.steps.items()},
        "done": state.done,
        "counters": {name: getattr(c, name) for name in COUNTERS},
    }
    return dict(zip(ARRAYS, (u.w, u.v, u.acc), strict=True)), meta


_ID = 2**63  # incarnations and message seqs are random or clock-made int64s
_ENGINE = {
    "timestamp": fields.integer(),
    "gradients_received": fields.integer(),
    "updates": fields.integer(),
    "pending": fields.Field(
        "a list of [learner, timestamp, σ] of integers >= 0",
        lambda v: isinstance(v, list) and all(fields.integers().ok(p) and len(p) == 3 for p in v),
    ),
    "members": fields.integers(),
    "too_stale": fields.integer().optional(),
    "protocol": fields.Field(
        "[protocol, n, hardsync since] (a string, an integer or null, an integer or null)",
        lambda v: (
            isinstance(v, list)
            and len(v) == 3
            and isinstance(v[0], str)
            and all(x is None or fields.integer().ok(x) for x in v[1:])
        ),
    ).optional(),
}


def _by_sender(value_ok, what: str, nodes: bool = False) -> fields.Field:
    """An object whose keys are sender ids written as strings -- learners from 0 (and, with
    ``nodes``, tree nodes below 0: ``wire.node_sender``) -- each value ``value_ok``."""
    key = re.compile(r"-?\d{1,18}" if nodes else r"\d{1,18}")
    return fields.Field(
        f"an object of {'sender' if nodes else 'learner'} id -> {what}",
        lambda v: (
            isinstance(v, dict) and all(key.fullmatch(k) and value_ok(x) for k, x in v.items())
        ),
    )


META_FIELDS = {
    "numel": fields.integer(1),
    "range": fields.Field(
        "[lo, hi] with 0 <= lo < hi", lambda v: fields.integers().ok(v) and len(v) == 2
    ).optional(),  # a checkpoint from before ranges: the whole vector
    "signature": fields.text(),
    "engine": fields.mapping(),
    "incarnations": fields.integers(0, _ID),
    "applied": _by_sender(
        lambda x: (
            isinstance(x, list)
            and len(x) == 2
            and fields.integer(0, _ID).ok(x[0])
            and (x[1] is None or fields.integer().ok(x[1]))
        ),
        "[seq, σ or null]",
        nodes=True,
    ),
    "steps": _by_sender(fields.integer().ok, "an integer >= 0"),
    "done": fields.flag(),
    "counters": fields.Field(
        f"an object of counts >= 0 named {', '.join(COUNTERS)}",
        lambda v: (
            isinstance(v, dict)
            and set(v) <= set(COUNTERS)
            and all(map(fields.integer().ok, v.values()))
        ),
    ),
}


def check_meta(meta, learners: int | None = None) -> None:
    """Raise record_fields.DamagedRecord (a ValueError) naming the field and its value when a
    checkpoint's ``meta`` is not what ``snapshot`` writes (``META_FIELDS``), or names a
    learner beyond ``learners`` (λ, when given); a checkpoint that fails is damaged
    (``checkpoint.load_latest`` falls back to the one before). Pure."""
    fields.check(meta, META_FIELDS, "meta")
    engine = fields.check(meta["engine"], _ENGINE, "meta.engine")
    if learners is not None:
        ids = [("meta.engine.members", m) for m in engine["members"]]
        ids += [("meta.engine.pending", p[0]) for p in engine["pending"]]
        ids += [("meta.steps", int(k)) for k in meta["steps"]]
        for where, learner in ids:
            if learner >= learners:
                raise fields.DamagedRecord(
                    f"{where} names learner {learner}; this run has λ={learners} "
                    f"(ids 0..{learners - 1})"
                )
    lo_hi = meta.get("range")
    if lo_hi is not None and not lo_hi[0] < lo_hi[1] <= meta["numel"]:
        raise fields.DamagedRecord(
            f"meta: range is {lo_hi}; expected [lo, hi] with lo < hi <= numel ({meta['numel']})"
        )


def restore(state, arrays: dict, meta: dict) -> None:
    """Continue from a ``snapshot`` (a checkpoint), as a new incarnation: every learner
    must say HELLO again. A checkpoint without a ``range`` (written before servers had
    ranges) holds the whole vector. Raises ValueError if the checkpoint holds another
    model or another range of it."""
    if meta["numel"] != state.model_numel or meta["signature"] != state.signature:
        raise ValueError(
            f"the checkpoint holds a model of {meta['numel']:,} parameters "
            f"({meta['signature']}); this run's model has "
            f"{state.model_numel:,} ({state.signature}): was the model config "
            "changed?"
        )
    saved = Span.from_meta(meta.get("range"), meta["numel"])
    if saved != state.span:
        raise ValueError(
            f"the checkpoint holds range {saved} of the model's parameters; "
            f"this server serves range {state.span}: restore each server from "
            "its own range's checkpoints (was the number of servers changed?)"
        )
    for name in ARRAYS:
        if arrays[name].shape != (state.numel,) or arrays[name].dtype != np.float32:
            raise ValueError(
                f"checkpoint array {name!r} is {arrays[name].dtype} "
                f"{arrays[name].shape}, expected float32 ({state.numel},)"
            )
    u = state.updater
    u.versions = WeightVersions(np.ascontiguousarray(arrays["w"]))
    u.v[:] = arrays["v"]
    u.acc[:] = arrays["acc"]
    state.engine.load_state(meta["engine"])
    state.incarnations = [int(i) for i in meta["incarnations"]] + [state.incarnation]
    state.applied = {
        int(k): (int(v[0]), None if v[1] is None else int(v[1])) for k, v in meta["applied"].items()
    }
    state.steps = {int(k): int(v) for k, v in meta["steps"].items()}
    # every learner says HELLO again (and is told STOP then, if training is over); a run
    # resumed with more train.epochs goes on
    state.stopped = set()
    state.done = state.engine.epoch >= state.epochs
    for k, v in meta["counters"].items():
        setattr(state.counters, k, int(v))
    state.restored_ts = state.engine.timestamp
    state.lost_base, state.lost_now = state.counters.lost_updates, 0
