"""The newest records of one kind a server sent, kept in its files folder (``members.json``
beside its ``ps_final.json``), so that the statistics server writes the ones it never
received (``stats/missed_records.py``): a ``members`` record sent while it was down, or lost
with a server killed before the record left the process.

Each record is written into the file (atomically) before it is sent, numbered so that it is
known across the server's restarts: ``"incarnation"`` (the server's, ``restart_record``'s
``starts``) and ``"n"`` (1, 2, ... within it; a journal kept from an earlier start of the
same incarnation number goes on from its last ``n``). The sender adds the server's
``Server.record`` (``{"server": I}``); the file's entries have none. The file keeps the newest
``KEEP`` records: λ changes are rare (an eviction waits ``runtime.learner_timeout_s``), and a
learner flapping in and out for hours costs a few tens of kilobytes, not a file that grows
with the run; only a statistics server down through more than ``KEEP`` changes misses the
oldest of them. A damaged file is ignored with a warning (the records before it are then not
kept). Reads and writes one small file; blocks for it; not thread-safe (the server's
thread).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..results import record_fields as fields
from ..results.records import check_record
from .end_files import save_json

log = logging.getLogger("rudra_zmq.ps")

KEEP = 256  # records kept per file: the oldest go first
NUMBERED = {"incarnation": fields.integer(1), "n": fields.integer(1)}


def file_name(kind: str) -> str:
    """The journal of ``kind`` records in a server's files folder: ``members.json``."""
    return f"{kind}.json"


class Journal:
    """The ``kind`` records (``members``) this server sent, kept in ``files_dir`` (None:
    nothing kept, but still numbered) as incarnation ``incarnation``; ``resume``: this start
    continues the run (a new run starts an empty file)."""

    def __init__(self, files_dir: Path | None, kind: str, incarnation: int, resume: bool):
        self.kind, self.incarnation = kind, incarnation
        self.path = Path(files_dir) / file_name(kind) if files_dir is not None else None
        self.entries: list[dict] = self._read() if resume else []
        mine = (e["n"] for e in self.entries if e["incarnation"] == incarnation)
        self.n = max(mine, default=0)

    def _read(self) -> list[dict]:
        if self.path is None:
            return []
        try:
            return read(self.path.parent, self.kind) or []
        except (OSError, ValueError) as exc:
            log.warning(
                "ignoring %s (%s): the records before this start are not kept", self.path, exc
            )
            return []

    def add(self, rec: dict) -> dict:
        """``rec`` (a record of this kind, ``t`` a Unix time) numbered, written into the file
        (the newest ``KEEP`` stay) and returned: send it now. Never raises for a write error:
        it is logged."""
        self.n += 1
        entry = {**rec, "type": self.kind, "incarnation": self.incarnation, "n": self.n}
        self.entries = [*self.entries, entry][-KEEP:]
        if self.path is not None:
            save_json(self.path, {self.kind: self.entries}, log)
        return entry


def read(files_dir, kind: str) -> list[dict] | None:
    """The ``kind`` records kept in the journal of the server whose files are in
    ``files_dir``, checked (``records.RECORD_FIELDS``, numbered); None when there is none.
    Raises OSError (unreadable) or ValueError (not JSON; a damaged entry:
    record_fields.DamagedRecord, naming the file, the field and its value). Reads one small
    file."""
    path = Path(files_dir) / file_name(kind)
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    entries = saved.get(kind) if isinstance(saved, dict) else None
    if not isinstance(entries, list):
        raise fields.DamagedRecord(f"{path}: expected an object with a list of {kind} records")
    for i, e in enumerate(entries):
        where = f"{path}, {kind}[{i}]"
        if not (isinstance(e, dict) and e.get("type") == kind):
            raise fields.DamagedRecord(f"{where} is {fields.shown(e)}; expected a {kind} record")
        fields.check(check_record(e, where), NUMBERED, where)
    return entries
