"""Datasets the user gives as an import path: ``data.dataset: package.module:function``.

The function is found and called through :mod:`rudra_zmq.user_code`, as ``fn()``, or
``fn(root)`` when ``data.root`` is set. ``from_user`` accepts what it returns in these forms:

- a tuple (x_train, y_train, x_test, y_test): uint8 images (N, C, H, W), integer labels;
- a mapping with those four keys, and optionally ``classes``;
- a pair (train, test) of map-style datasets of (image, label), torchvision's included: read
  item by item, PIL images and arrays as (H, W) or (H, W, C), tensors as (C, H, W), floats as
  0..1 (``transforms.ToTensor``);
- a :class:`~rudra_zmq.data.dataset_arrays.Dataset`, taken as it is.

Anything else is a UserCodeError that says what was wrong. Pure apart from calling the user's
function (and reading a map-style dataset's items, which runs the user's transforms).
``user_data_info`` remembers each dataset's shape, size and classes for the life of the
process, so a role that needs only those runs the function once. All of it may be called from
several threads: the memo is one dict whose entries are written whole, so at worst two first
calls at once both run the user's function. :mod:`rudra_zmq.data.datasets` calls this module for
every import path it is given.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..user_code import UserCodeError
from ..user_code import call as _call_user
from .dataset_arrays import Dataset, make_dataset

USER_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
_USER_INFO: dict = {}  # (path, root) -> (image shape, training examples, classes), per process


def user_data_info(path: str, root=None) -> tuple[tuple[int, int, int], int, int]:
    """(C, H, W), training-set size and number of classes of the user data ``path``
    (``package.module:function``).
    The function runs on the first call in this process; its arrays are not kept (a learner
    needs only the shape). Blocks on that call. Raises UserCodeError."""
    key = (path, None if root is None else str(root))
    if key not in _USER_INFO:
        load_user(path, root)
    return _USER_INFO[key]


def load_user(path: str, root) -> Dataset:
    """The Dataset the user's function ``path`` returns (called with ``root`` unless it is
    None), its shape, size and classes remembered for ``user_data_info``. Blocks while the
    function runs. Raises UserCodeError."""
    ds = from_user(_call_user(path, "data.dataset", *(() if root is None else (str(root),))), path)
    _USER_INFO[(path, None if root is None else str(root))] = (
        ds.shape,
        len(ds.y_train),
        ds.num_classes,
    )
    return ds


def from_user(out, name: str) -> Dataset:
    """The Dataset of what the user's data function ``name`` returned: (x_train, y_train,
    x_test, y_test), a mapping with those keys (and optionally ``classes``), a (train, test)
    pair of map-style datasets of (image, label), or a Dataset. Images are uint8 (N, C, H, W);
    labels any integer type. A map-style dataset is read item by item (blocks): PIL images and
    arrays are (H, W) or (H, W, C), tensors (C, H, W); floating-point values count as 0..1
    (``transforms.ToTensor``). Raises UserCodeError saying what was wrong."""
    if isinstance(out, Dataset):
        return out
    classes = None
    if isinstance(out, Mapping):
        missing = [k for k in USER_ARRAYS if k not in out]
        if missing:
            raise UserCodeError(
                f"data.dataset {name!r} returned a mapping without {', '.join(missing)}"
            )
        arrays, classes = [out[k] for k in USER_ARRAYS], out.get("classes")
    elif isinstance(out, (tuple, list)) and len(out) == 4:
        arrays = list(out)
    elif isinstance(out, (tuple, list)) and len(out) == 2 and all(map(_map_style, out)):
        arrays = [*_read_map_style(out[0], name, "train"), *_read_map_style(out[1], name, "test")]
        classes = getattr(out[0], "classes", None)
    else:
        what = type(out).__name__ + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise UserCodeError(
            f"data.dataset {name!r} returned a {what}; it must return (x_train, y_train, x_test, "
            "y_test) (uint8 images N x C x H x W, integer labels), a mapping with those keys, a "
            "(train, test) pair of map-style datasets of (image, label), or a "
            "rudra_zmq.data.datasets.Dataset"
        )
    x_tr, y_tr, x_te, y_te = (np.asarray(a) for a in arrays)
    for split, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        if x.dtype != np.uint8 or x.ndim != 4 or len(x) == 0:
            hint = (
                "; give grayscale images a channel axis: x[:, None]"
                if x.ndim == 3
                else "; convert 0..1 floats with np.rint(x * 255).astype(np.uint8)"
                if x.dtype.kind == "f"
                else ""
            )
            raise UserCodeError(
                f"data.dataset {name!r}: x_{split} is {x.dtype} {x.shape}; it "
                f"must be uint8 (N, C, H, W) with N >= 1{hint}"
            )
        if y.dtype.kind not in "iu" or y.shape != x.shape[:1]:
            raise UserCodeError(
                f"data.dataset {name!r}: y_{split} is {y.dtype} {y.shape}; it "
                f"must hold one integer label per image, ({len(x)},)"
            )
        if y.min() < 0:
            raise UserCodeError(
                f"data.dataset {name!r}: y_{split} holds the label {y.min()}; labels run from 0"
            )
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise UserCodeError(
            f"data.dataset {name!r}: train images are {x_tr.shape[1:]} but test "
            f"images {x_te.shape[1:]}; both splits need one shape"
        )
    labels = max(int(y_tr.max()), int(y_te.max())) + 1
    classes = [str(c) for c in classes] if classes is not None else list(map(str, range(labels)))
    if len(classes) < labels:
        raise UserCodeError(
            f"data.dataset {name!r}: {len(classes)} classes named but labels run to {labels - 1}"
        )
    return make_dataset(name, x_tr, y_tr.astype(np.int64), x_te, y_te.astype(np.int64), classes)


def _map_style(d) -> bool:
    return hasattr(d, "__getitem__") and hasattr(d, "__len__") and not isinstance(d, (str, bytes))


def _read_map_style(ds, name: str, split: str):
    """(images, labels) of a map-style dataset of (image, label) items."""
    n = len(ds)
    if n == 0:
        raise UserCodeError(f"data.dataset {name!r}: the {split} dataset is empty")
    x = y = None
    for i in range(n):
        item = ds[i]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UserCodeError(
                f"data.dataset {name!r}: {split} item {i} is a "
                f"{type(item).__name__}, not an (image, label) pair"
            )
        img = _image_chw(item[0], name, f"{split} item {i}")
        if x is None:
            x, y = np.empty((n, *img.shape), np.uint8), np.empty(n, np.int64)
        elif img.shape != x.shape[1:]:
            raise UserCodeError(
                f"data.dataset {name!r}: {split} item {i} is {img.shape} but "
                f"item 0 is {x.shape[1:]}; give every image one size (a "
                "Resize/CenterCrop transform)"
            )
        x[i], y[i] = img, int(item[1])
    return x, y


def _image_chw(img, name: str, where: str) -> np.ndarray:
    """One image as uint8 (C, H, W): a tensor is (C, H, W), anything else (H, W[, C])."""
    tensor = hasattr(img, "detach")
    a = np.asarray(img.detach().cpu() if tensor else img)
    if a.dtype.kind == "f":
        a = np.clip(np.rint(a * 255.0), 0, 255)
    elif a.dtype.kind not in "iub" or (a.size and not 0 <= a.min() <= a.max() <= 255):
        raise UserCodeError(
            f"data.dataset {name!r}: {where} is {a.dtype} with values outside "
            "0..255; images must be 8-bit (or floats in 0..1)"
        )
    if a.ndim == 2:
        a = a[None]
    elif a.ndim == 3 and not tensor:
        a = a.transpose(2, 0, 1)
    elif a.ndim != 3:
        raise UserCodeError(
            f"data.dataset {name!r}: {where} has shape {a.shape}; an image is "
            "(H, W), (H, W, C) or a (C, H, W) tensor"
        )
    return a.astype(np.uint8)


__all__ = ["USER_ARRAYS", "user_data_info", "load_user", "from_user"]
