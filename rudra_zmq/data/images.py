"""Image files to uint8 arrays: find the images of an ImageFolder tree or a tarball, decode them.

- ``tree_items(root, limit)`` / ``tar_items(path, limit)``: ``{(split, class): [(name, src)]}``
  of a ``split/class/image`` layout, sorted by name, at most ``limit`` per class. A tarball is
  read as one stream and never extracted (``src`` is then the file's bytes).
- ``check_tarball(path)``: read an archive's first member headers, to fail early and in one
  line (naming the file) on a file that is no tarball of images.
- ``decode_all(items, image_size, workers, progress)``: one (N, 3, H, W) uint8 array, in order,
  resized (shorter side) and center-cropped to ``image_size`` when given; chunks of
  ``DECODE_CHUNK`` images go to a process pool from ``PARALLEL_MIN_IMAGES`` images on.

Pillow is imported only when decoding. :mod:`rudra_zmq.data.datasets` builds Datasets from these.
"""

from __future__ import annotations

import io
import multiprocessing
import re
import sys
import tarfile
import time
import zlib
from pathlib import Path, PurePosixPath

import numpy as np

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".gif", ".tif", ".tiff", ".webp")
SPLITS = ("train", "test", "val")
TARBALL_EXTS = (".tar.gz", ".tgz", ".tar")
DECODE_CHUNK = 1000  # images per task sent to a decode worker
PARALLEL_MIN_IMAGES = 2000  # below this a pool costs more than it saves
CHECK_MEMBERS = 1000  # check_tarball reads at most this many member headers
PROGRESS_EVERY_S = 20.0  # decoding says how far it got at least this often
# what a damaged, truncated or mislabelled archive raises while it is read
TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


def is_tarball(p: Path) -> bool:
    return p.is_file() and p.name.lower().endswith(TARBALL_EXTS)


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTS)


def tree_items(root: Path, limit) -> dict:
    """{(split, class): [(name, path)]} of an ImageFolder tree, sorted by file name."""
    found = {}
    for split in SPLITS:
        if not (root / split).is_dir():
            continue
        for d in sorted((root / split).iterdir()):
            if d.is_dir() and not d.name.startswith("."):
                files = sorted(f.name for f in d.iterdir() if _is_image(f.name))
                found[(split, d.name)] = [(str(d / f), str(d / f)) for f in files[:limit]]
    return found


def tar_items(path: Path, limit) -> dict:
    """{(split, class): [(member name, bytes)]} of a tarball holding split/class/image files.
    Raises ValueError naming ``path`` for an archive that cannot be read (``tar_error``)."""
    found = {}
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                split = _image_member(m)
                if split is None:
                    continue
                parts = PurePosixPath(m.name).parts
                got = found.setdefault((split, parts[-2]), [])
                got.append((m.name, tf.extractfile(m).read()))
                if limit and len(got) >= 2 * limit:  # bound memory: keep the first names only
                    got.sort(key=lambda t: t[0])
                    del got[limit:]
    except TAR_ERRORS as exc:
        raise ValueError(tar_error(path, exc)) from None
    for got in found.values():
        got.sort(key=lambda t: t[0])
        if limit:
            del got[limit:]
    return found


def check_tarball(path: Path, members: int = CHECK_MEMBERS) -> None:
    """Cheaply check that ``path`` is a tar archive of split/class/image files: read member
    headers until the first image under train/, test/ or val/ (at most ``members`` headers;
    the archive is a stream, so this reads only its beginning). Raises ValueError naming
    ``path`` when it cannot be read or ends with no image in that layout. Blocks on the read."""
    try:
        with tarfile.open(path, "r:*") as tf:
            for i, m in enumerate(tf):
                if _image_member(m) is not None or i + 1 >= members:
                    return
    except TAR_ERRORS as exc:
        raise ValueError(tar_error(path, exc)) from None
    raise ValueError(
        f"{path} holds no images in the layout train/<class>/*.jpg and "
        "test/<class>/*.jpg (or val/); repack it so (any folders above train/ "
        "are fine)"
    )


def tar_error(path: Path, exc: BaseException) -> str:
    """One line for an archive ``path`` that cannot be read."""
    why = " ".join(str(exc).split()) or type(exc).__name__
    # tarfile's "r:*" lists why each compression failed; keep the one the name promises
    method = "gz" if path.name.lower().endswith(("gz", ".tgz")) else "tar"
    said = re.search(rf"method {method}: \w+\('([^']*)'\)", why)
    why = said.group(1) if said else why
    return (
        f"{path} is not a readable tar archive ({why}); give a .tar.gz, .tgz or .tar of "
        "train/<class>/* and test/<class>/* images, or the folder of such a tree"
    )


def _image_member(m: tarfile.TarInfo) -> str | None:
    """The split of a member that is an image at split/class/name, else None."""
    parts = PurePosixPath(m.name).parts
    if m.isfile() and len(parts) >= 3 and parts[-3] in SPLITS and _is_image(parts[-1]):
        return parts[-3]
    return None


def decode_all(items: list, image_size, workers: int, progress: bool) -> np.ndarray:
    """Decode [(name, path or bytes)] to one uint8 (N, 3, H, W) array, in order. Blocks."""
    chunks = [items[i : i + DECODE_CHUNK] for i in range(0, len(items), DECODE_CHUNK)]
    tasks = [(chunk, image_size) for chunk in chunks]
    bar = _Progress(len(items), progress and len(items) >= PARALLEL_MIN_IMAGES)
    out = []
    if workers > 1 and len(items) >= PARALLEL_MIN_IMAGES:
        with multiprocessing.get_context().Pool(min(workers, len(chunks))) as pool:
            for arr in pool.imap(_decode_chunk, tasks):
                out.append(arr)
                bar.update(len(arr))
    else:
        for task in tasks:
            out.append(_decode_chunk(task))
            bar.update(len(out[-1]))
    bar.close()
    shapes = {a.shape[1:] for a in out}
    if len(shapes) > 1:
        raise ValueError(f"images differ in size ({sorted(shapes)}); pass image_size to resize")
    return np.concatenate(out) if out else np.zeros((0, 3, 1, 1), np.uint8)


def _decode_chunk(task) -> np.ndarray:
    # Runs in a worker process: top level so that it pickles under spawn as well as fork.
    from PIL import Image

    items, image_size = task
    arrays = []
    for name, src in items:
        try:
            with Image.open(io.BytesIO(src) if isinstance(src, bytes) else src) as im:
                im = im.convert("RGB")
                if image_size:
                    im = _resize_center_crop(im, image_size)
                arrays.append(np.asarray(im).transpose(2, 0, 1))
        except Exception as exc:
            raise ValueError(f"cannot decode image {name}: {exc}") from None
    if len({a.shape for a in arrays}) > 1:
        sizes = sorted({f"{a.shape[2]}x{a.shape[1]}" for a in arrays})
        raise ValueError(
            f"images differ in size ({', '.join(sizes)}), e.g. {items[0][0]}; "
            "pass image_size to resize them"
        )
    return np.stack(arrays)


def _resize_center_crop(im, size: int):
    from PIL import Image

    w, h = im.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    im = im.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return im.crop((left, top, left + size, top + size))


class _Progress:
    """tqdm on stderr if installed, else a line per 10% and at least one per PROGRESS_EVERY_S
    (a launcher takes a log that stops growing for a stuck role); silent when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.shown, self.bar = total, 0, 0, None
        self.enabled, self.last = enabled, time.monotonic()
        try:
            from tqdm import tqdm

            if enabled:
                self.bar = tqdm(total=total, desc="decoding images", unit="img", file=sys.stderr)
        except ImportError:
            pass

    def update(self, n: int):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (
            10 * self.done // self.total > self.shown
            or time.monotonic() - self.last >= PROGRESS_EVERY_S
        ):
            self.shown, self.last = 10 * self.done // self.total, time.monotonic()
            print(f"decoding images: {self.done:,}/{self.total:,}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


__all__ = [
    "IMAGE_EXTS",
    "SPLITS",
    "TARBALL_EXTS",
    "DECODE_CHUNK",
    "PARALLEL_MIN_IMAGES",
    "is_tarball",
    "tree_items",
    "tar_items",
    "check_tarball",
    "tar_error",
    "decode_all",
]
