"""Atomic, verified checkpoints on disk: a crash leaves the previous checkpoint usable.

Layout of one checkpoint, a directory named by a number that only grows (names sort by age)::

    DIR/ckpt-00000007/
        NAME.npy        one per array, written by np.save(allow_pickle=False)
        manifest.json   {"format": 1,
                         "arrays": {NAME: {"file": "NAME.npy", "dtype": "float32",
                                           "shape": [..], "bytes": N, "sha256": hex}},
                         "meta": {...}}

``save`` writes into a hidden ``DIR/.tmp-<random>``, fsyncs it all, then renames it: a
checkpoint exists whole or not at all. ``load_latest`` checks each file's size and sha256
before np.load reads it, and falls back (with a warning) to the previous checkpoint when the
newest is damaged (a notice: the launcher shows it on the terminal). No pickle anywhere: object arrays are refused on save and on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..notices import notice

log = logging.getLogger("rudra_zmq.checkpoint")

FORMAT = 1
MANIFEST = "manifest.json"
_NAME = re.compile(r"[A-Za-z0-9_]+")
_CKPT = re.compile(r"ckpt-(\d{8,})")
_TMP_PREFIX = ".tmp-"
_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex: nothing that needs pickle


class CheckpointError(RuntimeError):
    """Checkpoints exist but none of them verifies."""


@dataclass
class Checkpoint:
    """One verified checkpoint: its directory, its arrays (ordinary writable ndarrays) and the
    JSON metadata given to ``save``."""

    path: Path
    arrays: dict[str, np.ndarray]
    meta: dict


class _Invalid(Exception):
    """A checkpoint failed verification; the message names the file and the problem."""


class _HashingWriter:
    """Hashes every chunk np.save writes on its way to disk: no second pass for the sha256."""

    def __init__(self, f):
        self._f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self.sha256.update(data)
        self.bytes += n
        return n


def list_checkpoints(directory) -> list[Path]:
    """The checkpoint directories in ``directory`` (named ``ckpt-NNNNNNNN``), newest first; []
    if there is no such directory. Does not verify them. Blocks (lists the directory)."""
    return [p for _, p in _numbered(Path(directory)) if p.is_dir()]


def save(directory, arrays: dict[str, np.ndarray], meta: dict, *, keep: int = 2) -> Path:
    """Write ``arrays`` and ``meta`` as a new checkpoint in ``directory`` (created if missing),
    atomically and durably; then delete all but the newest ``keep`` checkpoints and any
    ``.tmp-*`` leftovers of an earlier crashed save. Returns the new checkpoint's path.

    Raises ValueError for a bad array name or ``keep``, TypeError for a non-numeric array or
    meta that is not JSON-serialisable; nothing is written then.
    Blocks (disk I/O and fsync). Not thread-safe: one writer per directory.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint (the one being saved)")
    for name, arr in arrays.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"array name {name!r}: use only letters, digits and '_' "
                f"(it becomes the file name NAME.npy)"
            )
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in _NUMERIC_KINDS:
            what = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise TypeError(
                f"array {name!r} is {what}: only numeric ndarrays are saved "
                f"(bool/int/float/complex; no objects, which would need pickle)"
            )
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"checkpoint meta is not JSON-serialisable ({e}): give only dicts, "
            f"lists, str, numbers, bools and None (numpy scalars: .item())"
        ) from e

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    tmp.mkdir()
    started_ns = tmp.stat().st_mtime_ns  # filesystem clock: leftovers are older than this
    try:
        entries = {name: _write_array(tmp / f"{name}.npy", arr) for name, arr in arrays.items()}
        manifest = {"format": FORMAT, "arrays": entries, "meta": meta}
        with open(tmp / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        numbered = _numbered(directory)
        final = directory / f"ckpt-{(numbered[0][0] if numbered else 0) + 1:08d}"
        os.rename(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    for old in list_checkpoints(directory)[keep:]:
        # rename first: a crash mid-delete leaves a .tmp-* leftover, not a half checkpoint
        doomed = directory / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for p in directory.glob(f"{_TMP_PREFIX}*"):
        if p.is_dir() and p.stat().st_mtime_ns < started_ns:
            log.info("removing %s, left by an interrupted save", p)
            shutil.rmtree(p, ignore_errors=True)  # best effort: the save itself succeeded
    return final


def load_latest(directory) -> Checkpoint | None:
    """The newest checkpoint in ``directory`` that verifies (every file present, of the right
    size and sha256, loadable without pickle, of the dtype and shape in the manifest). Each
    damaged newer one is skipped with a warning. None if there are no checkpoints (or no
    directory); CheckpointError if there are some but none verifies.
    Blocks (reads and hashes every array of each checkpoint tried). Thread-safe, but a
    concurrent save() may prune the checkpoint being read (it then falls back, warning)."""
    problems = []
    for path in list_checkpoints(directory):
        try:
            return _load(path)
        except _Invalid as e:
            notice(log, "checkpoint %s is damaged: %s; falling back to the previous one", path, e)
            problems.append(f"  {path}: {e}")
    if not problems:
        return None
    raise CheckpointError(
        f"no valid checkpoint in {directory}; every one is damaged:\n"
        + "\n".join(problems)
        + "\nStart a new run (with an empty checkpoint directory), or restore a copy of a "
        "checkpoint directory into it."
    )


def _numbered(directory: Path) -> list[tuple[int, Path]]:
    """(number, path) of every entry named like a checkpoint, highest number first."""
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _CKPT.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _write_array(path: Path, arr: np.ndarray) -> dict:
    """Write one .npy file durably; returns its manifest entry (sha256 taken while writing)."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        np.save(w, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {
        "file": path.name,
        "dtype": str(arr.dtype),
        "shape": list(arr.shape),
        "bytes": w.bytes,
        "sha256": w.sha256.hexdigest(),
    }


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load(path: Path) -> Checkpoint:
    """Read and verify one checkpoint; raises _Invalid naming the first problem found."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise _Invalid(f"{MANIFEST} missing") from None
    except (OSError, ValueError) as e:
        raise _Invalid(f"{MANIFEST} does not parse ({e})") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt != FORMAT or not isinstance(manifest.get("arrays"), dict):
        raise _Invalid(f"{MANIFEST} is not a format-{FORMAT} manifest (format {fmt!r})")
    arrays = {}
    for name, entry in manifest["arrays"].items():
        try:
            file, size, sha = entry["file"], entry["bytes"], entry["sha256"]
            dtype, shape = np.dtype(entry["dtype"]), list(entry["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise _Invalid(f"{MANIFEST} has a bad entry for {name!r} ({e!r})") from None
        if not _NAME.fullmatch(name) or file != f"{name}.npy":  # never read outside `path`
            raise _Invalid(f"{MANIFEST} names file {file!r} for array {name!r}")
        arrays[name] = _load_array(path / file, size, sha, dtype, shape)
    return Checkpoint(path, arrays, manifest.get("meta"))


def _load_array(file: Path, size: int, sha: str, dtype: np.dtype, shape: list) -> np.ndarray:
    """One .npy file, checked against its manifest entry before np.load parses it."""
    try:
        actual = file.stat().st_size
    except FileNotFoundError:
        raise _Invalid(f"{file.name} missing") from None
    if actual != size:
        what = "truncated" if actual < size else "too long"
        raise _Invalid(f"{file.name} {what}: {actual} bytes, the manifest says {size}")
    with open(file, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != sha:
            raise _Invalid(f"{file.name} sha256 mismatch (the file's bytes changed)")
    try:
        arr = np.load(file, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise _Invalid(f"{file.name} refused by np.load(allow_pickle=False): {e}") from None
    if not isinstance(arr, np.ndarray) or arr.dtype != dtype or list(arr.shape) != shape:
        got = f"{arr.dtype} {list(arr.shape)}" if isinstance(arr, np.ndarray) else "no array"
        raise _Invalid(f"{file.name} holds {got}, the manifest says {dtype} {shape}")
    return arr
