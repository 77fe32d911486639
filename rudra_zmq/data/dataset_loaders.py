"""The per-source loaders behind ``datasets.load_dataset``: scikit-learn's digits, synthetic
images, CIFAR-10 (the pickle release, its download, or an image tree or tarball) and ImageFolder
trees decoded through the npz cache; and keeping the first n images of each class.

Each returns a :class:`rudra_zmq.data.dataset_arrays.Dataset` from arguments already checked;
:mod:`rudra_zmq.data.datasets` picks one by name. Loaders block while they read or decode.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from . import dataset_cache
from .dataset_arrays import Dataset, make_dataset
from .images import decode_all, is_tarball, tar_items, tree_items

DIGITS_TEST = 360  # of sklearn's 1,797 digits; the other 1,437 train


def load_digits(seed: int, cache: Path) -> Dataset:
    """scikit-learn's digits, split by ``seed``; from ``cache`` after the first load, because
    importing scikit-learn costs each role about a second of CPU at start-up."""
    from importlib.metadata import version

    sk = version("scikit-learn")
    path = cache / f"digits-v{dataset_cache.CACHE_VERSION}-seed{seed}-sklearn{sk}.npz"
    ds = dataset_cache.read(path, "digits")
    if ds is not None:
        return ds
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    d = sklearn_digits()
    # Pixel values are 0..16; spread them over 0..255 so every dataset shares the uint8 scale.
    x = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    y = d.target.astype(np.int64)
    idx_tr, idx_te = train_test_split(
        np.arange(len(y)), test_size=DIGITS_TEST, stratify=y, random_state=seed
    )
    ds = make_dataset(
        "digits", x[idx_tr], y[idx_tr], x[idx_te], y[idx_te], [str(c) for c in d.target_names]
    )
    dataset_cache.write(path, ds)  # atomically: a role started beside this one reads it whole
    return ds


def load_synthetic(shape, n, num_classes: int, seed: int) -> Dataset:
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
    return make_dataset(
        "synthetic", x_tr, y_tr, x_te, y_te, [f"class{i}" for i in range(num_classes)]
    )


def cifar10_source(root: Path) -> tuple[str, Path] | None:
    """Where CIFAR-10 is under ``root``: ("pickle", the cifar-10-batches-py folder) or
    ("images", the ImageFolder tree or tarball), None when neither is there. Does not block
    beyond a few stat calls."""
    for folder in (root / "cifar-10-batches-py", root):
        if (folder / "data_batch_1").is_file():
            return "pickle", folder
    if (root / "train").is_dir() or is_tarball(root):
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


def load_cifar10(root: Path, download: bool, opts: dict, root_given: bool = True) -> Dataset:
    limit = opts["limit"]
    found = cifar10_source(root)
    if found is None and download:
        found = download_cifar10(root)
    if found is None:
        raise FileNotFoundError(cifar10_missing(root, root_given))
    kind, where = found
    if kind == "images":
        return load_images("cifar10", where, None, **opts)
    return limit_dataset(load_cifar_pickle(where), limit)


def download_cifar10(root: Path) -> tuple[str, Path]:
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


def load_cifar_pickle(folder: Path) -> Dataset:
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
    return make_dataset("cifar10", *train, *arrays(["test_batch"]), classes)


def load_images(name, root: Path, image_size, limit, cache, workers, progress) -> Dataset:
    """Decode an ImageFolder tree or tarball into a Dataset, through the npz cache: one
    process of a machine decodes, others that want the same cache meanwhile wait for it."""
    path = dataset_cache.cache_file(cache, name, root, image_size, limit)
    ds = dataset_cache.read(path, name)
    if ds is not None:
        return ds
    with dataset_cache.locked(path, f"decoding {root} into {path.parent}"):
        ds = dataset_cache.read(path, name)  # written while we waited for the lock
        if ds is None:
            items = tar_items(root, limit) if is_tarball(root) else tree_items(root, limit)
            ds = decode_dataset(name, root, items, image_size, workers, progress)
            dataset_cache.write(path, ds)
    return ds


# ------------------------------------------------------------------------- image datasets
def decode_dataset(name, root, items: dict, image_size, workers, progress) -> Dataset:
    """The Dataset of the image files ``items`` ((split, class) -> [(name, source)]) found
    under ``root``; raises FileNotFoundError / ValueError for a tree without one split or
    with test classes that have no train folder. Blocks while it decodes."""
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
    x = decode_all([(n, src) for _, n, src in everything], image_size, workers, progress)
    y = np.array([lab for lab, _, _ in everything], dtype=np.int64)
    k = len(flat["train"])
    return make_dataset(name, x[:k], y[:k], x[k:], y[k:], classes)


def limit_dataset(ds: Dataset, limit) -> Dataset:
    """Keep the first ``limit`` examples of each class per split (mean/std recomputed)."""
    if not limit:
        return ds

    def keep(y):
        return np.sort(
            np.concatenate([np.flatnonzero(y == c)[:limit] for c in range(len(ds.classes))])
        )

    tr, te = keep(ds.y_train), keep(ds.y_test)
    return make_dataset(
        ds.name, ds.x_train[tr], ds.y_train[tr], ds.x_test[te], ds.y_test[te], ds.classes
    )
