"""Shared memory for ``rudra-zmq bench shm-leaf``: named segments, a seqlock, test values.

Segments are files in ``/dev/shm`` named ``rudra_shm_leaf_<pid>_...``. :class:`Seqlock` puts
weights behind a version counter so a reader never keeps a half-written copy; the value helpers
and :class:`Checker` give every round an exact oracle. Nothing here blocks except
``Seqlock.read_into`` (at most ``timeout_s``).
"""

from __future__ import annotations

import mmap
import os
import re
import time

import numpy as np

from .. import kernels

TIMEOUT_S = 60.0  # a silent peer fails the run after this long
FULL_CHECK_MAX = 1 << 16  # check every element up to this many parameters, else a sample
SHM_DIR = "/dev/shm"
PREFIX = "rudra_shm_leaf"
VERSION_BYTES = 64  # the seqlock counter's cache line, before the weights


# ----------------------------------------------------------------------------- shared memory
class Segment:
    """A named shared-memory file in ``SHM_DIR``, mapped read-write.

    ``create=True`` makes it (exclusively) and owns its name: ``unlink()`` removes the name
    (idempotent); the mapping stays valid until ``close()`` and process exit. Not thread-safe.
    """

    def __init__(self, name: str, nbytes: int, create: bool):
        self.path, self.nbytes, self.owner = os.path.join(SHM_DIR, name), nbytes, False
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            self.owner = create
            if create:
                os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)

    def array(self, dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self.mm, dtype, count, offset)

    def unlink(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        try:
            self.mm.close()
        except BufferError:  # arrays still view it: the mapping goes with the process
            pass


def remove_stale_segments() -> list[str]:
    """Unlink segments left by runs whose leaf process no longer exists (a SIGKILL during
    start-up); returns their names."""
    gone = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        m = re.match(rf"{PREFIX}_(\d+)_", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except OSError:
                pass
    return gone


def our_segments(pid: int | None = None) -> list[str]:
    """Names in ``SHM_DIR`` made by the leaf ``pid`` (default this process)."""
    head = f"{PREFIX}_{os.getpid() if pid is None else pid}_"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(head))


class Seqlock:
    """Weights in a shared segment behind a version counter.

    The writer makes the counter odd, copies the weights in, makes it even; a reader copies
    them out and starts again if the counter was odd or changed meanwhile. Correct as written
    on x86-64 (stores are seen in program order, loads are not reordered with loads; the
    kernels' OpenMP regions end in a barrier); a weakly ordered CPU (ARM) needs acquire/release
    fences around the copy. One writer; readers never block it, but a writer that publishes
    without pause would starve them (the leaf publishes once per round). Not thread-safe per
    object.
    """

    def __init__(self, seg: Segment, n: int):
        self.version = seg.array(np.uint64, 1, 0)
        self.weights = seg.array(np.float32, n, VERSION_BYTES)

    def publish(self, src: np.ndarray) -> int:
        v = int(self.version[0]) + 1
        self.version[0] = v  # odd: writing
        kernels.copy_into(self.weights, src)
        self.version[0] = v + 1  # even: complete
        return v + 1

    def read_into(self, dst: np.ndarray, timeout_s: float = TIMEOUT_S) -> tuple[int, int]:
        """Copy a complete version into ``dst``; returns (version, retries)."""
        retries, deadline = 0, time.monotonic() + timeout_s
        while True:
            v = int(self.version[0])
            if not v & 1:
                kernels.copy_into(dst, self.weights)
                if int(self.version[0]) == v:
                    return v, retries
            retries += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights stayed mid-write (version {v}) for {timeout_s} s")


# ----------------------------------------------------------------------------- values
def weight_value(rnd: int) -> float:
    return 1.5 if rnd % 2 == 0 else 2.5  # the two preallocated weight buffers


def grad_value(learner: int, rnd: int) -> float:
    return float(learner + 1 + rnd % 8)  # small integers: every sum is exact


def make_pattern(kind: str, n: int) -> np.ndarray | None:
    return None if kind == "fill" else (np.arange(n) % 1024).astype(np.float32)


def write(out: np.ndarray, value: float, pattern) -> None:
    """The learner's one write pass of its gradient (or the leaf's weights)."""
    if pattern is None:
        out.fill(value)
    else:
        np.add(pattern, np.float32(value), out=out)


class Checker:
    """Compares a buffer with ``mult x pattern + value`` on every element (small n) or on a
    fixed sample; counts mismatches."""

    def __init__(self, n: int, pattern):
        self.idx = None if n <= FULL_CHECK_MAX else np.linspace(0, n - 1, 257).astype(np.int64)
        self.pattern = pattern
        self.errors = 0

    def __call__(self, arr: np.ndarray, value: float, mult: int = 1) -> bool:
        a = arr if self.idx is None else arr[self.idx]
        want = np.float32(value)
        if self.pattern is not None:
            p = self.pattern if self.idx is None else self.pattern[self.idx]
            want = p * np.float32(mult) + want
        ok = bool(np.all(a == want))
        self.errors += not ok
        return ok
