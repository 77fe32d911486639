"""Who made each rudra_zmq segment in /dev/shm, and removing it when they are gone: the header
that names a segment's creator (pid, start time, pid namespace), the names this process owns
(unlinked at interpreter exit), and the sweep of segments whose creator died. No mapping here:
the segments themselves are ``shm.py``'s."""

from __future__ import annotations

import atexit
import os
import struct

SHM_DIR = "/dev/shm"
PREFIX = "rudra_zmq_"
MAGIC, LAYOUT = b"RUDRASHM", 1
HEADER = struct.Struct("<8sIIIxxxxQQQ")  # magic, layout, kind, pid, start, pid ns, numel
_OWNED: dict[str, int] = {}  # path -> pid of the process that created it


def unlink(path: str) -> bool:
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
    return [n for n in stale_segments(shm_dir) if unlink(os.path.join(shm_dir, n))]


@atexit.register
def _unlink_owned() -> None:
    for path, pid in list(_OWNED.items()):
        if pid == os.getpid():  # not in a forked child: the names are the parent's
            unlink(path)
            del _OWNED[path]
