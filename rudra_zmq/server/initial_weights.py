"""The parameter server's initial weights, cached so that a PS built once never imports torch
again for them (about 1.5 s of CPU, at start-up, beside the learners' own imports).

- ``read(cfg, shape)``: (weights, segments, signature) from the cache, or None (no entry, an
  unreadable one, or a model that is not cached).
- ``write(cfg, shape, weights, segments, signature)``: atomically (temporary file renamed).

One ``.npz`` per (built-in model, classes, input shape, seed, multipliers, torch version,
source of ``models.py`` and ``flat.py``) under ``datasets.default_cache_dir()/initial``: what
the weights depend on, so an entry is never stale; the test compares the cached weights with
freshly built ones bit for bit. User models (``package.module:function``, whose source is not
in the key) and unseeded ones are never cached. Functions block on the file system only and
never import torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import sys
from pathlib import Path

import numpy as np

from ..data.dataset_cache import save_npz
from ..data.datasets import default_cache_dir
from ..user_code import is_import_path

CACHE_VERSION = 1
_SOURCES = ("models.py", "flat.py")  # what builds the weights and lays them out


def cache_path(cfg, shape) -> Path | None:
    """The cache file of the configured model's initial weights, or None when it is not
    cached (a user model, no seed, torch not installed as a package). Creates nothing."""
    m = cfg.model
    if m.seed is None or is_import_path(m.name):
        return None
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    here = Path(__file__).resolve().parent.parent  # the package: models.py, flat.py
    source = hashlib.sha256(b"".join((here / f).read_bytes() for f in _SOURCES)).hexdigest()
    key = repr(
        (
            CACHE_VERSION,
            m.name,
            cfg.data.num_classes,
            tuple(shape),
            m.seed,
            bool(cfg.optimizer.param_multipliers),
            torch_version,
            source,
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return default_cache_dir() / "initial" / f"{m.name}-{digest}.npz"


def read(cfg, shape):
    """(weights float32, segments, signature) cached for ``cfg``'s model, or None (said on
    stderr when an entry exists but cannot be read: the caller builds and replaces it)."""
    path = cache_path(cfg, shape)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            weights, seg, signature = z["weights"], z["segments"], str(z["signature"])
        if (
            weights.dtype != np.float32
            or weights.ndim != 1
            or seg.ndim != 2
            or seg.shape[1] != 4
            or seg[-1, 1] != weights.size
        ):
            raise ValueError("unexpected contents")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        print(f"rudra_zmq: ignoring unreadable cache {path} ({exc})", file=sys.stderr)
        return None
    segments = [(int(a), int(b), float(lr), float(dm)) for a, b, lr, dm in seg.tolist()]
    return weights, segments, signature


def write(cfg, shape, weights: np.ndarray, segments, signature: str) -> None:
    """Cache the initial weights of ``cfg``'s model (if it is cached at all), atomically.
    A cache that cannot be written is skipped silently: the next PS builds them again."""
    path = cache_path(cfg, shape)
    if path is None:
        return
    with contextlib.suppress(OSError):
        save_npz(
            path,
            weights=np.ascontiguousarray(weights, np.float32),
            segments=np.array(segments, np.float64).reshape(-1, 4),
            signature=np.array(signature),
        )


__all__ = ["CACHE_VERSION", "cache_path", "read", "write"]
