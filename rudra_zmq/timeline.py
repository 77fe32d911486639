"""A timeline of one run: compute spans and every part sent and received, per peer, as a
Chrome/Perfetto trace (the JSON trace-event format Horovod's timeline uses; open it in
ui.perfetto.dev or chrome://tracing).

Each process records into its own :class:`Timeline` (``start``), and writes its events to a
file of its own at the end (``Timeline.close``); whoever started the processes joins those
files into the one trace the user asked for (:func:`merge`). Events, in the trace's words:

- ``X`` (complete) spans: ``compute``, ``exchange`` (a learner's step on the wire), ``update``;
- ``i`` (instant) marks in category ``wire``: ``send`` and ``recv`` of one message or part,
  with ``peer``, ``bytes``, ``kind``, ``at`` (the part's offset), ``seq``, ``ts``;
- ``C`` counters: a host link's use (``link_counters``: bytes per second each way).

Timestamps are microseconds of the wall clock (``time.time_ns``), so the processes of one
machine (the emulated LAN's namespaces share it) line up; across real hosts they are as far
apart as the hosts' clocks.

Cost: while no timeline is started, every hook is one call that returns at once (the
module-level functions test one global). A started timeline appends a tuple to a list under
the GIL (``list.append`` is atomic: threads may record at once) and keeps at most
``capacity`` events, counting the ones it dropped (written in the trace's metadata), so
memory stays bounded on a long run. Writing happens once, at ``close``, to a hidden file
renamed into place: a reader never sees half a trace.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

DEFAULT_CAPACITY = 500_000  # events per process (about 150 MB at most, as tuples)
ENV = "RUDRA_TIMELINE"  # a role started with this set records to that file (its own part)


class TimelinePathError(ValueError):
    """A timeline file that cannot be written; the message names the path and why."""


def check_path(path: str) -> Path:
    """``path`` as a Path if a file can be written there: its folder exists and is
    writable, and it is not a folder. Raises TimelinePathError saying what to fix. Tries a
    hidden file beside it (removed at once), so a read-only or full disk is caught before a
    run starts, not after it ends. Blocks for that file."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise TimelinePathError(
            f"--timeline {path}: that is a folder; name a file, e.g. {p}/timeline.json"
        )
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise TimelinePathError(f"--timeline {path}: the folder {folder} does not exist")
    probe = folder / f".{p.name}.{os.getpid()}.probe"
    try:
        with open(probe, "w") as f:
            f.write("{}")
        probe.unlink()
    except OSError as exc:
        raise TimelinePathError(
            f"--timeline {path}: cannot write in {folder} ({exc.strerror})"
        ) from None
    return p.absolute()


def write_json_atomically(path: Path, obj) -> None:
    """``obj`` as JSON to a hidden file beside ``path`` named by this process, then renamed
    to ``path``. Blocks for the write."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    os.replace(tmp, path)


def now_us() -> int:
    """The trace's clock: wall-clock microseconds. Thread-safe."""
    return time.time_ns() // 1000


class Timeline:
    """The events of one process (``process``: its name in the trace, e.g. "learner 3").

    ``path``: where ``close`` writes them (a trace of this process alone, joined by
    :func:`merge`). Thread-safe: any thread may record; each event carries its thread's
    name. Never blocks but in ``close``.
    """

    def __init__(self, path, process: str, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"timeline capacity {capacity}: give at least 1 event")
        self.path, self.process, self.capacity = Path(path), process, capacity
        self.events: list[tuple] = []
        self.dropped = 0
        self.threads: dict[int, str] = {}
        self._local = threading.local()
        self._closed = False

    def _add(self, ev: tuple) -> None:
        if len(self.events) < self.capacity:
            self.events.append(ev)
        else:
            self.dropped += 1

    def _tid(self) -> int:
        """This thread's id in the trace: its native id (idents are reused as threads end,
        native ids are not soon), its name noted on its first event."""
        tid = getattr(self._local, "tid", None)
        if tid is None:
            tid = self._local.tid = threading.get_native_id()
            self.threads[tid] = threading.current_thread().name
        return tid

    def complete(self, name: str, t0_us: int, t1_us: int, cat: str = "compute", **args) -> None:
        """A span from ``t0_us`` to ``t1_us`` (``now_us`` values)."""
        self._add(("X", name, cat, t0_us, t1_us - t0_us, self._tid(), args))

    @contextmanager
    def span(self, name: str, cat: str = "compute", **args):
        """``with tl.span("compute"):`` records the block as one span."""
        t0 = now_us()
        try:
            yield
        finally:
            self.complete(name, t0, now_us(), cat, **args)

    def instant(self, name: str, cat: str = "wire", **args) -> None:
        """A mark at this moment (a part sent or received)."""
        self._add(("i", name, cat, now_us(), 0, self._tid(), args))

    def counter(self, name: str, t_us: int, **values) -> None:
        """Counter values (numbers) at ``t_us``, drawn as a track per ``name``."""
        self._add(("C", name, "link", t_us, 0, 0, values))

    def trace(self, pid: int = 0) -> list[dict]:
        """The events as trace-event dicts of process ``pid`` (metadata first). Pure."""
        out = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": self.process},
            },
        ]
        out += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in self.threads.items()
        ]
        for ph, name, cat, ts, dur, tid, args in list(self.events):
            ev = {"ph": ph, "name": name, "cat": cat, "ts": ts, "pid": pid, "tid": tid}
            if ph == "X":
                ev["dur"] = dur
            elif ph == "i":
                ev["s"] = "t"
            if args:
                ev["args"] = args
            out.append(ev)
        return out

    def close(self) -> None:
        """Write this process's events to ``path`` (atomically; once). Blocks for the write."""
        if self._closed:
            return
        self._closed = True
        write_json_atomically(
            self.path,
            {
                "traceEvents": self.trace(),
                "otherData": {"process": self.process, "dropped": self.dropped},
            },
        )


class _Off:
    """The timeline when none is started: every hook returns at once."""

    enabled = False

    def complete(self, *a, **k) -> None:
        pass

    def instant(self, *a, **k) -> None:
        pass

    def counter(self, *a, **k) -> None:
        pass

    @contextmanager
    def span(self, *a, **k):
        yield

    def close(self) -> None:
        pass


OFF = _Off()
Timeline.enabled = True
_current: Timeline | _Off = OFF


def start(path, process: str, capacity: int = DEFAULT_CAPACITY) -> Timeline:
    """Start this process's timeline (the one the hooks below record into), writing to
    ``path`` at ``stop``. Not for two at once: a second start replaces the first (unwritten)."""
    global _current
    _current = Timeline(path, process, capacity)
    return _current


def start_from_env(process: str) -> Timeline | _Off:
    """Start a timeline if ``RUDRA_TIMELINE`` names a file: this process's part is that
    path + ``.<process>.<pid>.part`` (joined later by :func:`merge`). Returns it, or OFF."""
    base = os.environ.get(ENV)
    if not base:
        return OFF
    name = process.replace(" ", "-")
    return start(f"{base}.{name}.{os.getpid()}.part", process)


def current() -> Timeline | _Off:
    """The started timeline, or OFF."""
    return _current


def stop() -> None:
    """Write the started timeline (if any) and go back to OFF. Blocks for the write."""
    global _current
    tl, _current = _current, OFF
    tl.close()


def mark(name: str, **args) -> None:
    """A ``wire`` mark in the started timeline (nothing when off): ``mark("send",
    peer=..., bytes=..., at=...)``. Thread-safe; never blocks."""
    if _current is not OFF:
        _current.instant(name, "wire", **args)


class Output:
    """The trace file(s) a user asked for with ``--timeline FILE``, checked at once (a path
    that cannot be written raises TimelinePathError before anything starts). ``runs``: how
    many traces the command makes; with more than one, each is FILE-LABEL.json (its PNG
    FILE-LABEL.png), else FILE (FILE's stem + .png). The processes of a run write their
    parts under a hidden folder beside FILE (``base``; given to them as ``RUDRA_TIMELINE``),
    which ``finish`` joins and removes. Not thread-safe."""

    def __init__(self, path, runs: int = 1):
        self.path, self.runs = check_path(path), runs
        self.folder = self.path.parent / f".{self.path.name}.{os.getpid()}.parts"
        self._n = 0

    def base(self) -> str:
        """A fresh base for the next run's parts (``start_from_env`` appends to it)."""
        self._n += 1
        self.folder.mkdir(mode=0o755, exist_ok=True)
        return str(self.folder / f"run{self._n}")

    def paths(self, label: str) -> tuple[Path, Path]:
        """(trace, PNG) of the run named ``label``."""
        stem = self.path.with_suffix("") if self.path.suffix == ".json" else self.path
        if self.runs > 1:
            stem = stem.with_name(f"{stem.name}-{label}")
        return (stem.with_suffix(".json") if self.runs > 1 else self.path), stem.with_suffix(".png")

    def finish(self, base: str, label: str, extra: list[dict] = ()) -> tuple[Path, dict]:
        """Join the parts of run ``base`` (and ``extra`` events) into its trace; returns the
        trace's path and ``merge``'s summary. Blocks for the files."""
        out, _ = self.paths(label)
        other = merge(out, parts_of(base), extra)
        try:
            self.folder.rmdir()  # empty once every run's parts are joined
        except OSError:
            pass
        return out, other

    def close_run(self, base: str, label: str = "run") -> str | None:
        """End run ``base`` of ``run``/``launch``: join its parts into the trace and return
        the line that names it, or (no process wrote a part) remove the parts' folder and
        return None. Blocks for the files."""
        if not parts_of(base):
            with suppress(OSError):
                self.folder.rmdir()
            return None
        path, other = self.finish(base, label)
        n, events = len(other["processes"]), other["events"]
        return f"timeline: {path} ({n} processes, {events:,} events)"


def parts_of(base) -> list[Path]:
    """The per-process files written for the timeline ``base`` (``start_from_env``)."""
    base = Path(base)
    return sorted(base.parent.glob(f"{base.name}.*.part"))


def merge(path, parts, extra: list[dict] = (), remove: bool = True) -> dict:
    """Join per-process traces (``parts``: files ``Timeline.close`` wrote) and ``extra``
    events (already trace-event dicts with their own pids, e.g. link counters) into one
    trace at ``path``, each part its own process (pid 1, 2, ...), times shifted so the
    earliest event is at 0. Removes the parts unless ``remove`` is False. Returns the
    trace's ``otherData`` (processes, events, dropped). Blocks for the files."""
    events, names, dropped = [], [], 0
    for pid, part in enumerate(parts, start=1):
        with open(part) as f:
            obj = json.load(f)
        for ev in obj["traceEvents"]:
            ev["pid"] = pid
            events.append(ev)
        names.append(obj["otherData"]["process"])
        dropped += obj["otherData"].get("dropped", 0)
    events += list(extra)
    t0 = min((ev["ts"] for ev in events if ev["ph"] != "M"), default=0)
    for ev in events:
        if ev["ph"] != "M":
            ev["ts"] -= t0
    other = {"processes": names, "events": len(events), "dropped": dropped, "t0_unix_us": t0}
    write_json_atomically(
        Path(path), {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    )
    if remove:
        for part in parts:
            Path(part).unlink(missing_ok=True)
    return other


# ----------------------------------------------------------------------------- wire hooks
def sent(peer: str, frames) -> None:
    """A message queued to ``peer`` (its encoded ``frames``: header, payloads): a ``send``
    mark with the bytes after the header. Nothing when off. Thread-safe; never blocks."""
    if _current is not OFF:
        nbytes = sum(memoryview(f).nbytes for f in frames[1:])
        _current.instant("send", "wire", peer=peer, bytes=nbytes)


def received(peer: str, msg) -> None:
    """A message (``wire.Message``) from ``peer``: a ``recv`` mark with its kind, payload
    bytes, part offset (``at``), timestamp and the request it answers. Nothing when off."""
    if _current is not OFF:
        f = msg.fields
        _current.instant("recv", "wire", peer=peer, kind=msg.kind.name, bytes=sum(p.nbytes for p in msg.payloads),
                         at=f.get("at", 0), more=bool(f.get("more")), ts=msg.ts, re=f.get("re"))  # fmt: skip
