"""Before any role starts: check every input that can be checked, and decode the data once.

``check(cfg)`` looks at what the config's values name, beyond what ``Config.validate`` can:
the data (``data.root`` exists and has the layout its dataset reads; a tarball opens, its first
members read), the extras the config needs (``logging.tensorboard``: the tensorboard
package), and the data keys that the dataset ignores (``data.root`` for the digits), which are
returned as warnings. A bad value raises ConfigError, one line naming it and what to do, so
``rudra-zmq run`` exits 2 with nothing created, as for any config error.

``prepare(cfg)`` decodes image data sets (a tree or tarball of images) once, into the cache
the roles read (:mod:`rudra_zmq.data.dataset_cache`), with a progress line on the terminal, using
every usable core: the statistics server, the data server and the PS then load it in a
fraction of a second instead of each decoding it (at the same time, on the same cores). It
also does CIFAR-10's download when ``data.download`` asks for it.

``run(cfg)`` is both, with the warnings printed and ``architecture.servers`` checked against the
model's size (:func:`check_servers`): what ``rudra-zmq run`` and ``rudra_zmq.train``
call before they create the run directory. ``rudra-zmq launch`` calls it when the servers run
on this host (``check(cfg, local=False)`` otherwise: the data are on another host), and
``rudra-zmq worker`` may on the servers' rank. Everything blocks; nothing here starts a role.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import config as config_mod
from ..config import ConfigError, DataConfig
from ..data import dataset_cache, datasets, images
from ..devices import usable_cores
from ..server import initial_weights
from ..shape import ClusterShape
from ..user_code import is_import_path

# model_numel: the model built in a child process, which fills the initial-weights cache
_SIZE = (
    "import sys; from rudra_zmq import config; from rudra_zmq.server.start import "
    "initial_model; print(initial_model(config.load_config(sys.argv[1]))[0].shape[0])"
)

TENSORBOARD_MISSING = (
    "logging.tensorboard: true needs the tensorboard package, which is not "
    "installed: pip install 'rudra_zmq[tensorboard]' (or set "
    "logging.tensorboard: false)"
)

# The data keys each dataset reads; a key outside its set that differs from its default is
# ignored, which deserves a warning (num_classes, augment and prefetch apply to all).
_READS = {
    "digits": {"limit_per_class"},
    "synthetic": {"synthetic_shape", "synthetic_train", "synthetic_test", "limit_per_class"},
    "cifar10": {"root", "download", "limit_per_class", "image_size"},
    "imagefolder": {"root", "image_size", "limit_per_class"},
    "user": {"root", "limit_per_class"},
}
_ALL = {
    "root",
    "download",
    "image_size",
    "synthetic_shape",
    "synthetic_train",
    "synthetic_test",
    "limit_per_class",
}
_WHY = {
    "digits": "it reads scikit-learn's bundled digits",
    "synthetic": "it makes random images",
    "cifar10": "it reads 32x32 images from data.root or its download",
    "imagefolder": "it reads the image files at data.root",
    "user": "your function returns the arrays",
}


def check(cfg, local: bool = True) -> list[str]:
    """Check the inputs of ``cfg`` that no role has read yet; return warnings (one line each)
    for data keys its dataset ignores. ``local``: the data and the servers are on this host,
    so check the data paths and the extras here too. Raises ConfigError naming the value and
    what to do. Blocks on a few file reads (a tarball's first members)."""
    warnings = ignored_keys(cfg.data)
    if local:
        check_data(cfg.data)
        check_extras(cfg)
    return warnings


def ignored_keys(d: DataConfig) -> list[str]:
    """One warning per data key set (differing from its default) that ``d.dataset`` ignores."""
    kind = "user" if is_import_path(d.dataset) else d.dataset
    if kind not in _READS:
        return []
    defaults = DataConfig()
    out = []
    for key in sorted(_ALL - _READS[kind]):
        value = getattr(d, key)
        if value != getattr(defaults, key):
            out.append(
                f"data.{key}={value!r} is ignored by data.dataset={d.dataset} "
                f"({_WHY[kind]}); remove it from the config"
            )
    return out


def check_data(d: DataConfig) -> None:
    """Raise ConfigError when the data ``d`` names cannot be there: a data.root that does not
    exist, a file that is no tarball of images, a folder without the dataset's layout."""
    if d.dataset == "cifar10":
        if d.image_size not in (None, 32):
            raise ConfigError(
                f"data.image_size={d.image_size}: cifar10 images are 32x32; "
                "remove it, or use data.dataset=imagefolder to resize images"
            )
        given = d.root is not None
        root = Path(d.root).expanduser() if given else datasets.default_cache_dir() / "cifar10"
        _check_root_file(root)
        if datasets.cifar10_source(root) is None and not d.download:
            raise ConfigError(datasets.cifar10_missing(root, given))
    elif d.dataset == "imagefolder":
        if d.root is None:
            raise ConfigError(
                "data.dataset=imagefolder needs data.root: a folder with "
                "train/<class>/* and test/<class>/* (or val/), or a .tar.gz of one"
            )
        root = Path(d.root).expanduser()
        if not root.exists():
            raise ConfigError(
                f"data.root {str(root)!r} does not exist; point it at a folder "
                "with train/<class>/* and test/<class>/* (or val/), or a .tar.gz "
                "of one"
            )
        _check_root_file(root)
        if root.is_dir() and not (root / "train").is_dir():
            raise ConfigError(
                f"data.root {str(root)!r} has no train/ folder; imagefolder reads "
                "train/<class>/* and test/<class>/* (or val/), or a .tar.gz of "
                "such a tree"
            )
    if root_dir := _tree_root(d):
        if not any(p.is_dir() for p in (root_dir / "test", root_dir / "val")):
            raise ConfigError(
                f"data.root {str(root_dir)!r} has train/ but no test/ (or val/) "
                "folder; the statistics server evaluates on it: add one"
            )


def _check_root_file(root: Path) -> None:
    """A data.root that is a file must be a readable tarball of split/class/images."""
    if not root.is_file():
        return
    if not images.is_tarball(root):
        raise ConfigError(
            f"data.root {str(root)!r} is a file but not a .tar.gz, .tgz or .tar; "
            "give a tarball of train/<class>/* and test/<class>/* images, or the "
            "folder of such a tree"
        )
    try:
        images.check_tarball(root)
    except ValueError as exc:
        raise ConfigError(f"data.root: {exc}") from None


def _tree_root(d: DataConfig) -> Path | None:
    """data.root when it is an ImageFolder tree the dataset reads, else None."""
    if d.dataset not in ("cifar10", "imagefolder") or d.root is None:
        return None
    root = Path(d.root).expanduser()
    if d.dataset == "cifar10" and (datasets.cifar10_source(root) or ("",))[0] != "images":
        return None
    return root if (root / "train").is_dir() else None


def check_extras(cfg) -> None:
    """Raise ConfigError when the config needs an optional package that is not installed."""
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_MISSING)


def prepare(cfg, out=None, workers: int | None = None) -> None:
    """Decode the image files of ``cfg.data`` into the roles' cache unless it is there (and
    download CIFAR-10 when data.download asks), saying so on ``out`` (default stdout), with
    ``workers`` decoding processes (default: every usable core). Raises ConfigError, one line,
    for data that cannot be read or decoded. Blocks while it decodes."""
    out = sys.stdout if out is None else out
    d = cfg.data
    if d.dataset == "cifar10" and d.download:
        _download(d, out)
    found = datasets.image_cache(d)
    if found is None:
        return
    root, path = found
    if path.is_file():
        _check_classes(d, dataset_cache.cached_classes(path))
        return
    print(
        f"data: decoding {root} once into {path.parent} (the roles read it from there)",
        file=out,
        flush=True,
    )
    began = time.monotonic()
    try:
        ds = datasets.load_dataset(
            d.dataset,
            root=root,
            image_size=d.image_size,
            limit_per_class=d.limit_per_class,
            workers=workers or usable_cores(),
        )
    except (ValueError, OSError) as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(msg if str(root) in msg else f"data.root {str(root)!r}: {msg}") from None
    print(
        f"data: {len(ds.y_train) + len(ds.y_test):,} images decoded in "
        f"{time.monotonic() - began:.1f} s",
        file=out,
        flush=True,
    )
    _check_classes(d, ds.num_classes)


def _download(d: DataConfig, out) -> None:
    root = (
        Path(d.root).expanduser()
        if d.root is not None
        else datasets.default_cache_dir() / "cifar10"
    )
    if datasets.cifar10_source(root) is not None:
        return
    print(f"data: downloading CIFAR-10 into {root}", file=out, flush=True)
    try:
        datasets.load_dataset("cifar10", root=d.root, download=True, progress=False)
    except (RuntimeError, ValueError, OSError) as exc:
        raise ConfigError(" ".join(str(exc).split())) from None


def _check_classes(d: DataConfig, classes: int | None) -> None:
    if classes is not None and classes > d.num_classes:
        raise ConfigError(
            f"data.num_classes is {d.num_classes} but data.root {d.root!r} holds "
            f"{classes} classes; set data.num_classes={classes}"
        )


def model_numel(cfg) -> int:
    """How many parameters the configured model has: from the initial-weights cache
    (``initial_weights``: no torch) or, when the model is not cached yet, from building it
    once in a child process, which fills the cache the PS then reads (the launcher itself
    never imports torch). Blocks (seconds, for that child); raises ConfigError when the
    model cannot be built (its error in the message)."""

    cached = initial_weights.read(cfg, datasets.dataset_shape(cfg.data))
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
    """Raise ConfigError when the run has more parameter servers than the model has
    parameters: each serves one range of the flat vector and needs at least one
    (``ClusterShape.check_size``; nothing is built for one server)."""
    ClusterShape.of(cfg).check_size(lambda: model_numel(cfg))


def run(cfg, local: bool = True, decode: bool = True) -> None:
    """``check``, its warnings printed on stderr, then, with ``decode`` and ``local``,
    ``prepare`` (its lines on stdout). What a launcher calls before it creates anything.
    Raises ConfigError; blocks while it decodes."""
    for line in check(cfg, local=local):
        print(f"rudra-zmq: warning: {line}", file=sys.stderr, flush=True)
    if decode and local:
        prepare(cfg)
        check_servers(cfg)  # the model's size, once the data's shape is known


__all__ = [
    "check",
    "check_data",
    "check_extras",
    "check_servers",
    "ignored_keys",
    "model_numel",
    "prepare",
    "run",
    "TENSORBOARD_MISSING",
]
