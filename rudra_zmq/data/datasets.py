"""Training data as uint8 arrays in memory: digits, CIFAR-10, ImageFolder trees, synthetic,
and the user's own (``package.module:function``).

``load_dataset(name, ...)`` returns a ``Dataset``: images (N, C, H, W) uint8, labels int64,
class names and the per-channel mean/std of the training images (0..1 scale). Learners keep the
uint8 arrays and normalize each minibatch with ``to_float`` (4x less memory than float32).

Where the images come from:
  digits      sklearn's bundled 8x8 digits (offline), split 1437/360 stratified by ``seed``.
  cifar10     ``root`` is, in order of preference: a folder holding ``cifar-10-batches-py``
              (or that folder itself), an ImageFolder tree ``train/<class>/*`` + ``test/<class>/*``,
              or a ``.tar.gz`` of such a tree; else ``download=True`` fetches the pickle release
              with torchvision. ``root=None`` means ``<cache dir>/cifar10``.
  imagefolder ``root`` is such a tree (``val/`` may stand in for ``test/``) or a tarball of one;
              images are resized (shorter side) and center-cropped to ``image_size`` (224).
  synthetic   random images whose class sets their mean pattern (learnable), from ``seed``.
  pkg.mod:fn  the user's function (``user_code.resolve``), called as ``fn()``, or ``fn(root)``
              when ``root`` is given. It returns the arrays (x_train, y_train, x_test, y_test)
              as a tuple, or a mapping with those keys and optionally ``classes``; or a pair
              (train, test) of map-style datasets of (image, label), torchvision's included;
              or a ``Dataset``. See :mod:`rudra_zmq.data.user_data`.

Image files are decoded once; the arrays are cached as one uncompressed ``.npz`` under the cache
dir (``$RUDRA_ZMQ_CACHE``, default ``~/.cache/rudra_zmq``), so later loads take a fraction of a
second; a file lock lets one process of a machine decode while others wait for its cache
(:mod:`rudra_zmq.data.dataset_cache`; ``rudra-zmq run`` decodes before it starts the roles,
:mod:`rudra_zmq.launch.preflight`). A tarball is read as a stream and never extracted: writing
60,000 small files costs more than decoding them (CIFAR-10: about 9 s to extract against
under 2 s to stream). Finding and decoding image files is :mod:`rudra_zmq.data.images`, each
source's loader :mod:`rudra_zmq.data.dataset_loaders`; this module picks the loader by name and
checks its arguments.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..user_code import is_import_path

# The Dataset record, the loaders, image files -> arrays and the user's data live in
# .dataset_arrays, .dataset_loaders, .images and .user_data; these names stay importable here.
from . import dataset_cache
from . import dataset_loaders as loaders
from .dataset_arrays import Dataset
from .dataset_loaders import DIGITS_TEST, cifar10_missing, cifar10_source, limit_dataset
from .images import DECODE_CHUNK, IMAGE_EXTS, PARALLEL_MIN_IMAGES, SPLITS, TARBALL_EXTS
from .images import is_tarball as _is_tarball
from .user_data import USER_ARRAYS, from_user, user_data_info
from .user_data import load_user as _load_user

DATASET_NAMES = ("digits", "cifar10", "imagefolder", "synthetic")
CACHE_ENV = "RUDRA_ZMQ_CACHE"
CACHE_VERSION = dataset_cache.CACHE_VERSION
DEFAULT_IMAGE_SIZE = 224
DEFAULT_SYNTHETIC_SHAPE = (3, 32, 32)


def default_cache_dir() -> Path:
    """``$RUDRA_ZMQ_CACHE`` if set, else ``~/.cache/rudra_zmq``. Does not create it."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rudra_zmq"


def load_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    image_size: int | None = None,
    synthetic_shape: tuple[int, int, int] | None = None,
    synthetic_n: tuple[int, int] = (1024, 256),
    num_classes: int = 10,
    seed: int = 0,
    download: bool = False,
    limit_per_class: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    workers: int = 2,
    progress: bool = True,
) -> Dataset:
    """Load dataset ``name`` (see the module docstring for names and sources). Blocks.

    ``seed`` fixes the digits split and the synthetic images; ``num_classes``,
    ``synthetic_shape`` (default 3x32x32) and ``synthetic_n`` (train, test) apply to synthetic
    only. ``limit_per_class`` keeps the first n images of each class per split (by file name
    for image files), decoding only those. ``workers`` processes decode image files; progress
    goes to stderr. ``name`` may also be an import path ``package.module:function`` (the
    module docstring). Raises ValueError for bad arguments (UserCodeError for user code),
    FileNotFoundError when no data is found.
    """
    if is_import_path(name):
        return limit_dataset(_load_user(name, root), limit_per_class)
    if name not in DATASET_NAMES:
        raise ValueError(
            f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}, "
            "or an import path package.module:function"
        )
    _check_int("image_size", image_size, optional=True)
    _check_int("limit_per_class", limit_per_class, optional=True)
    _check_int("num_classes", num_classes)
    _check_int("workers", workers)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    opts = dict(limit=limit_per_class, cache=cache, workers=workers, progress=progress)
    if name == "digits":
        return limit_dataset(loaders.load_digits(seed, cache), limit_per_class)
    if name == "synthetic":
        shape = DEFAULT_SYNTHETIC_SHAPE if synthetic_shape is None else tuple(synthetic_shape)
        _check_ints("synthetic_shape", shape, "three positive ints (C, H, W)", 3)
        _check_ints("synthetic_n", tuple(synthetic_n), "two positive ints (train, test)", 2)
        ds = loaders.load_synthetic(shape, tuple(synthetic_n), num_classes, seed)
        return limit_dataset(ds, limit_per_class)
    if name == "imagefolder":
        if root is None:
            raise ValueError(
                "imagefolder needs root: a folder with train/<class>/* and "
                "val/<class>/* (or test/), or a .tar.gz of one"
            )
        root = Path(root).expanduser()
        if not (_is_tarball(root) or (root / "train").is_dir()):
            raise FileNotFoundError(
                f"imagefolder: {root} is neither a folder with train/ "
                "inside nor a tarball (.tar.gz, .tgz, .tar) of one"
            )
        return loaders.load_images(name, root, image_size or DEFAULT_IMAGE_SIZE, **opts)
    if image_size not in (None, 32):
        raise ValueError(
            f"cifar10 images are 32x32, got image_size={image_size}; use the "
            "imagefolder dataset to resize a tree of images"
        )
    given = root is not None
    root = Path(root).expanduser() if given else cache / "cifar10"
    return loaders.load_cifar10(root, download, opts, given)


def dataset_shape(data) -> tuple[int, int, int]:
    """(C, H, W) of the images a DataConfig ``data`` describes (fields dataset, image_size,
    synthetic_shape), without loading them. Does not block, except for user data
    (``package.module:function``): its function runs once per process (``user_data_info``)."""
    if is_import_path(data.dataset):
        return user_data_info(data.dataset, data.root)[0]
    if data.dataset == "synthetic":
        return tuple(int(d) for d in data.synthetic_shape)
    if data.dataset == "imagefolder":
        return (3, data.image_size or DEFAULT_IMAGE_SIZE, data.image_size or DEFAULT_IMAGE_SIZE)
    shapes = {"digits": (1, 8, 8), "cifar10": (3, 32, 32)}
    if data.dataset not in shapes:
        raise ValueError(
            f"unknown dataset {data.dataset!r}; valid names: "
            f"{', '.join(DATASET_NAMES)}, or an import path package.module:function"
        )
    return shapes[data.dataset]


def dataset_size(data) -> int:
    """Training examples (the epoch size) of the dataset a DataConfig ``data`` describes.

    digits and synthetic (without data.limit_per_class) are known up front; cifar10 and
    imagefolder are loaded (from the npz cache after the first time), so this may block as
    long as ``load_dataset``.
    """
    limit = data.limit_per_class
    if is_import_path(data.dataset) and not limit:
        return user_data_info(data.dataset, data.root)[1]
    if data.dataset == "digits" and not limit:
        return 1797 - DIGITS_TEST
    if data.dataset == "synthetic" and not limit:
        return int(data.synthetic_train)
    dataset_shape(data)  # rejects unknown names
    return len(load_configured(data, progress=False).y_train)


def load_configured(data, progress: bool = True) -> Dataset:
    """``load_dataset`` of what the DataConfig ``data`` describes (the one place its fields
    become the loader's arguments). Blocks while loading."""
    return load_dataset(
        data.dataset,
        root=data.root,
        image_size=data.image_size,
        synthetic_shape=tuple(data.synthetic_shape),
        synthetic_n=(data.synthetic_train, data.synthetic_test),
        num_classes=data.num_classes,
        download=data.download,
        limit_per_class=data.limit_per_class,
        progress=progress,
    )


def image_cache(data, cache_dir=None) -> tuple[Path, Path] | None:
    """(image source, cache file) of the DataConfig ``data`` when its images are files to
    decode (a cifar10 or imagefolder tree or tarball at data.root): the cache file
    ``load_dataset`` reads them from, present or not. None for other data (digits, synthetic,
    CIFAR-10's pickle release, user data) or none found. Blocks only on a few stat calls."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    limit = data.limit_per_class
    if data.dataset == "imagefolder" and data.root is not None:
        root = Path(data.root).expanduser()
        if _is_tarball(root) or (root / "train").is_dir():
            size = data.image_size or DEFAULT_IMAGE_SIZE
            return root, dataset_cache.cache_file(cache, "imagefolder", root, size, limit)
    if data.dataset == "cifar10":
        root = Path(data.root).expanduser() if data.root is not None else cache / "cifar10"
        found = cifar10_source(root)
        if found is not None and found[0] == "images":
            return root, dataset_cache.cache_file(cache, "cifar10", root, None, limit)
    return None


def to_float(x, mean, std):
    """(x / 255 - mean) / std per channel, as a new float32 torch tensor. Blocks.

    ``x``: uint8 ndarray or tensor, (..., C, H, W); ``mean``/``std``: C floats each.
    """
    import torch

    is_array = isinstance(x, np.ndarray)
    if not (is_array or isinstance(x, torch.Tensor)) or x.dtype != (
        np.uint8 if is_array else torch.uint8
    ):
        raise TypeError(
            f"to_float takes a uint8 ndarray or tensor, got "
            f"{type(x).__name__} of {getattr(x, 'dtype', None)}"
        )
    # One float32 allocation, then in-place arithmetic.
    t = torch.from_numpy(x.astype(np.float32)) if is_array else x.to(torch.float32)
    if t.ndim < 3 or not len(mean) == len(std) == t.shape[-3]:
        raise ValueError(
            f"to_float: images of shape {tuple(t.shape)} need (..., C, H, W) with C "
            f"equal to len(mean)={len(mean)} and len(std)={len(std)}"
        )
    s = torch.tensor(std, dtype=torch.float64)
    if not bool((s > 0).all()):
        raise ValueError(f"to_float: std must be positive, got {tuple(std)}")
    m = torch.tensor(mean, dtype=torch.float64)
    scale = (1.0 / (255.0 * s)).to(torch.float32).view(-1, 1, 1)
    shift = (m / s).to(torch.float32).view(-1, 1, 1)
    return t.mul_(scale).sub_(shift)


# ------------------------------------------------------------------------------- helpers
def _check_int(what: str, value, optional: bool = False):
    if not (optional and value is None) and not _positive_int(value):
        raise ValueError(
            f"{what} must be a positive int{' or None' if optional else ''}, got {value!r}"
        )


def _check_ints(what: str, values: tuple, expected: str, n: int):
    if len(values) != n or not all(map(_positive_int, values)):
        raise ValueError(f"{what} must be {expected}, got {values!r}")


def _positive_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0


__all__ = [
    "Dataset",
    "DATASET_NAMES",
    "load_dataset",
    "to_float",
    "default_cache_dir",
    "dataset_shape",
    "dataset_size",
    "image_cache",
    "cifar10_source",
    "cifar10_missing",
    # re-exported from .user_data and .images
    "user_data_info",
    "from_user",
    "USER_ARRAYS",
    "DECODE_CHUNK",
    "IMAGE_EXTS",
    "PARALLEL_MIN_IMAGES",
    "SPLITS",
    "TARBALL_EXTS",
]
