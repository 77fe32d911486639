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
under 2 s to stream). Finding and decoding image files is :mod:`rudra_zmq.data.images`; this module
turns them into a Dataset (:mod:`rudra_zmq.data.dataset_arrays`).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from ..user_code import is_import_path

# The Dataset record, image files -> arrays and the user's data live in .dataset_arrays,
# .images and .user_data; these names stay importable from here.
from . import dataset_cache
from .dataset_arrays import Dataset
from .dataset_arrays import make_dataset as _make
from .images import DECODE_CHUNK, IMAGE_EXTS, PARALLEL_MIN_IMAGES, SPLITS, TARBALL_EXTS
from .images import decode_all as _decode_all
from .images import is_tarball as _is_tarball
from .images import tar_items as _tar_items
from .images import tree_items as _tree_items
from .user_data import USER_ARRAYS, from_user, user_data_info
from .user_data import load_user as _load_user

DATASET_NAMES = ("digits", "cifar10", "imagefolder", "synthetic")
CACHE_ENV = "RUDRA_ZMQ_CACHE"
CACHE_VERSION = dataset_cache.CACHE_VERSION
DEFAULT_IMAGE_SIZE = 224
DEFAULT_SYNTHETIC_SHAPE = (3, 32, 32)
DIGITS_TEST = 360  # of sklearn's 1,797 digits; the other 1,437 train


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
        return _limit_dataset(_load_user(name, root), limit_per_class)
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
        return _limit_dataset(_load_digits(seed, cache), limit_per_class)
    if name == "synthetic":
        shape = DEFAULT_SYNTHETIC_SHAPE if synthetic_shape is None else tuple(synthetic_shape)
        _check_ints("synthetic_shape", shape, "three positive ints (C, H, W)", 3)
        _check_ints("synthetic_n", tuple(synthetic_n), "two positive ints (train, test)", 2)
        ds = _load_synthetic(shape, tuple(synthetic_n), num_classes, seed)
        return _limit_dataset(ds, limit_per_class)
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
        return _load_images(name, root, image_size or DEFAULT_IMAGE_SIZE, **opts)
    if image_size not in (None, 32):
        raise ValueError(
            f"cifar10 images are 32x32, got image_size={image_size}; use the "
            "imagefolder dataset to resize a tree of images"
        )
    given = root is not None
    root = Path(root).expanduser() if given else cache / "cifar10"
    return _load_cifar10(root, download, opts, given)


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
    ds = load_dataset(
        data.dataset,
        root=data.root,
        image_size=data.image_size,
        synthetic_shape=tuple(data.synthetic_shape),
        synthetic_n=(data.synthetic_train, data.synthetic_test),
        num_classes=data.num_classes,
        download=data.download,
        limit_per_class=limit,
        progress=False,
    )
    return len(ds.y_train)


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


# ---------------------------------------------------------------------------------- sources
def _load_digits(seed: int, cache: Path) -> Dataset:
    """scikit-learn's digits, split by ``seed``; from ``cache`` after the first load, because
    importing scikit-learn costs each role about a second of CPU at start-up."""
    from importlib.metadata import version

    path = cache / f"digits-v{CACHE_VERSION}-seed{seed}-sklearn{version('scikit-learn')}.npz"
    ds = dataset_cache.read(path, "digits")
    if ds is not None:
        return ds
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    # Pixel values are 0..16; spread them over 0..255 so every dataset shares the uint8 scale.
    x = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    y = d.target.astype(np.int64)
    idx_tr, idx_te = train_test_split(
        np.arange(len(y)), test_size=DIGITS_TEST, stratify=y, random_state=seed
    )
    ds = _make(
        "digits", x[idx_tr], y[idx_tr], x[idx_te], y[idx_te], [str(c) for c in d.target_names]
    )
    dataset_cache.write(path, ds)  # atomically: a role started beside this one reads it whole
    return ds


def _load_synthetic(shape, n, num_classes: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 255, size=(num_classes, *shape))

    def draw(count):
        # Balanced labels; each image is its class template plus noise, so a model can learn
        # the labels and a smoke test can watch the loss fall.
        y = rng.permutation(np.arange(count) % num_classes).astype(np.int64)
        x = templates[y] + rng.normal(0.0, 64.0, size=(count, *shape))
        return np.clip(np.rint(x), 0, 255).astype(np.uint8), y

    x_tr, y_tr = draw(n[0])
    x_te, y_te = draw(n[1])
    return _make("synthetic", x_tr, y_tr, x_te, y_te, [f"class{i}" for i in range(num_classes)])


def cifar10_source(root: Path) -> tuple[str, Path] | None:
    """Where CIFAR-10 is under ``root``: ("pickle", the cifar-10-batches-py folder) or
    ("images", the ImageFolder tree or tarball), None when neither is there. Does not block
    beyond a few stat calls."""
    for folder in (root / "cifar-10-batches-py", root):
        if (folder / "data_batch_1").is_file():
            return "pickle", folder
    if (root / "train").is_dir() or _is_tarball(root):
        return "images", root
    return None


def cifar10_missing(root: Path, root_given: bool = True) -> str:
    """The one-line error for no CIFAR-10 at ``root``: what was looked for and what to do."""
    where = (
        f"data.root {str(root)!r}"
        if root_given
        else f"{root} (data.root is not set: the cache dir)"
    )
    gone = "" if root.exists() else ", which does not exist"
    return (
        f"cifar10: no CIFAR-10 data at {where}{gone}. Set data.download: true to fetch the "
        "python release into it (needs internet), or point data.root at the "
        "cifar-10-batches-py folder (or the folder holding it), an ImageFolder tree with "
        "train/<class>/*.jpg and test/<class>/*.jpg, or a .tar.gz of such a tree"
    )


def _load_cifar10(root: Path, download: bool, opts: dict, root_given: bool = True) -> Dataset:
    limit = opts["limit"]
    found = cifar10_source(root)
    if found is None and download:
        found = _download_cifar10(root)
    if found is None:
        raise FileNotFoundError(cifar10_missing(root, root_given))
    kind, where = found
    if kind == "images":
        return _load_images("cifar10", where, None, **opts)
    return _limit_dataset(_load_cifar_pickle(where), limit)


def _download_cifar10(root: Path) -> tuple[str, Path]:
    """torchvision's download of the pickle release into ``root``, one process at a time (a
    second one waits, then finds the files)."""
    folder = root / "cifar-10-batches-py"
    with dataset_cache.locked(folder, f"downloading CIFAR-10 into {root}"):
        if not (folder / "data_batch_1").is_file():
            try:
                import torchvision

                for train in (True, False):
                    torchvision.datasets.CIFAR10(str(root), train=train, download=True)
            except Exception as exc:
                raise RuntimeError(
                    f"downloading CIFAR-10 into {root} failed: {exc}. Offline, point data.root "
                    "at a cifar-10-batches-py folder, an ImageFolder tree or a .tar.gz of one "
                    "instead"
                ) from exc
    return "pickle", folder


def _load_cifar_pickle(folder: Path) -> Dataset:
    # The pickle release is a local file the user chose to trust, not data off the network.
    def read(fname):
        with open(folder / fname, "rb") as f:
            return pickle.load(f, encoding="bytes")

    def arrays(fnames):
        batches = [read(f) for f in fnames]
        x = np.concatenate([b[b"data"] for b in batches]).astype(np.uint8, copy=False)
        y = np.concatenate([np.asarray(b[b"labels"]) for b in batches]).astype(np.int64)
        return x.reshape(-1, 3, 32, 32), y

    classes = [c.decode() for c in read("batches.meta")[b"label_names"]]
    train = arrays([f"data_batch_{i}" for i in range(1, 6)])
    return _make("cifar10", *train, *arrays(["test_batch"]), classes)


def _load_images(name, root: Path, image_size, limit, cache, workers, progress) -> Dataset:
    """Decode an ImageFolder tree or tarball into a Dataset, through the npz cache: one
    process of a machine decodes, others that want the same cache meanwhile wait for it."""
    path = dataset_cache.cache_file(cache, name, root, image_size, limit)
    ds = dataset_cache.read(path, name)
    if ds is not None:
        return ds
    with dataset_cache.locked(path, f"decoding {root} into {path.parent}"):
        ds = dataset_cache.read(path, name)  # written while we waited for the lock
        if ds is None:
            items = _tar_items(root, limit) if _is_tarball(root) else _tree_items(root, limit)
            ds = _decode_dataset(name, root, items, image_size, workers, progress)
            dataset_cache.write(path, ds)
    return ds


# ------------------------------------------------------------------------- image datasets
def _decode_dataset(name, root, items: dict, image_size, workers, progress) -> Dataset:
    classes = sorted(c for s, c in items if s == "train")
    test_split = "test" if any(s == "test" for s, _ in items) else "val"
    for split in ("train", test_split):
        if not any(lst for (s, _), lst in items.items() if s == split):
            raise FileNotFoundError(
                f"{name}: {root} has no images under {split}/<class>/; it "
                "needs train/<class>/* and test/<class>/* (or val/)"
            )
    extra = sorted(c for s, c in items if s == test_split and c not in classes)
    if extra:
        raise ValueError(f"{name}: {root} has {test_split} classes with no train folder: {extra}")
    label = {c: i for i, c in enumerate(classes)}
    flat = {
        split: [
            (label[c], n, src)
            for (s, c), lst in sorted(items.items())
            if s == split
            for n, src in lst
        ]
        for split in ("train", test_split)
    }
    everything = flat["train"] + flat[test_split]
    x = _decode_all([(n, src) for _, n, src in everything], image_size, workers, progress)
    y = np.array([lab for lab, _, _ in everything], dtype=np.int64)
    k = len(flat["train"])
    return _make(name, x[:k], y[:k], x[k:], y[k:], classes)


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


def _limit_dataset(ds: Dataset, limit) -> Dataset:
    """Keep the first ``limit`` examples of each class per split (mean/std recomputed)."""
    if not limit:
        return ds

    def keep(y):
        return np.sort(
            np.concatenate([np.flatnonzero(y == c)[:limit] for c in range(len(ds.classes))])
        )

    tr, te = keep(ds.y_train), keep(ds.y_test)
    return _make(ds.name, ds.x_train[tr], ds.y_train[tr], ds.x_test[te], ds.y_test[te], ds.classes)


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
