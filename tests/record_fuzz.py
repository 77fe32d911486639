"""A seeded fuzzer of the records a user hands back to rudra-zmq: damaged copies of a real run's
files fed to ``replay``, ``run --resume``, ``report`` and ``compare``.

Each case copies a real run directory, damages one file the target reads in one way (a field
set to a negative, huge, NaN or mistyped value, a field or record dropped, a file truncated or
overwritten with bytes) and runs the target in this process. The outcome is

- ``ok``: the command ran to its end (exit 0, or replay's 1 "the weights differ");
- ``refused``: the documented refusal: exit 2 with one line that names the damaged file;
- ``unclear``: a refusal (exit 2) that is not one line naming the damaged file;
- ``wrong``: it ran on although what it read back is impossible (a server restored at a
  negative timestamp, a learner id beyond λ): a silent wrong result;
- ``crash``: anything else: an exception that ``rudra-zmq`` would print as a traceback.

``tests/test_fuzz_records.py`` runs a few thousand cases in seconds; as a script it runs as
many as asked, and can be pointed at an older checkout to count what it did (a target the
checkout lacks a function for is called the way that checkout's command does):

    python tests/record_fuzz.py RUN_DIR --cases 20000 --seed 1

The targets run the commands' reading paths: replay's gradients are stubbed to zeros after
their minibatch indices are taken (the data order is real: a bad step reaches it), since
recomputing them is the expensive part and reads nothing; report and compare draw their PNGs
only with ``--plots`` (the script's default; matplotlib is slow).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

TARGETS = ("replay", "resume", "report", "compare")
SERVER_FINALS = tuple(f"servers/server-{i}/ps_final.json" for i in range(4))  # a sharded run's
FILES = {  # the files of a run directory each target reads, and damages one of (those it has)
    "replay": ("config.yaml", "arrivals.bin", "ps_final.json", "weights.npy"),
    "resume": (
        "config.yaml", "ps_final.json", "metrics.jsonl", "manifest.json", "w.npy", *SERVER_FINALS
    ),
    "report": ("config.yaml", "metrics.jsonl", "point.json", "processes.json"),
    "compare": ("config.yaml", "metrics.jsonl", "ps_final.json"),
}  # fmt: skip
DAMAGED = {"processes.json": ()}  # read for its presence only: copied, never damaged
NAN, INF = float("nan"), float("inf")
JSON_VALUES = (
    -7, -1, 0, 1, 2**31, 2**63, 10**30, 1e300, -1e300, NAN, INF, -INF, 0.5, 1e-300,
    "x", "", None, True, False, [], {}, [1, "a"], {"a": 1}, [-7],
)  # fmt: skip
BAD = ("unclear", "wrong", "crash")  # outcomes that must not happen
INT32_VALUES = (-7, -1, 0, 1, 3, 7, 2**31 - 1, -(2**31), 12345)


# ----------------------------------------------------------------------------- damage
def _paths(doc, prefix=()):
    """Every place in a JSON document: (path, container) pairs, containers first."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append(prefix + (i,))
            out += _paths(v, prefix + (i,))
    return out


def damage_doc(doc, rng: random.Random):
    """A damaged copy of a JSON/YAML document: one place set to another value or dropped,
    or the whole document replaced by a value of another type; (document, what was done)."""
    doc = json.loads(json.dumps(doc))  # a deep copy
    places = _paths(doc)
    op = rng.choice(("set", "set", "set", "drop", "whole"))
    if op == "whole" or not places:
        value = rng.choice(JSON_VALUES)
        return value, f"the whole record -> {value!r:.40}"
    path = rng.choice(places)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if op == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
        return doc, f"{'.'.join(map(str, path))} dropped"
    value = rng.choice(JSON_VALUES)
    parent[path[-1]] = value
    return doc, f"{'.'.join(map(str, path))} -> {value!r:.40}"


def damage_bytes(path: Path, rng: random.Random) -> str:
    """Truncate ``path`` at a random byte, or overwrite a few of its bytes."""
    data = path.read_bytes()
    if rng.random() < 0.6 or not data:
        n = rng.randrange(len(data) + 1) if data else 0
        path.write_bytes(data[:n])
        return f"truncated to {n} of {len(data)} bytes"
    at = rng.randrange(len(data))
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    path.write_bytes(data[:at] + junk + data[at + len(junk) :])
    return f"{len(junk)} bytes overwritten at {at}"


def damage_jsonl(path: Path, rng: random.Random) -> str:
    lines = path.read_bytes().split(b"\n")
    full = [i for i, line in enumerate(lines) if line.strip()]
    if rng.random() < 0.1:
        return damage_bytes(path, rng)
    i = rng.choice(full)
    doc, what = damage_doc(json.loads(lines[i]), rng)
    lines[i] = json.dumps(doc).encode()  # NaN and Infinity as Python writes them
    path.write_bytes(b"\n".join(lines))
    return f"line {i + 1}: {what}"


def damage_json(path: Path, rng: random.Random, key: str | None = None) -> str:
    if rng.random() < 0.15:
        return damage_bytes(path, rng)
    doc = json.loads(path.read_bytes())
    if key is not None:  # a checkpoint manifest: its state, mostly
        inner, what = damage_doc(doc[key], rng)
        doc[key] = inner
        what = f"{key}.{what}"
    else:
        doc, what = damage_doc(doc, rng)
    path.write_text(json.dumps(doc))
    return what


def damage_yaml(path: Path, rng: random.Random) -> str:
    if rng.random() < 0.15:
        return damage_bytes(path, rng)
    doc, what = damage_doc(yaml.safe_load(path.read_text()), rng)
    path.write_text(yaml.safe_dump(doc))
    return what


def damage_arrivals(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    r = rng.random()
    if r < 0.15:
        return damage_bytes(path, rng)
    if r < 0.2:  # a restarted PS's header and events appended
        path.write_bytes(bytes(data) + bytes(data[:16]) + bytes(data[16:48]))
        return "a second header appended"
    events = (len(data) - 16) // 16
    i, field = rng.randrange(events), rng.randrange(4)
    value = rng.choice(INT32_VALUES)
    at = 16 + 16 * i + 4 * field
    data[at : at + 4] = int(value).to_bytes(4, "little", signed=True)
    path.write_bytes(bytes(data))
    return f"event {i} {('kind', 'learner', 'ts', 'step')[field]} -> {value}"


def damage_npy(path: Path, rng: random.Random) -> str:
    w = np.load(path)
    r = rng.random()
    if r < 0.4:
        return damage_bytes(path, rng)
    with open(path, "wb") as f:
        if r < 0.55:
            np.save(f, w.astype(np.float64))
            return "saved as float64"
        if r < 0.7:
            np.save(f, w[: rng.randrange(len(w))])
            return "fewer values"
        if r < 0.8:
            np.save(f, w.reshape(-1, 1) if len(w) else w)
            return "2-D"
        if r < 0.9:
            np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
            return "an object array (pickle)"
        np.save(f, np.full_like(w, np.nan))
        return "every value NaN"


def damage(run: Path, name: str, rng: random.Random) -> str:
    """Damage the file ``name`` of the run directory ``run`` (a copy); what was done. A run's
    ``ps_final.json`` is sometimes removed instead (a sharded run's servers' are then read)."""
    if name == "manifest.json":
        path = newest_checkpoint(run, rng) / name
        return f"{name}: {damage_json(path, rng, 'meta' if rng.random() < 0.85 else None)}"
    if name == "w.npy":
        return f"{name}: {damage_bytes(newest_checkpoint(run, rng) / name, rng)}"
    path = run / name
    if name == "ps_final.json" and rng.random() < 0.1:
        path.unlink()
        return f"{name}: removed"
    how = {
        ".jsonl": damage_jsonl,
        ".json": damage_json,
        ".yaml": damage_yaml,
        ".bin": damage_arrivals,
        ".npy": damage_npy,
    }[path.suffix]
    return f"{name}: {how(path, rng)}"


def newest_checkpoint(run: Path, rng: random.Random) -> Path:
    """The newest checkpoint of the run's only server, or of one of its ranges (sharded)."""
    root = run / "checkpoints"
    dirs = [root] if list(root.glob("ckpt-*")) else sorted(root.glob("range-*"))
    return sorted(rng.choice(dirs).glob("ckpt-*"))[-1]


# ----------------------------------------------------------------------------- targets
class Refused(Exception):
    """The command's documented refusal: exit 2 and the message it printed."""


def _refusals():
    """The exception types each command turns into its one-line refusal (exit 2), as far as
    this checkout has them."""
    from rudra_zmq.config import ConfigError
    from rudra_zmq.results.compare import CompareError
    from rudra_zmq.sim.replay import ReplayError

    types = [ConfigError, CompareError, ReplayError, FileNotFoundError]
    with contextlib.suppress(ImportError):
        from rudra_zmq.results.record_fields import DamagedRecord

        types.append(DamagedRecord)
    return tuple(types)


def _cli(func, args) -> int:
    """Run a command's function as ``rudra-zmq`` does; Refused for exit 2 (its stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = func(args)
    if rc == 2:
        raise Refused(err.getvalue())
    return rc


def run_replay(run: Path, plots: bool) -> None:
    from rudra_zmq.sim import replay

    rc = _cli(replay.cmd_replay, argparse.Namespace(run_dir=str(run), until=None, out=None))
    assert rc in (0, 1), rc


def run_resume(run: Path, plots: bool) -> None:
    """What ``run --resume RUN --set train.epochs=3`` reads before and as its roles start:
    the launcher's checks, then the PS's state from its checkpoint and the statistics
    server's clock from the metrics."""
    from rudra_zmq.launch import resume
    from rudra_zmq.run_files import metrics_path
    from rudra_zmq.server.start import start_state
    from rudra_zmq.stats.metrics_file import run_clock

    try:
        cfg = resume.resume_config(run, None, ["train.epochs=3"])
        if resume.finished_note(run, cfg) is not None:
            return
        resume.check_records(run, cfg)
    except _refusals() as exc:
        raise Refused(str(exc)) from None
    for server in range(cfg.architecture.servers):  # each server from its range's checkpoint
        try:  # the server's own refusal: a checkpoint of another model or range (one line)
            state = start_state(cfg, MODEL["source"], run, True, server)[0]
        except ValueError as exc:
            raise Refused(str(exc)) from None
        eng = state.engine
        if not (
            eng.timestamp >= 0
            and all(0 <= m < cfg.sync.learners for m in eng.members)
            and all(0 <= k < cfg.sync.learners and v >= 0 for k, v in state.steps.items())
        ):
            raise Wrong(
                f"server {server} restored timestamp {eng.timestamp}, members {sorted(eng.members)}"
            )
    run_clock(metrics_path(run))


class Wrong(Exception):
    """A command went on with state that cannot be (a silent wrong result)."""


MODEL: dict = {}  # "source": the undamaged run's model (weights, segments, signature)


def run_report(run: Path, plots: bool) -> None:
    from rudra_zmq.results import report

    if plots:
        out = run / "report-out"
        _cli(report.cmd_report, argparse.Namespace(paths=[str(run)], out=str(out), budget=None))
        return
    try:
        runs = report.load_runs([run])
    except _refusals() as exc:
        raise Refused(str(exc)) from None
    rows = [report.table_row(r) for r in runs]
    report.format_markdown(rows)
    report.write_csv(rows, run / "report.csv")


def run_compare(run: Path, plots: bool) -> None:
    from rudra_zmq.results import compare

    if plots:
        args = argparse.Namespace(run_dirs=[str(run)], output=str(run / "c.png"), csv=None)
        _cli(compare.cmd_compare, args)
    else:
        try:
            rows = [compare.run_summary(run)]
        except _refusals() as exc:
            raise Refused(str(exc)) from None
        compare.format_table(rows)
    compare.result_line(run)  # the launcher's last line: never raises


RUNNERS = {"replay": run_replay, "resume": run_resume, "report": run_report, "compare": run_compare}


@contextlib.contextmanager
def fast_gradients():
    """Replay's gradients as zeros, once their minibatch indices are taken (the data order
    still sees every (learner, step)): recomputing them is replay's cost, not its reading."""
    from rudra_zmq.sim import sim_trainer

    real = sim_trainer.Trainer._compute

    def compute(self, weights, members):
        s = self.cfg.sync
        for i, k in members:
            self.stream.batch(i, k, s.learners, s.batch_size)
        return np.zeros(self._flat().numel, np.float32)

    sim_trainer.Trainer._compute = compute
    try:
        yield
    finally:
        sim_trainer.Trainer._compute = real


def outcome(target: str, run: Path, damaged: str, plots: bool) -> tuple[str, str]:
    """(``ok`` | ``refused`` | ``unclear`` | ``wrong`` | ``crash``, detail) of one target on
    ``run``, whose
    file ``damaged`` was damaged: a refusal must be one line that names that file."""
    try:
        RUNNERS[target](run, plots)
    except Refused as exc:
        text = str(exc).strip()
        if "\n" in text or damaged not in text:
            return "unclear", f"a refusal that is not one line naming {damaged}: {text!r:.400}"
        return "refused", text
    except Wrong as exc:
        return "wrong", str(exc)
    except Exception:  # noqa: BLE001 -- what a user would see as a traceback
        return "crash", traceback.format_exc(limit=-3)
    return "ok", ""


def fuzz(source: Path, cases: int, seed: int, plots: bool = False, targets=TARGETS):
    """Run ``cases`` damaged copies of the run ``source`` through ``targets`` (in turn);
    returns ``Counter((target, outcome))`` and the first few ``BAD`` outcomes as
    ``(target, damage, detail)``. Blocks; writes in a temporary directory only."""
    from rudra_zmq.config import load_config
    from rudra_zmq.server.start import initial_model

    rng = random.Random(seed)
    counts, bad = Counter(), []
    MODEL["source"] = initial_model(load_config(source / "config.yaml"))[:3]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # many small files: in memory
    logging.disable(logging.WARNING)  # the readers' warnings (skipped lines, notices)
    with (
        tempfile.TemporaryDirectory(prefix="record-fuzz-", dir=shm) as tmp,
        fast_gradients(),
        contextlib.ExitStack() as undo,
    ):
        undo.callback(logging.disable, logging.NOTSET)
        for n in range(cases):
            target = targets[n % len(targets)]
            run = Path(tmp) / f"case{n}"
            run.mkdir()
            held = []  # the files of FILES[target] this run has
            for name in FILES[target]:
                if name in ("manifest.json", "w.npy"):
                    if not (source / "checkpoints").exists():
                        continue
                    if not (run / "checkpoints").exists():
                        shutil.copytree(source / "checkpoints", run / "checkpoints")
                elif (source / name).exists():
                    (run / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source / name, run / name)
                else:
                    continue
                held.append(name)
            if target == "resume" and (source / "servers").is_dir():  # the joined weights
                for d in (source / "servers").iterdir():  # of a run whose own were removed
                    if (d / "weights.npy").exists():
                        (run / "servers" / d.name).mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(d / "weights.npy", run / "servers" / d.name / "weights.npy")
            name = rng.choice([f for f in held if f not in DAMAGED])
            what = damage(run, name, rng)
            kind, detail = outcome(target, run, name, plots)
            counts[target, kind] += 1
            if kind in BAD and len(bad) < 50:
                bad.append((target, what, detail))
            shutil.rmtree(run, ignore_errors=True)
    return counts, bad


def prepare(run_dir: Path, out: Path) -> Path:
    """A copy of the run ``run_dir`` with what the fuzzer damages: its own files, and a
    sweep's ``point.json`` for it as ``sweep`` writes one (report reads it)."""
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("*.png", "logs", "tensorboard"))
    if not (out / "point.json").exists():
        point = {
            "point": "fuzzed",
            "overrides": [],
            "mode": "run",
            "status": "done",
            "resumed": False,
            "exit_code": 0,
            "wall_s": 12.5,
            "started": "2026-01-01T00:00:00",
            "finished": "2026-01-01T00:00:13",
            "run_dir": str(run_dir),
        }
        (out / "point.json").write_text(json.dumps(point, indent=1) + "\n")
    return out


def summary(counts: Counter) -> list[str]:
    lines = []
    for target in TARGETS:
        row = {k: counts[target, k] for k in ("ok", "refused", *BAD)}
        total = sum(row.values())
        if total:
            lines.append(
                f"{target:<8} {total:6d} cases: " + ", ".join(f"{k} {v}" for k, v in row.items())
            )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a finished Rudra-base run (with checkpoints)")
    ap.add_argument("--cases", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-plots", action="store_true", help="report/compare without PNGs")
    ap.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    ap.add_argument("--show", type=int, default=5, help="crashes and wrongs to print")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        source = prepare(Path(args.run_dir), Path(tmp) / "run")
        counts, bad = fuzz(source, args.cases, args.seed, not args.no_plots, tuple(args.targets))
    print(f"record fuzz: {args.cases} cases, seed {args.seed}, run {args.run_dir}")
    print("\n".join(summary(counts)))
    for target, what, detail in bad[: args.show]:
        print(f"--- {target}: {what}\n{detail.rstrip()}")
    return 1 if any(k in BAD for _, k in counts) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
