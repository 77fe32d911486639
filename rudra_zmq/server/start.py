"""Where a parameter server's state comes from: the configured model's initial weights (from
the cache, or built with torch and then cached) or, with ``resume``, the newest valid
checkpoint, with the learners told STOP before the restart (``checkpointing``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import ConfigError
from ..config_architecture import check_servers_fit
from ..notices import notice
from ..span import Span, split
from .checkpointing import ToldRecord, checkpoint_dir, restore_latest
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


def shard_span(cfg, numel: int, shard: int) -> Span:
    """The range server ``shard`` of ``architecture.servers`` serves in a model of ``numel``
    floats (``span.split``). Raises ConfigError for a shard out of range or more servers than
    parameters. Pure."""
    k = cfg.architecture.servers
    if not 0 <= shard < k:
        raise ConfigError(f"server {shard}: architecture.servers={k} numbers them 0..{k - 1}")
    check_servers_fit(k, numel)
    return split(numel, k)[shard]


def start_state(
    cfg, model, run_dir: Path | None, resume: bool, span=None, shard: int | None = None
) -> tuple[ServerState, ToldRecord | None, Path | None]:
    """(state, told, resumed_from): the state of ``model`` (weights, segments, signature) or,
    if None, of the configured model (``initial_model``); with ``resume`` and a ``run_dir``,
    restored from the newest valid checkpoint there as a new incarnation. ``told``: the record
    of who was told STOP (None without a ``run_dir``); ``resumed_from``: the checkpoint, or
    None. ``span``: the range of the vector this server serves (None: the whole), or
    ``shard``: its index among ``architecture.servers`` (``shard_span``). Blocks while torch
    is imported and the model built, or the checkpoint read."""
    from ..data.datasets import dataset_size

    weights, segments, signature = model if model is not None else initial_model(cfg)[:3]
    if shard is not None:
        span = shard_span(cfg, weights.shape[0], shard)
    state = ServerState(cfg, weights, segments, signature, dataset_size(cfg.data), span=span)
    resumed_from = None
    where = checkpoint_dir(run_dir, state.span) if run_dir else None
    told = ToldRecord(where) if run_dir else None
    if resume and run_dir is not None:
        resumed_from = restore_latest(state, where)
        if resumed_from is None:  # it died before its first checkpoint
            notice(
                log,
                "no checkpoint in %s: starting from the initial weights",
                where,
            )
            state.restored_ts = 0  # what learners saw is all lost (and reported)
        elif stopped := told.restore(state):
            log.info(
                "training was over; learners %s were told STOP already (%s)",
                sorted(stopped),
                told.path,
            )
    return state, told, resumed_from
