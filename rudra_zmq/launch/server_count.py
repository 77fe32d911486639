"""``architecture.servers`` against the model's size, before any role starts: each of the K
parameter servers serves one range of the flat vector and needs at least one parameter.

The size comes from the initial-weights cache (``initial_weights``: no torch) or, when the
model is not cached yet, from building it once in a child process, which fills the cache the
PS then reads (the launcher itself never imports torch). Blocks for that child (seconds).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from .. import config as config_mod
from ..config import ConfigError
from ..config_architecture import check_servers_fit

_SIZE = (
    "import sys; from rudra_zmq import config; from rudra_zmq.roles.ps_start import "
    "initial_model; print(initial_model(config.load_config(sys.argv[1]))[0].shape[0])"
)


def model_numel(cfg) -> int:
    """How many parameters the configured model has. Blocks; raises ConfigError when the
    model cannot be built (its error in the message)."""
    from ..data.datasets import dataset_shape
    from ..initial_weights import read

    cached = read(cfg, dataset_shape(cfg.data))
    if cached is not None:
        return int(cached[0].shape[0])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        config_mod.save(cfg, path)
        out = subprocess.run(
            [sys.executable, "-c", _SIZE, str(path)], capture_output=True, text=True
        )
    last = (out.stdout.strip().splitlines() or [""])[-1]  # a user model may print first
    if out.returncode != 0 or not last.isdigit():
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"could not build model.name={cfg.model.name!r}: {tail}")
    return int(last)


def check_servers(cfg) -> None:
    """Raise ConfigError when ``architecture.servers`` exceeds the model's parameter count.
    Nothing to do (and nothing built) for one server."""
    if cfg.architecture.servers > 1:
        check_servers_fit(cfg.architecture.servers, model_numel(cfg))
