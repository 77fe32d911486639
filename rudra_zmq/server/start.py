"""Where a parameter server's state comes from: the configured model's initial weights (from
the cache, or built with torch and then cached) or, with ``resume``, the newest valid
checkpoint, with the learners told STOP before the restart (``checkpointing``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..notices import notice
from ..run_files import checkpoints_root
from ..shape import ClusterShape, Server
from .checkpointing import ToldRecord, restore_latest
from .state import ServerState

log = logging.getLogger("rudra_zmq.ps")


def initial_model(cfg):
    """The configured model's initial state: (weights copy, segments, signature, input shape),
    from the cache (``initial_weights``: no torch) or built, then cached. Blocks."""
    from ..data.datasets import dataset_shape
    from . import initial_weights

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
    cfg, model, run_dir: Path | None, resume: bool, server: int = 0
) -> tuple[ServerState, ToldRecord | None, Path | None, Server]:
    """(state, told, resumed_from, place): the state of server ``server`` of the run's
    shape (``shape.ClusterShape``) over its range of ``model`` (weights, segments,
    signature) or, if None, of the configured model (``initial_model``); with ``resume`` and
    a ``run_dir``, restored from the newest valid checkpoint of its range there as a new
    incarnation. ``told``: the record of who was told STOP (None without a ``run_dir``);
    ``resumed_from``: the checkpoint, or None; ``place``: the server, its range known.
    Raises ConfigError for more servers than the model has parameters. Blocks while torch is
    imported and the model built, or the checkpoint read."""
    from ..data.datasets import dataset_size

    weights, segments, signature = model if model is not None else initial_model(cfg)[:3]
    place = ClusterShape.of(cfg, weights.shape[0]).server(server)
    state = ServerState(
        cfg,
        weights,
        segments,
        signature,
        dataset_size(cfg.data),
        share=place.share,
        parts=len(place.parts),
    )
    resumed_from = None
    where = place.checkpoint_dir(run_dir) if run_dir else None
    told = ToldRecord(where) if run_dir else None
    if resume and run_dir is not None:
        resumed_from = restore_latest(state, where, checkpoints_root(run_dir))
        if resumed_from is None:  # it died before its first one
            notice(
                log,
                "no checkpoint in %s: taking this server's range back from the freshest copy "
                "its %s (the initial weights if none holds one)",
                where,
                "learners hold" if state.tree is None else "tree nodes pass up from their learners",
            )  # the server's Recovery; restored_ts is set when it resumes
        elif stopped := told.restore(state):
            log.info(
                "training was over; learners %s were told STOP already (%s)",
                sorted(stopped),
                told.path,
            )
    return state, told, resumed_from, place
