"""Every restart of a parameter server in the records once, including those whose ``restart``
record never reached the statistics server.

A server lists each restart in its files folder (``restarts.json``,
``server/restart_record.py``) before it sends the restart's record. The record can be lost:
sent while the statistics server was down or restarting and dropped from a full queue, lost
with a server killed before it left the process, or received by a statistics server killed
before it flushed it. So the statistics server looks at the servers' files every
``LOOK_EVERY_S`` and as it finishes, and writes the record of each restart they list that it
has not written, with ``"source": "restarts.json"`` (an entry younger than ``GRACE_S`` may
still have its record in flight: it waits). A restart is known by its server and
incarnation, so one is written once: a record that comes after its entry was read (a
sender's queue delivered late), or that a restarted statistics server finds in
``metrics.jsonl`` already, is not written again. This needs the run directory on a file
system the servers write (one host, or a shared one), as evaluating ``weights.npy`` does.

Reads a few small files; no sockets, the time passed in. Not thread-safe: the statistics
server's thread owns it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..server import restart_record
from ..shape import ClusterShape

log = logging.getLogger("rudra_zmq.stats")

LOOK_EVERY_S = 2.0  # how often the servers' restarts files are looked at
GRACE_S = 2.0  # an entry this young may still have its record in flight
SOURCE = restart_record.FILE  # what a record read from the files says it came from


class Restarts:
    """The restarts of the run in ``run_dir`` (its servers: ``shape``'s) written so far:
    ``written`` holds the ``restart`` records its ``metrics.jsonl`` has already."""

    def __init__(self, run_dir, shape: ClusterShape, written=()):
        self.run_dir, self.shape = Path(run_dir), shape
        self._known = {self._key(r) for r in written}
        self._looked = float("-inf")
        self._warned: set = set()  # files said damaged once

    def _key(self, rec: dict) -> tuple | None:
        server = self.shape.record_server(rec)
        incarnation = rec.get("incarnation")
        return None if server is None or incarnation is None else (server, incarnation)

    def first(self, rec: dict) -> bool:
        """Whether the ``restart`` record ``rec`` is not written yet (then it counts as
        written); one that names no server of this run or no incarnation always is."""
        key = self._key(rec)
        if key is None:
            return True
        if key in self._known:
            return False
        self._known.add(key)
        return True

    def missed(self, now: float, force: bool = False) -> list[dict]:
        """The ``restart`` records (``t`` a Unix time) of the restarts the servers' files list
        and no record said, older than ``GRACE_S`` (every one with ``force``: the run is over);
        looks once per ``LOOK_EVERY_S`` (always with ``force``). A damaged or unreadable file
        is skipped with a warning, once. Reads one small file per server."""
        if not force and now - self._looked < LOOK_EVERY_S:
            return []
        self._looked = now
        out = []
        for server in self.shape.servers:
            files = server.files_dir(self.run_dir)
            try:
                saved = restart_record.read(files)
            except (OSError, ValueError) as exc:
                if files not in self._warned:
                    self._warned.add(files)
                    log.warning("statistics server: ignoring %s: %s", files / SOURCE, exc)
                continue
            for entry in saved["restarts"] if saved is not None else ():
                rec = {**restart_record.as_record(entry), **server.record, "source": SOURCE}
                young = not force and now - entry.get("t", now) < GRACE_S
                if not young and self._key(rec) not in self._known:
                    out.append(rec)
        return out
