"""A run's ``metrics.jsonl`` read back: its records by type, and its clock of training time.

The record types are listed in ``rudra_zmq.results.plots``; a sharded run's servers other
than 0 file their ``update`` and ``ps`` records under ``server_update``/``server_ps``
(``other_server``). ``t`` is wall seconds since the run started, across PS restarts and
``rudra-zmq run --resume`` (absolute Unix times are accepted too: they are shifted so the
earliest record is 0).

Training time (:class:`TrainingClock`) counts only the periods in which the parameter server
applied updates. A run is cut into periods by its ``resume`` records (``rudra-zmq run
--resume``); in each, training starts with the first ``update`` record and ends with the last
``update`` or ``eval`` record. What lies before a period's training is start-up
(processes starting until the first update); what lies between the end of one period and the
next ``resume`` is idle time between the runs, counted nowhere. A PS restarted by the
launcher within a run is part of its training time: the run was going on. A simulation, which
writes update and eval records only, has no start-up: its clock starts with training.

Pure: no clocks, no sockets; ``read_metrics`` reads one file.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

from ..config import ConfigError, load_config, to_dict
from ..run_files import METRICS_FILE, PS_FINAL_FILE, config_path
from ..wire_kinds import copy_holder_sender
from . import record_fields as fields

log = logging.getLogger(__name__)

KNOWN_TYPES = ("update", "eval", "learner", "ps", "members", "restart", "resume")

# What each known record carries, as its writers write it (the PS: ``server.report``,
# ``sync.Update.record``; the statistics server: eval, start, resume; learners: learner; the
# simulator: update, eval); ``plots`` lists them. A record must carry the fields it means
# nothing without (an update's or an eval's ts, an eval's test error, ...); any field it
# carries must hold what its writer writes. A float a writer could not make finite is
# written as null (``stats.metrics_file.json_line``). ``t`` may be negative (a sender's clock behind
# the statistics server's, on another host) or a Unix time. The statistics server refuses a
# record that breaks these before writing it; ``read_metrics`` refuses a file that holds one.
_T = fields.number(-fields.NUMBER_MAX).optional()
_TS = fields.integer().optional()
_EPOCH = fields.number().optional()
_RATE = fields.number().or_null().optional()
_INT = fields.integer().optional()
_COUNTERS = {
    k: _INT
    for k in ("invalid", "duplicates", "evictions", "lost_updates", "too_stale", "evals_sent")
}
_SERVER = {"server": _INT}
RECORD_FIELDS = {
    "update": {
        "ts": fields.integer(),
        "t": _T,
        "epoch": _EPOCH,
        "mean_sigma": _RATE,
        "sigmas": fields.numbers().optional(),  # integers, as the engine counts them
        "lr": _RATE,
        "n_grads": _INT,
        "protocol": fields.text().optional(),
        **_SERVER,
    },
    "eval": {
        "ts": fields.integer(),
        "t": _T,
        "epoch": _EPOCH,
        "test_error": fields.number(0.0, 1.0),
        "test_loss": fields.number(-fields.NUMBER_MAX).or_null().optional(),
        "weights": fields.text().optional(),
        "server_ts": fields.integers().optional(),
    },
    "learner": {
        "learner": fields.integer(),
        "t": _T,
        "step": _INT,
        "ts": _INT,
        "samples_per_s": _RATE,
        "loss": fields.number(-fields.NUMBER_MAX).or_null().optional(),
    },
    "ps": {
        "t": _T,
        "ts": _TS,
        "updates_per_s": _RATE,
        "gradients_per_s": _RATE,
        **_COUNTERS,
        **_SERVER,
    },
    "members": {
        "t": _T,
        "ts": _TS,
        "epoch": _EPOCH,
        "learner": _INT,
        "event": fields.text("evicted", "joined"),
        "learners": _INT,
        "c": _INT,
        # which of its server's λ changes (server.journal; absent in runs before they were kept)
        "incarnation": fields.integer(1).optional(),
        "n": fields.integer(1).optional(),
        "source": fields.text().optional(),  # read from the server's file: its record was lost
        **_SERVER,
    },
    "restart": {
        "t": _T,
        "ts": _TS,
        "epoch": _EPOCH,
        "incarnation": fields.integer(1).optional(),
        "checkpoint": fields.text().or_null().optional(),
        "from": fields.text().optional(),  # checkpoint, learner L, tree node N or initial
        "lost": fields.integer().optional(),
        **_SERVER,
    },
    "resume": {"t": _T},
    "start": {"t": _T, "unix": fields.number()},
    "done": {
        "t": _T,
        "ts": _TS,
        "epoch": _EPOCH,
        "source": fields.text().optional(),
        **_COUNTERS,
        **_SERVER,
    },
}


def check_record(r: dict, where: str) -> dict:
    """``r`` (a record with a string ``type``) when its fields are what ``RECORD_FIELDS``
    says of its type (a type not listed there is not looked at); raises
    record_fields.DamagedRecord naming ``where``, the field and its value. Pure."""
    kind = r["type"]
    declared = RECORD_FIELDS.get(kind)
    if declared is None:
        return r
    return fields.check(
        r, declared, f"{where} ({'an' if kind[0] in 'aeiou' else 'a'} {kind} record)"
    )


_ABSOLUTE_T = 1e9  # t values beyond this are Unix times (after 2001), not seconds since start
REAL_RUN_TYPES = ("start", "ps", "learner", "done")  # a simulation writes update and eval only
END_TYPES = ("update", "eval")  # the last of these ends a period of training


class Metrics(dict):
    """``{type: [record, ...]}`` in file order; the known types are always present.

    ``malformed`` counts the lines that were skipped (not JSON, not an object, no ``type``);
    ``truncated`` says whether the last line was cut off (a crash mid-write); it is one of them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.malformed = 0
        self.truncated = False


SERVER_TYPES = ("update", "ps")  # a sharded run's: server 0's stand for the run


def other_server(r: dict) -> bool:
    """Whether ``r`` is a sharded run's ``update`` or ``ps`` record of a server other than 0:
    server 0's stream stands for the run's (one timestamp, as with one server), the others'
    are kept apart (here, in progress lines, in TensorBoard)."""
    server = r.get("server")
    return r.get("type") in SERVER_TYPES and isinstance(server, int) and server != 0


def _kind(r: dict) -> str:
    """The key a record is filed under: its type, or ``server_update``/``server_ps`` for
    :func:`other_server`'s."""
    return f"server_{r['type']}" if other_server(r) else r["type"]


def read_metrics(path) -> Metrics:
    """Parse ``metrics.jsonl`` (or the one inside a run directory) into records by type.

    Tolerates a truncated last line and skips malformed lines (not JSON, not an object, no
    string ``type``: what a writer killed mid-line leaves), counting them (and logging a
    warning) rather than failing: a crashed run's metrics are still worth plotting. A record
    whose fields are not what its writer writes (``RECORD_FIELDS``: a negative, huge, NaN,
    missing or mistyped value) is no crash's doing: it raises record_fields.DamagedRecord
    naming the file, the line, the field and the value. Records of type ``batch``
    (``{"type": "batch", "items": [...]}``) are unpacked into their items.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    out = Metrics({k: [] for k in KNOWN_TYPES})
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            rec = None
        if (
            isinstance(rec, dict)
            and rec.get("type") == "batch"
            and isinstance(rec.get("items"), list)
        ):
            records = rec["items"]
        else:
            records = [rec]
        for r in records:
            if not isinstance(r, dict) or not isinstance(r.get("type"), str):
                out.malformed += 1
                if i == len(lines) - 1:  # no newline after it: the writer died mid-line
                    out.truncated = True
                elif out.malformed <= 5:
                    log.warning("%s:%d: skipping a malformed metrics line: %.80r", path, i + 1, raw)
                continue
            check_record(r, f"{path} line {i + 1}")
            out.setdefault(_kind(r), []).append(r)
    if out.truncated:
        log.warning("%s: the last line is truncated (did the run crash?); skipped it", path)
    if out.malformed - out.truncated > 5:
        log.warning("%s: skipped %d malformed lines in all", path, out.malformed - out.truncated)
    return out


# ps_final.json as the PS (``server.end_files.write_final``) and a sharded run's last server
# (``end_files.assemble``: every server's own under "servers") write it.
FINAL_FIELDS = {
    "timestamp": fields.integer(),
    "epoch": fields.number(),
    "updates": fields.integer().optional(),
    "done": fields.flag(),
    "incarnation": fields.integer(1).optional(),
    "parts": fields.mapping().optional(),
    "restarts": fields.Field(
        "a list of restarts {server, from, ts, lost}",
        lambda v: isinstance(v, list) and all(_restart_ok(r) for r in v),
    ).optional(),
}


# one restart of a server (``server/restart_record.py``), in ps_final.json's ``restarts``
RESTART_FIELDS = {
    "server": fields.integer(),
    "from": fields.Field(
        "checkpoint, initial, learner L or tree node N",
        lambda v: (
            isinstance(v, str)
            and (v in ("checkpoint", "initial") or copy_holder_sender(v) is not None)
        ),
    ),
    "ts": fields.integer(),
    "lost": fields.integer(),
    "incarnation": fields.integer(1).optional(),
    "t": fields.number().optional(),  # Unix time (the statistics server makes it its record's)
    "epoch": _EPOCH,
    "checkpoint": fields.text().or_null().optional(),
}


def _restart_ok(r) -> bool:
    try:
        fields.check(r, RESTART_FIELDS, "restart")
    except fields.DamagedRecord:
        return False
    return True


def check_restarts(value, where: str) -> list:
    """``value`` when it is a list of restart records (``RESTART_FIELDS``); raises
    record_fields.DamagedRecord naming ``where`` otherwise. Pure."""
    if not isinstance(value, list):
        raise fields.DamagedRecord(f"{where}: restarts is {fields.shown(value)}; expected a list")
    for i, r in enumerate(value):
        fields.check(r, RESTART_FIELDS, f"{where}, restarts[{i}]")
    return value


def load_final(run_dir) -> dict | None:
    """``RUN_DIR/ps_final.json`` checked (``FINAL_FIELDS``, and each entry of a sharded
    run's ``servers`` alike); None when there is none. Raises record_fields.DamagedRecord
    naming the file, the field and its value for a damaged one. Reads one small file."""
    path = Path(run_dir) / PS_FINAL_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise fields.DamagedRecord(f"{path} cannot be read: {exc}") from None
    try:
        final = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError too
        raise fields.DamagedRecord(f"{path} is not JSON ({exc}): truncated or damaged") from None
    fields.check(final, FINAL_FIELDS, str(path))
    servers = final.get("servers", [])
    if "servers" in final and not (isinstance(servers, list) and servers):
        raise fields.DamagedRecord(
            f"{path}: servers is {fields.shown(servers)}; expected a list of each server's "
            "final state"
        )
    for i, each in enumerate(servers):
        fields.check(each, FINAL_FIELDS, f"{path}, servers[{i}]")
    return final


def read_config(run_dir) -> dict | None:
    """The run's ``config.yaml`` as a plain dict (every key, defaults included), None when
    there is none. It is checked as ``rudra-zmq run`` checks a config (``config.load_config``:
    every key known, every value of its type and range), without importing a model or
    dataset named by import path, so a damaged one raises record_fields.DamagedRecord naming
    the file, the key and the value. Reads one file; imports no torch."""
    path = config_path(run_dir)
    if not path.is_file():
        return None
    try:
        return to_dict(load_config(path, user_code=False))
    except (ConfigError, OSError) as exc:
        text = str(exc)
        raise fields.DamagedRecord(text if str(path) in text else f"{path}: {text}") from None


def num(x) -> float | None:
    """``x`` as a float when it is a number (not a bool), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def sigma_sum(update) -> tuple[float, int]:
    """(sum of per-gradient staleness, number of gradients) of one update record."""
    sigmas = update.get("sigmas")
    if isinstance(sigmas, list) and sigmas:
        vals = [s for s in map(num, sigmas) if s is not None]
        return sum(vals), len(vals)
    mean, n = num(update.get("mean_sigma")), num(update.get("n_grads"))
    if mean is None:
        return 0.0, 0
    n = int(n) if n else 1
    return mean * n, n


class Period:
    """One period of a run: from ``begin`` (0, or its ``resume`` record) to the next resume;
    training in it from ``start`` to ``end`` (both None when it never trained)."""

    def __init__(self, begin: float):
        self.begin = begin
        self.start: float | None = None
        self.end: float | None = None

    @property
    def trained_s(self) -> float:
        return 0.0 if self.start is None else self.end - self.start


class TrainingClock:
    """Seconds of training at each point of a run's clock, from its records (``Metrics``).

    ``periods``: the run's periods (module docstring), oldest first. ``startup_s``: seconds of
    start-up in all (None for a simulation, or a run that never trained). ``breaks``: one
    ``(at, idle_s, startup_s)`` per resume after some training: the training seconds where it
    falls, the idle seconds before the resume and the start-up after it.
    """

    def __init__(self, metrics):
        self.offset = _offset(metrics)
        real = self.offset > 0.0 or any(metrics.get(kind) for kind in REAL_RUN_TYPES)
        resumes = sorted(t for r in metrics.get("resume", []) if (t := self._t(r)) is not None)
        self.periods = [Period(0.0)] + [Period(t) for t in resumes]
        begins = [p.begin for p in self.periods]
        for kind in END_TYPES:
            for r in metrics.get(kind, []):
                t = self._t(r)
                if t is None:
                    continue
                p = self.periods[max(bisect.bisect_right(begins, t) - 1, 0)]
                if kind == "update":
                    p.start = t if p.start is None else min(p.start, t)
                p.end = t if p.end is None else max(p.end, t)
        for p in self.periods:
            if p.start is None:
                p.end = None
            elif not real and p is self.periods[0]:
                p.start = 0.0  # a simulation's clock starts with training
        trained = [p for p in self.periods if p.start is not None]
        self.startup_s = sum(p.start - p.begin for p in trained) if real and trained else None
        self.breaks = []
        done = 0.0
        for prev, p in zip(self.periods, self.periods[1:]):
            done += prev.trained_s
            last_end = max(
                (q.end for q in self.periods if q.end is not None and q.end <= p.begin),
                default=None,
            )
            if last_end is not None:
                self.breaks.append(
                    (done, p.begin - last_end, None if p.start is None else p.start - p.begin)
                )

    def _t(self, r) -> float | None:
        t = num(r.get("t"))
        return None if t is None else t - self.offset

    @property
    def trained_s(self) -> float:
        """Seconds of training in all."""
        return sum(p.trained_s for p in self.periods)

    def at(self, t, during: bool = False) -> float | None:
        """Seconds of training up to ``t`` (a record's ``t``, shifted like the records): a
        time before its period's training counts as its start, one after as its end; with
        ``during``, None for those instead (and for a ``t`` that is not a number)."""
        t = num(t)
        if t is None:
            return None
        t -= self.offset
        i = max(bisect.bisect_right([p.begin for p in self.periods], t) - 1, 0)
        before = sum(p.trained_s for p in self.periods[:i])
        p = self.periods[i]
        if not any(q.start is not None for q in self.periods):
            return None if during else t  # it never trained: the run's clock as it is
        if p.start is None or t < p.start or t > p.end:
            if during:
                return None
            if p.start is None or t < p.start:
                return before
            return before + p.trained_s
        return before + t - p.start


def _offset(metrics) -> float:
    """What to subtract from ``t``: 0, or the earliest t when the records hold Unix times."""
    ts = [t for recs in metrics.values() for r in recs if (t := num(r.get("t"))) is not None]
    return min(ts) if ts and min(ts) > _ABSOLUTE_T else 0.0


def startup_s(metrics) -> float | None:
    """Seconds of start-up: from the start of the run (and of each resume) to its first
    ``update`` record; None for a simulation (no start-up) or a run that never trained."""
    return TrainingClock(metrics).startup_s


def time_origin(metrics) -> float:
    """What to subtract from a record's ``t`` of the run's first period for seconds since
    training started (since the start of the run where ``startup_s`` is None)."""
    clock = TrainingClock(metrics)
    first = clock.periods[0].start
    return clock.offset + (first if first is not None and clock.startup_s is not None else 0.0)
