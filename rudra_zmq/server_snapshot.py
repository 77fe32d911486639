"""A parameter server's checkpoint contents: what ``ServerState`` saves and how a restarted
server continues from it as a new incarnation. Pure data handling, no files (``checkpoint.py``
writes them atomically, ``roles/ps_checkpoint.py`` decides when)."""

from __future__ import annotations

import numpy as np

from .span import Span
from .versions import WeightVersions


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
        "counters": {
            "invalid": c.invalid,
            "duplicates": c.duplicates,
            "evictions": c.evictions,
            "lost_updates": c.lost_updates,
        },
    }
    return {"w": u.w, "v": u.v, "acc": u.acc}, meta


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
    for name in ("w", "v", "acc"):
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
