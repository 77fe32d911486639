"""Shared memory between a Rudra-adv leaf tree node and its co-located learners (issue #5).

Two kinds of segment, files in /dev/shm, mmapped: :class:`GradientSlots`
(``rudra_zmq_<token>_n<node>_l<learner>``: two gradient slots, made by the learner, read by the
leaf) and :class:`WeightBoard` (``rudra_zmq_<token>_n<node>_w``: made by the leaf, read by its
learners). Layout, measurements and why not ``multiprocessing.shared_memory``:
``docs/sharedmem.md``.

- Slots alternate: a learner writes slot i again only after the push that named it was
  answered. A slot is handed over by a ZeroMQ message sent after it was written (PUSH x{slot}):
  the socket system calls order memory on every CPU.
- The board is read with no handshake, behind a seqlock: the leaf makes ``seq`` odd, writes
  ``ts`` and the weights, makes it even; a reader retries while ``seq`` was odd or changed. This
  is correct on x86-64 (TSO) only; NumPy cannot issue the fences ARM or POWER would need, so
  the board refuses to exist there (:class:`ShmUnavailable`).
- Lifecycle: the creator unlinks the name on ``close()`` and at interpreter exit (atexit);
  ``unlink()`` early, once every peer has mapped a segment, and not even SIGKILL leaves it.
  Segments whose creator died are removed by :func:`sweep_stale`, which each ``create`` runs
  first: every segment's header names its creator (pid, start time, pid namespace), and the
  names this process made are unlinked at interpreter exit (:func:`own`).
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import platform
import re
import secrets
import struct
import time

import numpy as np

from . import codec, kernels, wire

_BOARD_DTYPES = tuple(wire.PAYLOAD_DTYPES[c] for c in wire.MODEL_DTYPES)  # what publish widens
KIND_SLOTS, KIND_BOARD = 1, 2
HEADER_BYTES = 64
_SEQ, _TS, _BOARD_DATA = 64, 72, 128  # board: seq and ts on their own cache line
_TOKEN = re.compile(r"[A-Za-z0-9]{1,32}\Z")
_X86 = {"x86_64", "amd64"}  # 64-bit: seq is one aligned 8-byte access
_USE_IPC = "use ipc:// instead (architecture.leaf_shm: false)"


# ---------------------------------------------------------------- who made each segment
SHM_DIR = "/dev/shm"
PREFIX = "rudra_zmq_"
MAGIC, LAYOUT = b"RUDRASHM", 1
HEADER = struct.Struct("<8sIIIxxxxQQQ")  # magic, layout, kind, pid, start, pid ns, numel
_OWNED: dict[str, int] = {}  # path -> pid of the process that created it


def _remove(path: str) -> bool:
    """Remove ``path``; False if it could not be (gone already). Blocks for unlink(2)."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_ns() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0: cannot tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def header(kind: int, numel: int) -> bytes:
    """The header of a segment of ``kind`` and ``numel`` floats made by this process now."""
    me = os.getpid()
    return HEADER.pack(MAGIC, LAYOUT, kind, me, start_time(me) or 0, pid_ns(), numel)


def own(path: str) -> None:
    """Record that this process created ``path``: it is unlinked at interpreter exit."""
    _OWNED[path] = os.getpid()


def disown(path: str) -> None:
    """Forget ``path`` (its name was unlinked already). Idempotent."""
    _OWNED.pop(path, None)


def stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Names of rudra_zmq segments whose creator process is gone (same pid and start time:
    a reused pid does not count). Leaves out one without a header yet (being created) and one
    from another pid namespace (another container sharing /dev/shm). Unlinks nothing; blocks
    briefly (a listing, 64 bytes read each); thread-safe."""
    me = pid_ns()
    if not me or start_time(os.getpid()) is None:  # no /proc: cannot tell who is alive
        return []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(PREFIX)]
    except OSError:
        return []
    gone = []
    for name in names:
        try:
            with open(os.path.join(shm_dir, name), "rb") as f:
                magic, _, _, pid, start, ns, _ = HEADER.unpack(f.read(HEADER.size))
        except (OSError, struct.error):
            continue
        if magic == MAGIC and ns == me and start_time(pid) != start:
            gone.append(name)
    return gone


def sweep_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments ``stale_segments`` names; returns those it removed. Thread-safe."""
    return [n for n in stale_segments(shm_dir) if _remove(os.path.join(shm_dir, n))]


@atexit.register
def _unlink_owned() -> None:
    for path, pid in list(_OWNED.items()):
        if pid == os.getpid():  # not in a forked child: the names are the parent's
            _remove(path)
            del _OWNED[path]


class ShmUnavailable(RuntimeError):
    """Shared memory cannot be used here (no /dev/shm, too little space, a weakly ordered
    CPU, the peer's segment is not on this host); the caller should fall back to ipc://."""


def new_token() -> str:
    """A random 16-hex-digit token for segment names. Does not block; thread-safe."""
    return secrets.token_hex(8)


def segment_name(token: str, node: int, learner: int | None = None) -> str:
    """``rudra_zmq_<token>_n<node>_l<learner>`` (gradient slots) or ``..._n<node>_w`` (the
    board, ``learner=None``). Raises ValueError for a token that is not 1-32 letters/digits or
    a negative/non-int id (tokens arrive over the wire). Does not block; thread-safe."""
    if not isinstance(token, str) or not _TOKEN.match(token):
        raise ValueError(f"shared-memory token {token!r:.60} must be 1-32 letters or digits")
    for what, v in (("node", node), ("learner", learner)):
        if v is not None and (type(v) is not int or v < 0):
            raise ValueError(f"shared-memory {what} id must be an int >= 0, got {v!r}")
    return f"{PREFIX}{token}_n{node}_" + ("w" if learner is None else f"l{learner}")


def _align(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def slots_nbytes(numel: int) -> int:
    """Bytes of one learner's GradientSlots segment for ``numel`` floats."""
    return HEADER_BYTES + 2 * _align(4 * numel)


def board_nbytes(numel: int) -> int:
    """Bytes of one WeightBoard segment for ``numel`` floats."""
    return _BOARD_DATA + _align(4 * numel)


class _Shared:
    """One mapped /dev/shm file, the base of both kinds. ``create``: exclusive, after a sweep
    and a space check, space reserved (posix_fallocate: ENOSPC now, not SIGBUS at the first
    write), header written, read-write; ``owner`` is True until the name is unlinked. Else
    opened read-only, header checked. Blocks for the file calls; not thread-safe."""

    def __init__(self, name, kind, numel, nbytes, create, shm_dir, limit_bytes=None):
        if type(numel) is not int or numel < 1:
            raise ValueError(f"{name}: numel must be an int >= 1, got {numel!r}")
        self.name, self.path, self.nbytes = name, os.path.join(shm_dir, name), nbytes
        self.owner, self._mm = False, None
        fd = self._create(shm_dir, limit_bytes) if create else self._open()
        try:
            if os.fstat(fd).st_size != nbytes:
                raise ShmUnavailable(
                    f"{self.path} has {os.fstat(fd).st_size:,} bytes, "
                    f"expected {nbytes:,} for {numel:,} floats"
                )
            self._mm = mmap.mmap(
                fd, nbytes, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ
            )
            if create:  # the magic last: a sweep that sees it sees the pid too (x86 TSO)
                head = header(kind, numel)
                self._mm[8 : HEADER.size], self._mm[:8] = head[8:], head[:8]
            got = HEADER.unpack_from(self._mm, 0)
            if (got[0], got[1], got[2], got[6]) != (MAGIC, LAYOUT, kind, numel):
                raise ShmUnavailable(
                    f"{self.path} is not a layout-{LAYOUT} kind-{kind} "
                    f"rudra_zmq segment of {numel:,} floats (header: {got[0]!r}"
                    f", layout {got[1]}, kind {got[2]}, {got[6]:,} floats); "
                    "is the peer another version or model config?"
                )
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShmUnavailable(
                f"no shared-memory segment {self.path} on this host (is its "
                f"creator on another machine, or gone?); {_USE_IPC}"
            ) from None

    def _create(self, shm_dir: str, limit_bytes: int | None) -> int:
        if not os.path.isdir(shm_dir):
            raise ShmUnavailable(f"{shm_dir} does not exist on this host; {_USE_IPC}")
        sweep_stale(shm_dir)
        st = os.statvfs(shm_dir)
        room = min(st.f_bavail * st.f_frsize, limit_bytes or float("inf"))
        no_room = ShmUnavailable(
            f"shared memory needs {self.nbytes:,} bytes ({self.nbytes / 2**20:,.1f} MiB) in "
            f"{shm_dir} for {self.name}, but only {room:,} are free (Docker's default /dev/shm "
            f"is 64 MiB: give the container --shm-size); {_USE_IPC}"
        )
        if self.nbytes > room:
            raise no_room
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.owner = True
        own(self.path)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as exc:
            os.close(fd)
            self.unlink()
            raise no_room if exc.errno == errno.ENOSPC else exc from None
        return fd

    def _array(self, dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype, count, offset)

    def unlink(self) -> None:
        """Creator only (a no-op otherwise): remove the name now. Existing mappings stay valid;
        new peers can no longer attach. Idempotent; blocks for unlink(2); not thread-safe."""
        if self.owner:
            self.owner = False
            disown(self.path)
            _remove(self.path)

    def close(self) -> None:
        """Unlink (creator) and unmap. Arrays handed out keep the memory alive until the last
        of them goes. Idempotent; does not block; not thread-safe."""
        self.unlink()
        self._drop()
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still exported: the mapping goes with them
                pass

    def _drop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class GradientSlots(_Shared):
    """One learner's two alternating float32 gradient slots in shared memory.

    ``create`` (the learner: read-write, owns the name) or ``attach`` (the leaf: read-only, for
    ``kernels.accumulate``). ``slot(i)`` is a 1-D contiguous float32 array of ``numel``; the
    learner's flat gradient buffer may be a view of it. Not thread-safe.
    """

    def __init__(
        self,
        token: str,
        node: int,
        learner: int,
        numel: int,
        *,
        create: bool,
        shm_dir: str = SHM_DIR,
        limit_bytes: int | None = None,
    ):
        super().__init__(
            segment_name(token, node, learner),
            KIND_SLOTS,
            numel,
            slots_nbytes(numel),
            create,
            shm_dir,
            limit_bytes,
        )
        self.token, self.numel, step = token, numel, _align(4 * numel)
        self._slots = tuple(self._array(np.float32, numel, HEADER_BYTES + i * step) for i in (0, 1))

    @classmethod
    def create(cls, token: str, node: int, learner: int, numel: int, **kw) -> GradientSlots:
        """Make the (zeroed) segment after sweeping stale ones; ``limit_bytes=`` caps the space
        believed free (tests), ``shm_dir=`` moves it. Raises ShmUnavailable (no room, no
        /dev/shm), ValueError (bad name parts), FileExistsError (name taken). Blocks for the
        file calls; reserves ``slots_nbytes(numel)`` bytes of shared memory."""
        return cls(token, node, learner, numel, create=True, **kw)

    @classmethod
    def attach(cls, token: str, node: int, learner: int, numel: int, **kw) -> GradientSlots:
        """Map a learner's segment read-only; raises ShmUnavailable if it is not on this host
        or does not match ``numel``. Blocks for the file calls; allocates no memory."""
        return cls(token, node, learner, numel, create=False, **kw)

    def slot(self, i: int) -> np.ndarray:
        """Slot ``i`` (0 or 1): writable for the creator, read-only for an attacher. A view:
        does not block or allocate; thread-safe."""
        if i not in (0, 1):
            raise ValueError(f"gradient slot must be 0 or 1, got {i!r}")
        return self._slots[i]

    def _drop(self) -> None:
        self._slots = ()


class WeightBoard(_Shared):
    """One leaf's weights behind a seqlock: the leaf ``publish``es, learners ``read_into``.

    One writer (the creator); any number of reader processes, which never block it and never
    keep a torn copy (a writer publishing back to back, faster than a copy, would starve them;
    the leaf publishes once per reply from its parent). x86 only (see the module docstring):
    elsewhere ``create``/``attach`` raise ShmUnavailable. ``retries`` counts discarded copies.
    """

    def __init__(
        self,
        token: str,
        node: int,
        numel: int,
        *,
        create: bool,
        shm_dir: str = SHM_DIR,
        limit_bytes: int | None = None,
    ):
        machine = platform.machine()
        if machine.lower() not in _X86:
            raise ShmUnavailable(
                f"the weight board's seqlock relies on x86 store ordering and "
                f"this CPU is {machine!r}; {_USE_IPC}"
            )
        super().__init__(
            segment_name(token, node),
            KIND_BOARD,
            numel,
            board_nbytes(numel),
            create,
            shm_dir,
            limit_bytes,
        )
        self.token, self.numel, self.retries = token, numel, 0
        self._seq = self._array(np.uint64, 1, _SEQ)
        self._ts = self._array(np.int64, 1, _TS)
        self._w = self._array(np.float32, numel, _BOARD_DATA)
        if create:
            self._ts[0] = -1

    @classmethod
    def create(cls, token: str, node: int, numel: int, **kw) -> WeightBoard:
        """Make the board (ts -1: nothing published) after sweeping stale segments. Raises like
        :meth:`GradientSlots.create`, and ShmUnavailable on a non-x86 CPU. Blocks for the file
        calls; reserves ``board_nbytes(numel)`` bytes of shared memory."""
        return cls(token, node, numel, create=True, **kw)

    @classmethod
    def attach(cls, token: str, node: int, numel: int, **kw) -> WeightBoard:
        """Map a leaf's board read-only; raises ShmUnavailable (not on this host, mismatched,
        non-x86). Blocks for the file calls; allocates no memory."""
        return cls(token, node, numel, create=False, **kw)

    @property
    def ts(self) -> int:
        """The ts of the last completed publish (-1: none yet), a hint that may be overtaken at
        once. Does not block or allocate; thread-safe."""
        return int(self._ts[0])

    def publish(self, ts: int, pieces) -> int:
        """Write ``pieces`` (1-D float32 arrays, e.g. a WEIGHTS message's payloads, together
        ``numel`` long; float16 or bfloat16 bits are widened: a half wire) as version ``ts``;
        returns the new (even) sequence number. Sizes and dtypes are checked first, so a
        ValueError leaves the board as it was. Blocks for one copy (the kernel releases the
        GIL); allocates a list of views, no buffers. Creator only; one writer: not
        thread-safe."""
        pieces = [np.asarray(p) for p in pieces]
        total = sum(int(p.shape[0]) for p in pieces if p.ndim == 1)
        bad = [
            f"{p.dtype}{list(p.shape)}"
            for p in pieces
            if p.dtype not in _BOARD_DTYPES or p.ndim != 1 or not p.flags.c_contiguous
        ]
        if bad or total != self.numel:
            raise ValueError(
                f"WeightBoard.publish got {bad or [p.shape[0] for p in pieces]} "
                f"({total:,} floats); the board holds {self.numel:,} contiguous "
                "floats (float32, float16 or bfloat16 bits; is the sender running another "
                "model config?)"
            )
        seq = int(self._seq[0]) + 1
        self._seq[0] = seq  # odd: a reader that sees this copies again
        self._ts[0] = ts
        codec.load(self._w, pieces)
        self._seq[0] = seq + 1  # even: complete (x86: after every store above)
        return seq + 1

    def read_into(self, dst: np.ndarray, timeout_s: float = 60.0) -> int:
        """Copy a complete version into ``dst`` (1-D float32 of ``numel``); returns its ts (-1:
        nothing published yet). Blocks for the copy, and retries while the leaf is mid-publish
        (yielding the GIL); after ``timeout_s`` of that (a writer that died mid-publish) raises
        TimeoutError, leaving ``dst`` torn. Allocates nothing. Thread-safe for readers with
        separate ``dst``s."""
        deadline = None
        while True:
            seq = int(self._seq[0])
            if not seq & 1:
                ts = int(self._ts[0])
                kernels.copy_into(dst, self._w)
                if int(self._seq[0]) == seq:
                    return ts
            self.retries += 1
            deadline = deadline or time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the weight board {self.name} stayed mid-publish or changed "
                    f"during every copy for {timeout_s:g} s (sequence {seq}); "
                    "did the leaf die writing it, or publish back to back?"
                )
            time.sleep(0 if self.retries % 64 else 1e-4)

    def _drop(self) -> None:
        self._seq = self._ts = self._w = None
