"""Every server restart and every λ change in the records once, including those whose
record never reached the statistics server.

A server keeps what it is about to send of these in its files folder: each restart in
``restarts.json`` (``server/restart_record.py``), each ``members`` record in ``members.json``
(``server/journal.py``), written before the record is sent. The record can be lost: sent
while the statistics server was down or restarting and dropped from a full queue, lost with
a server killed before it left the process, or received by a statistics server killed before
it flushed it. So the statistics server looks at the servers' files every ``LOOK_EVERY_S``
and as it finishes, and writes each record they keep that it has not written, with
``"source"`` naming the file (an entry younger than ``GRACE_S`` may still have its record in
flight: it waits). A record is known by its type, its server and its ``Kept.key`` (a
restart's incarnation; a λ change's incarnation and number), so one is written once: a
record that comes after its entry was read (a sender's queue delivered late), or that a
restarted statistics server finds in ``metrics.jsonl`` already, is not written again. A
record without its key (a run's from before they were numbered) is always written. This
needs the run directory on a file system the servers write (one host, or a shared one), as
evaluating ``weights.npy`` does.

Reads a few small files; no sockets, the time passed in. Not thread-safe: the statistics
server's thread owns it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..server import journal, restart_record
from ..shape import ClusterShape

log = logging.getLogger("rudra_zmq.stats")

LOOK_EVERY_S = 2.0  # how often the servers' files are looked at
GRACE_S = 2.0  # an entry this young may still have its record in flight


@dataclass(frozen=True)
class Kept:
    """One kind of record the servers keep in their files: its ``type``, the ``file`` in a
    server's files folder, ``read`` (files folder -> the records it keeps, without the
    server's ``Server.record``, ``t`` a Unix time; raises OSError or ValueError for a
    damaged file) and ``key``, the fields that tell two of one server's records apart."""

    type: str
    file: str
    read: Callable[[Path], list[dict]]
    key: tuple[str, ...]


def _restarts(files: Path) -> list[dict]:
    saved = restart_record.read(files)
    return [restart_record.as_record(e) for e in saved["restarts"]] if saved else []


KEPT = (
    Kept("restart", restart_record.FILE, _restarts, ("incarnation",)),
    Kept(
        "members",
        journal.file_name("members"),
        lambda files: journal.read(files, "members") or [],
        ("incarnation", "n"),
    ),
)


class MissedRecords:
    """The records of the kinds the servers keep (``kept``) written so far in the run in
    ``run_dir`` (its servers: ``shape``'s): ``written`` holds those its ``metrics.jsonl`` has
    already (any records: the kept kinds are picked)."""

    def __init__(self, run_dir, shape: ClusterShape, written=(), kept=KEPT):
        self.run_dir, self.shape = Path(run_dir), shape
        self._kept = {k.type: k for k in kept}
        self._known = {self._key(r) for r in written} - {None}
        self._looked = float("-inf")
        self._warned: set = set()  # files said damaged once

    def _key(self, rec: dict) -> tuple | None:
        kept = self._kept.get(rec.get("type"))
        if kept is None:
            return None
        server = self.shape.record_server(rec)
        key = tuple(rec.get(k) for k in kept.key)
        return None if server is None or None in key else (kept.type, server, *key)

    def first(self, rec: dict) -> bool:
        """Whether the record ``rec`` is not written yet (then it counts as written); one of
        a kind not kept, or that names no server of this run or lacks its key, always is."""
        key = self._key(rec)
        if key is None:
            return True
        if key in self._known:
            return False
        self._known.add(key)
        return True

    def missed(self, now: float, force: bool = False) -> list[dict]:
        """The records (``t`` a Unix time) the servers' files keep and no record said, older
        than ``GRACE_S`` (every one with ``force``: the run is over), each with ``"source"``
        naming its file; looks once per ``LOOK_EVERY_S`` (always with ``force``). A damaged
        or unreadable file is skipped with a warning, once. Reads one small file per server
        and kind."""
        if not force and now - self._looked < LOOK_EVERY_S:
            return []
        self._looked = now
        out = []
        for server in self.shape.servers:
            files = server.files_dir(self.run_dir)
            for kept in self._kept.values():
                try:
                    entries = kept.read(files)
                except (OSError, ValueError) as exc:
                    if (files, kept.file) not in self._warned:
                        self._warned.add((files, kept.file))
                        log.warning("statistics server: ignoring %s: %s", files / kept.file, exc)
                    continue
                for entry in entries:
                    rec = {**entry, **server.record, "source": kept.file}
                    young = not force and now - entry.get("t", now) < GRACE_S
                    if not young and self._key(rec) not in self._known:
                        out.append(rec)
        return out
