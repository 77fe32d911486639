"""Which restarts a server went through, from what, and what each lost: kept in its own files
folder (``restarts.json`` beside its ``ps_final.json``), so that a server restarted without a
checkpoint still knows the restarts before it, and written into ``ps_final.json``
(``"restarts"``), where the result line, ``report`` and ``compare`` read them.

A start with ``--resume`` by the same launch (``checkpointing.launch_session``) as the start
before it is a restart (the launcher restarted the server); one by another launch is the run
resumed (``rudra-zmq run --resume``), not a restart. Each restart is ``{"server": I, "from":
"checkpoint" | "learner L" | "initial", "ts": T, "lost": N, "incarnation": n}``: the
timestamp it resumed at and the updates it lost (those a learner had seen that the restored
state lacked), with when (``"t"``, Unix time), at which ``epoch`` and from which
``checkpoint`` (its path, or None), so that the entry is its ``restart`` record
(:func:`as_record`): the statistics server writes the record of an entry it never received
(``stats/missed_records.py``). A damaged file is ignored with a warning (the restarts before
it are then not listed).

``starts`` is the server's incarnation number, the one its terminal line, its restart record and
its ``ps_final.json`` say. It is written when the server starts, not when it has recovered: a
restart killed before it took its range back (or wrote a checkpoint) still uses up its number,
and the next restart says the next one (a restart missing from the list between two numbers
is one that died before it recorded where it resumed from). Reads and writes one small file;
blocks for it; not thread-safe (the server's thread).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ..results import record_fields as fields
from ..results.records import check_restarts
from .end_files import save_json

log = logging.getLogger("rudra_zmq.ps")

FILE = "restarts.json"


class RestartHistory:
    """The restarts of the server whose files are in ``files_dir`` (None: nothing kept), of
    this launch ``session``; ``resume``: this start continues from what it saved; ``known``:
    the incarnations its restored checkpoint lists, this one included (the count when the
    file was lost). Writes the file: this start is counted from now on."""

    def __init__(self, files_dir: Path | None, session: str | None, resume: bool, known: int = 1):
        self.path = Path(files_dir) / FILE if files_dir is not None else None
        self.session = session
        self.restarts: list[dict] = []
        self.starts = 1
        self.current: dict | None = None  # this start's record, when it is a restart
        saved = self._read() if resume else None
        self.restarted = saved is not None and saved.get("session") == session
        if saved is not None:
            self.restarts = list(saved["restarts"])
            self.starts = int(saved.get("starts", 1)) + 1
        self.starts = max(self.starts, known)
        self.save()

    def _read(self) -> dict | None:
        if self.path is None:
            return None
        try:
            return read(self.path.parent)
        except (OSError, ValueError) as exc:
            log.warning(
                "ignoring %s (%s): the restarts before this one are not listed", self.path, exc
            )
            return None

    def record(
        self,
        server: int,
        origin: str,
        ts: int,
        lost: int,
        epoch: float | None = None,
        checkpoint: Path | None = None,
    ) -> dict | None:
        """This start resumed at ``ts`` (``epoch``) from ``origin`` (``checkpoint``: the one
        it restored, if any), ``lost`` updates lost so far; kept (and returned) when it is a
        restart, else None. Writes the file."""
        if self.restarted:
            self.current = {
                "server": server,
                "from": origin,
                "ts": ts,
                "lost": lost,
                "incarnation": self.starts,
                "t": time.time(),
                **({} if epoch is None else {"epoch": float(epoch)}),
                "checkpoint": None if checkpoint is None else str(checkpoint),
            }
            self.restarts.append(self.current)
        self.save()
        return self.current

    def lost(self, n: int) -> None:
        """This restart's updates lost, as counted by now (learners rejoin after it)."""
        if self.current is not None:
            self.current["lost"] = n

    def save(self) -> None:
        """Write the file (atomically). Never raises for a write error: it is logged."""
        if self.path is None:
            return
        record = {"session": self.session, "starts": self.starts, "restarts": self.restarts}
        save_json(self.path, record, log)


def read(files_dir) -> dict | None:
    """The restarts file of the server whose files are in ``files_dir`` (``{"session",
    "starts", "restarts": [entry, ...]}``), checked; None when there is none. Raises
    OSError (unreadable) or ValueError (not JSON; a damaged entry: record_fields.DamagedRecord,
    naming the file, the field and its value). Reads one small file."""
    path = Path(files_dir) / FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if not isinstance(saved, dict):
        raise fields.DamagedRecord(f"{path} is not an object")
    check_restarts(saved.get("restarts"), str(path))
    if not fields.integer(1).ok(saved.get("starts", 1)):
        raise fields.DamagedRecord(f"{path}: starts is {saved.get('starts')!r}")
    return saved


def as_record(entry: dict) -> dict:
    """The ``restart`` record (``metrics.jsonl``) of the restart ``entry``, but for which server
    it names: the sender adds its ``Server.record`` (none for a run's only server). Pure."""
    return {"type": "restart", **{k: v for k, v in entry.items() if k != "server"}}
