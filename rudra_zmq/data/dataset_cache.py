"""The decoded-image cache: one uncompressed ``.npz`` per image source (ImageFolder tree or
tarball), image size and ``limit_per_class``, under the cache dir.

- ``cache_file(cache, name, root, image_size, limit)``: where the arrays of ``root`` go. The
  name holds a digest of the source's path, size and modification times, so an edited tree or
  a replaced tarball decodes again.
- ``read(path)``: the cached Dataset, or None (absent, or unreadable: then it is decoded again).
- ``write(path, ds)``: atomically, a temporary file in the same folder renamed over ``path``,
  so a reader never sees half a cache and a crash mid-write leaves none.
- ``locked(path)``: an exclusive ``fcntl.flock`` on ``path + ".lock"`` while the block runs, so
  of the processes of one machine that find no cache (a data server and a statistics server
  started side by side, a role started by hand while the launcher decodes) one decodes and the
  others wait for it and read its cache. The kernel drops the lock of a process that dies, so
  a crash never leaves a stale lock. Waiting says so on stderr, then every ``WAIT_NOTE_S``.

Nothing here decodes images (:mod:`rudra_zmq.data.images`) or knows the datasets
(:mod:`rudra_zmq.data.datasets`). Functions block on the file system only; ``locked`` blocks until
the lock is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from .dataset_arrays import Dataset
from .images import SPLITS, is_tarball

CACHE_VERSION = 1
LOCK_POLL_S = 0.2  # how often a waiting process tries the lock again
WAIT_NOTE_S = 30.0  # how often it says it is still waiting


def cache_file(cache: Path, name: str, root: Path, image_size, limit) -> Path:
    """The cache file of dataset ``name`` decoded from the tree or tarball ``root`` (which
    must exist). Reads the modification times of the tree's class folders; creates nothing."""
    stat = root.stat()
    key = [str(root.resolve()), stat.st_size, stat.st_mtime_ns]
    if not is_tarball(root):  # folder mtimes change when files are added or removed
        key += [
            (str(d), d.stat().st_mtime_ns)
            for s in SPLITS
            if (root / s).is_dir()
            for d in sorted((root / s).iterdir())
            if d.is_dir()
        ]
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:12]
    stem = root.name.split(".")[0] or "data"
    return (
        cache
        / f"{stem}-{digest}"
        / f"{name}-v{CACHE_VERSION}-{image_size or 'native'}-{limit or 'all'}.npz"
    )


def read(path: Path, name: str) -> Dataset | None:
    """The Dataset ``name`` cached in ``path``; None when there is none or it cannot be read
    (said on stderr: the caller decodes again and replaces it)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return Dataset(
                name,
                z["x_train"],
                z["y_train"],
                z["x_test"],
                z["y_test"],
                [str(c) for c in z["classes"]],
                tuple(z["mean"].tolist()),
                tuple(z["std"].tolist()),
            )
    except (OSError, ValueError, KeyError) as exc:
        print(f"rudra_zmq: ignoring unreadable cache {path} ({exc})", file=sys.stderr)
        return None


def cached_classes(path: Path) -> int | None:
    """How many classes the cache ``path`` holds (reads only that entry), or None."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return len(z["classes"])
    except (OSError, ValueError, KeyError):
        return None


def save_npz(path: Path, **arrays) -> None:
    """Write ``arrays`` to the .npz ``path`` atomically (temporary file, fsync, rename; its
    folder made): a reader sees the old file or the whole new one, never a torn one. Raises
    OSError (nothing left behind) when it cannot be written."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a path
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())  # the rename must not reach the disk before the data
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()  # after an error or an interrupt; gone already after the rename


def write(path: Path, ds: Dataset) -> bool:
    """Write ``ds`` to ``path`` atomically (:func:`save_npz`). Returns False, saying why on
    stderr, when the cache cannot be written (a read-only or full disk): the data are in
    memory anyway, only the next load decodes again."""
    try:
        save_npz(
            path,
            x_train=ds.x_train,
            y_train=ds.y_train,
            x_test=ds.x_test,
            y_test=ds.y_test,
            classes=np.array(ds.classes),
            mean=np.array(ds.mean),
            std=np.array(ds.std),
        )
        return True
    except OSError as exc:
        print(
            f"rudra_zmq: warning: cannot write the dataset cache {path} ({exc}); the next "
            "load decodes again (set $RUDRA_ZMQ_CACHE to a writable folder)",
            file=sys.stderr,
        )
        return False


@contextlib.contextmanager
def locked(path: Path, what: str | None = None):
    """Hold an exclusive lock on ``path``'s ``.lock`` file (created with its folder) while
    the block runs. Blocks while another process holds it, saying so on stderr first and then
    every WAIT_NOTE_S (``what`` it is doing: default "decoding into <folder>"). Without a
    writable cache folder it runs the block unlocked."""
    lock = path.with_name(path.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # write() will say that the cache cannot be written
        return
    try:
        began, noted = time.monotonic(), None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if noted is None or now - noted >= WAIT_NOTE_S:
                    doing = what or f"decoding into {path.parent}"
                    print(
                        f"rudra_zmq: another process is {doing}; waiting for it "
                        f"({now - began:.0f} s so far)",
                        file=sys.stderr,
                        flush=True,
                    )
                    noted = now
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = [
    "CACHE_VERSION",
    "cache_file",
    "cached_classes",
    "locked",
    "read",
    "save_npz",
    "write",
]
