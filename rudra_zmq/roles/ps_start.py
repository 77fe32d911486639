"""Where a parameter server's state comes from: the configured model's initial weights (from
the cache, or built with torch and then cached) or, with ``resume``, the newest valid
checkpoint, with the learners told STOP before the restart (``ps_checkpoint``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..notices import notice
from ..server_state import ServerState
from .ps_checkpoint import ToldRecord, checkpoint_dir, restore_latest

log = logging.getLogger("rudra_zmq.ps")


def initial_model(cfg):
    """The configured model's initial state: (weights copy, segments, signature, input shape),
    from the cache (``initial_weights``: no torch) or built, then cached. Blocks."""
    from .. import initial_weights
    from ..data.datasets import dataset_shape

    shape = dataset_shape(cfg.data)
    cached = initial_weights.read(cfg, shape)
    if cached is not None:
        return (*cached, shape)
    from ..flat import FlatModel
    from ..models import build_model

    flat = FlatModel(build_model(cfg.model.name, cfg.data.num_classes, shape, seed=cfg.model.seed))
    segments = flat.segments() if cfg.optimizer.param_multipliers else [(0, flat.numel, 1.0, 1.0)]
    initial_weights.write(cfg, shape, flat.weights, segments, flat.signature)
    return flat.weights.copy(), segments, flat.signature, shape


def start_state(
    cfg, model, run_dir: Path | None, resume: bool, span=None
) -> tuple[ServerState, ToldRecord | None, Path | None]:
    """(state, told, resumed_from): the state of ``model`` (weights, segments, signature) or,
    if None, of the configured model (``initial_model``); with ``resume`` and a ``run_dir``,
    restored from the newest valid checkpoint there as a new incarnation. ``told``: the record
    of who was told STOP (None without a ``run_dir``); ``resumed_from``: the checkpoint, or
    None. ``span``: the range of the vector this server serves (None: the whole). Blocks
    while torch is imported and the model built, or the checkpoint read."""
    from ..data.datasets import dataset_size

    weights, segments, signature = model if model is not None else initial_model(cfg)[:3]
    state = ServerState(cfg, weights, segments, signature, dataset_size(cfg.data), span=span)
    resumed_from = None
    told = ToldRecord(checkpoint_dir(run_dir)) if run_dir else None
    if resume and run_dir is not None:
        resumed_from = restore_latest(state, checkpoint_dir(run_dir))
        if resumed_from is None:  # it died before its first checkpoint
            notice(
                log,
                "no checkpoint in %s: starting from the initial weights",
                checkpoint_dir(run_dir),
            )
            state.restored_ts = 0  # what learners saw is all lost (and reported)
        elif stopped := told.restore(state):
            log.info(
                "training was over; learners %s were told STOP already (%s)",
                sorted(stopped),
                told.path,
            )
    return state, told, resumed_from
