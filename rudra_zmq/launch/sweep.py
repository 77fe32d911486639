"""``rudra-zmq sweep GRID.yaml``: one run per point of a grid of configs, under one parent.

A grid file names a base config, a shared budget and the points::

    base: ../cifar10_baseline.yaml     # relative to the grid file
    budget: 6                          # epochs for every point (train.epochs)
    set:                               # overrides for every point
      train.eval_every_epochs: 1
    points:                            # explicit points: dotted config keys (and a name)
      - {name: sigma1-mu4-l30, sync.protocol: softsync, sync.n: 1, sync.batch_size: 4}
    grid:                              # and/or a cartesian product of lists
      sync.learners: [1, 2, 4, 8]

The points are ``points`` × ``grid`` (either may be absent). ``--schedule-scale S`` runs a
compressed schedule: every point's epochs (the budget) and lr steps times S, recorded as
``train.schedule_scale`` in its config (``report`` marks it: not the paper's budget). Each runs in its own process,
real (``rudra-zmq run``) or simulated (``rudra-zmq simulate --train``, ``--simulate``), into
``PARENT/POINT/``, with its output in ``PARENT/POINT/sweep.log`` and ``point.json`` written
when it ends. A sweep is resumable: a point whose ``point.json`` says ``done`` is skipped (one
done with other settings, ``runtime.*`` aside, is refused); any other point directory (a
failed, interrupted or crashed run) is removed and run again. One
line per point is printed as it finishes; ``rudra-zmq report PARENT`` tabulates the result.
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import itertools
import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import shipped
from ..config import ConfigError, check_schedule_scale, load_config, scale_schedule
from ..results.compare import CompareError, run_summary
from ..run_files import POINT_FILE, SWEEP_FILE, SWEEP_LOG, sim_checkpoint_path
from ..typed_yaml import read_mapping

GRID_KEYS = ("base", "budget", "set", "points", "grid", "name")
# Short names for the usual keys in generated point names ("softsync-n30-mu4-l30-staleness").
_SHORT = {
    "sync.protocol": "",
    "sync.n": "n",
    "sync.batch_size": "mu",
    "sync.learners": "l",
    "optimizer.lr_policy": "",
    "optimizer.lr": "lr",
    "architecture.kind": "",
}


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its directory name and its overrides (``key=value`` strings)."""

    name: str
    overrides: tuple[str, ...]


@dataclass
class Grid:
    """A loaded grid file: the base config path, the shared budget, and the points."""

    name: str
    base: Path
    budget: float | None
    points: list[Point]  # the points to run (``select`` narrows them)
    order: list[str]  # every point's name, in the grid's order
    schedule_scale: float = 1.0  # each point's epochs and lr steps scaled by this


def _override(key: str, value) -> str:
    return f"{key}={json.dumps(value)}"  # JSON is YAML: the config parses it back exactly


def _point_name(values: dict) -> str:
    parts = []
    for key, value in values.items():
        text = "-".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(_SHORT.get(key, key.rsplit(".", 1)[-1]) + text)
    name = "-".join(parts) or "base"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def load_grid(path, budget: float | None = None, extra=(), schedule_scale: float = 1.0) -> Grid:
    """Read and check a grid file; every point's config is loaded (and so validated) here,
    before anything runs. ``budget`` and ``extra`` (``key=value`` overrides) come from the
    command line and win over the file; ``schedule_scale`` then scales each point's epochs
    (the budget) and lr steps (``config.scale_schedule``). Raises ConfigError naming the bad
    value. Does not block beyond reading files."""
    check_schedule_scale(schedule_scale)
    found = shipped.resolve("grid", str(path))
    if found is None:
        raise ConfigError(shipped.unknown("grid", str(path)))
    path = found
    data = read_mapping(path, "grid file", "configs/grids/")
    unknown = sorted(set(data) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(GRID_KEYS)}"
        )
    if "base" not in data:
        raise ConfigError(f"{path}: needs `base:`, the config file every point starts from")
    base = (path.parent / str(data["base"])).resolve()
    budget = budget if budget is not None else data.get("budget")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0
    ):
        raise ConfigError(f"{path}: budget must be a positive number of epochs, got {budget!r}")
    common = data.get("set") or {}
    points = data.get("points") or [{}]
    grid = data.get("grid") or {}
    if not isinstance(common, dict) or not isinstance(grid, dict):
        raise ConfigError(f"{path}: `set` and `grid` map dotted config keys to values")
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise ConfigError(f"{path}: `points` is a list of mappings of dotted config keys")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid key {key!r} needs a non-empty list, got {values!r}")
    out, names = [], set()
    combos = list(itertools.product(*grid.values()))
    for spec, combo in itertools.product(points, combos):
        spec = dict(spec)
        given = spec.pop("name", None)
        values = {**spec, **dict(zip(grid, combo))}
        name = _point_name(values) if given is None else str(given)
        if given is not None and len(combos) > 1:  # a named point crossed with the grid
            name = f"{given}-{_point_name(dict(zip(grid, combo)))}"
        if name in names:
            raise ConfigError(f"{path}: two points are both named {name!r}; give them names")
        names.add(name)
        overrides = [_override(k, v) for k, v in common.items()]
        overrides += [_override(k, v) for k, v in values.items()]
        if budget is not None:
            overrides.append(_override("train.epochs", float(budget)))
        overrides += list(extra)
        try:
            if schedule_scale != 1:
                overrides += scale_schedule(base, overrides, schedule_scale)
            load_config(base, overrides)
        except (ConfigError, FileNotFoundError) as exc:
            raise ConfigError(f"{path}: point {name!r}: {exc}") from None
        out.append(Point(name, tuple(overrides)))
    return Grid(
        str(data.get("name") or path.stem), base, budget, out, [p.name for p in out], schedule_scale
    )


def select(points: list[Point], patterns) -> list[Point]:
    """The points whose names match any of the shell ``patterns``; ConfigError naming a
    pattern that matches none. Pure."""
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(p.name, pat) for p in points):
            raise ConfigError(
                f"--only {pat!r} matches no point; the points are: "
                f"{', '.join(p.name for p in points)}"
            )
    return [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns)]


def _status(point_dir: Path) -> dict | None:
    try:
        return json.loads((point_dir / POINT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _experiment(overrides) -> list[str]:
    """The overrides that define a point's experiment: runtime.* (threads, transport, learners
    per process, ...) changes how a run is carried out, not what it computes."""
    return [o for o in overrides if not o.startswith("runtime.")]


def _command(
    grid: Grid, point: Point, run_dir: Path, simulate: bool, jitter: float, resume: bool = False
) -> list:
    cmd = [
        sys.executable,
        "-m",
        "rudra_zmq",
        "simulate" if simulate else "run",
        str(grid.base),
        "--run-dir",
        str(run_dir),
    ]
    if simulate:
        cmd += ["--train", "--jitter", str(jitter)] + (["--resume"] if resume else [])
    for o in point.overrides:
        cmd += ["--set", o]
    return cmd


def _line(i: int, total: int, point: Point, status: dict) -> str:
    head = f"[{i}/{total}] {point.name}: {status['status']}"
    try:
        r = run_summary(Path(status["run_dir"]))
    except (CompareError, OSError, ValueError, KeyError):
        return f"{head} (exit {status.get('exit_code')}, {status.get('wall_s', 0):.0f} s)"
    err = "-" if r["final_error"] is None else f"{100 * r['final_error']:.2f}%"
    best = "-" if r["best_error"] is None else f"{100 * r['best_error']:.2f}%"
    sigma = "-" if r["mean_sigma"] is None else f"{r['mean_sigma']:.2f}"
    epochs = "-" if r["epochs"] is None else f"{r['epochs']:.2f}"
    return (
        f"{head}  test error {err} (best {best}) at epoch {epochs}  <σ> {sigma}  "
        f"{status['wall_s']:.0f} s"
    )


def run_point(grid: Grid, point: Point, parent: Path, simulate: bool, jitter: float) -> dict:
    """Run one point in a child process (blocks until it ends) and write its point.json.
    A KeyboardInterrupt (Ctrl-C; SIGTERM or SIGHUP under ``main``) stops the child and leaves
    the point unfinished (re-run next time; a simulated one continues from its checkpoint,
    ``sim/sim_checkpoint.py``); a second one while the child stops kills it."""
    run_dir = parent / point.name
    checkpoint = sim_checkpoint_path(run_dir)
    resume = simulate and checkpoint.exists()
    if resume:  # an interrupted simulation: keep its checkpoint and log, drop the rest
        for p in run_dir.iterdir():
            if p.name not in (checkpoint.name, SWEEP_LOG):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    elif run_dir.exists():
        shutil.rmtree(run_dir)  # a broken or interrupted attempt: start the point afresh
    run_dir.mkdir(parents=True, exist_ok=True)
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.time()
    with open(run_dir / SWEEP_LOG, "a" if resume else "w") as log:
        if resume:
            log.write(f"--- {started}: the sweep resumes this point from its checkpoint\n")
            log.flush()
        child = subprocess.Popen(
            _command(grid, point, run_dir, simulate, jitter, resume),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_stoppable_by_sigint,
        )
        try:
            code = child.wait()
        except BaseException:
            # the launcher stops its roles on SIGINT, the simulator keeps its checkpoint
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=30)
            except (subprocess.TimeoutExpired, KeyboardInterrupt):  # stuck, or told again
                child.kill()
                child.wait()
            raise
    status = {
        "point": point.name,
        "overrides": list(point.overrides),
        "mode": "simulate" if simulate else "run",
        "status": "done" if code == 0 else "failed",
        "resumed": resume,  # wall_s is then this attempt's
        "exit_code": code,
        "wall_s": round(time.time() - t0, 2),
        "started": started,
        "finished": datetime.datetime.now().isoformat(timespec="seconds"),
        "run_dir": str(run_dir),
    }
    tmp = run_dir / (POINT_FILE + ".tmp")
    tmp.write_text(json.dumps(status, indent=1) + "\n")
    tmp.replace(run_dir / POINT_FILE)  # atomic: a point is done only once this exists
    return status


def sweep(
    grid: Grid, parent, *, simulate: bool = False, jitter: float = 0.0, out=sys.stdout
) -> int:
    """Run every unfinished point of ``grid`` under ``parent``, one at a time; blocks.
    Returns 0 when every point is done, 1 if any failed (the others still run)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    mode = "simulate" if simulate else "run"
    # every point of the grid, in its order (report lists them so), whichever this run does
    meta = {
        "name": grid.name,
        "base": str(grid.base),
        "budget": grid.budget,
        "mode": mode,
        "schedule_scale": grid.schedule_scale,
        "points": [{"name": name} for name in grid.order],
    }
    old = parent / SWEEP_FILE
    if old.is_file():
        prev = yaml.safe_load(old.read_text()) or {}
        if prev.get("mode") not in (None, mode):
            raise ConfigError(
                f"{parent} holds a {prev.get('mode')} sweep; give this "
                f"{mode} sweep another parent directory (--parent)"
            )
    old.write_text(yaml.safe_dump(meta, sort_keys=False, allow_unicode=True))
    failed, total = 0, len(grid.points)
    for i, point in enumerate(grid.points, 1):
        status = _status(parent / point.name)
        if status and status.get("status") == "done":
            if _experiment(status.get("overrides") or []) != _experiment(point.overrides):
                raise ConfigError(
                    f"{parent / point.name} was run with other settings "
                    f"({status.get('overrides')}); remove it, or use another --parent"
                )
            print(f"[{i}/{total}] {point.name}: done before, skipped", file=out, flush=True)
            continue
        print(
            f"[{i}/{total}] {point.name}: {'simulating' if simulate else 'running'} ...",
            file=out,
            flush=True,
        )
        status = run_point(grid, point, parent, simulate, jitter)
        failed += status["status"] != "done"
        print(_line(i, total, point, status), file=out, flush=True)
        if status["status"] != "done":
            print(f"    see {parent / point.name / 'sweep.log'}", file=out, flush=True)
    print(
        f"sweep {grid.name}: {total - failed}/{total} points done in {parent}; "
        f"`rudra-zmq report {parent}` tabulates them",
        file=out,
        flush=True,
    )
    return 1 if failed else 0


def add_parser(sub) -> None:
    """Register ``rudra-zmq sweep`` on the CLI's subparsers."""
    p = sub.add_parser(
        "sweep",
        help="run a grid of configs, one run directory per point",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "grid",
        metavar="GRID",
        help="grid file, or a built-in grid's name (table2, figure3, hardsync; see configs/grids/)",
    )
    p.add_argument(
        "--parent",
        metavar="DIR",
        help="parent of the point directories (default runs/NAME, the grid's name, "
        "runs/NAME-sim with --simulate)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="simulate each point in one process (real gradients, simulated time)",
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="--simulate: relative std of each gradient's compute time",
    )
    p.add_argument(
        "--budget",
        type=float,
        metavar="EPOCHS",
        help="epochs for every point (overrides the grid's budget)",
    )
    p.add_argument(
        "--schedule-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="scale every point's schedule: epochs (the budget) and lr steps "
        "times S in (0, 1], e.g. 0.1: 14 epochs, ÷10 at 12 and 13 for the "
        "paper's 140 (recorded; report marks it as not the paper's budget)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key in every point, e.g. --set data.root=PATH",
    )
    p.add_argument(
        "--only",
        metavar="NAME[,NAME...]",
        help="run only these points (shell patterns, e.g. 's30-*')",
    )
    p.add_argument("--list", action="store_true", help="print the points and exit")
    p.set_defaults(func=main)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def _stoppable_by_sigint():
    """In a point's child, between fork and exec: SIGINT back to its default, so that Python
    turns it into KeyboardInterrupt there. A sweep started in the background of a script
    (``rudra-zmq sweep ... &``: the shell ignores SIGINT for it) would otherwise hand its
    child an ignored SIGINT, and ``run_point``'s stop would wait 30 s and kill the child
    instead of stopping it (a simulation then loses what it did since its last checkpoint).
    The child runs in a session of its own: no terminal's Ctrl-C reaches it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _interrupted_by_term_and_hup():
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, while the block runs: a
    point's child runs in a session of its own, so `timeout` or a closed terminal reaches only
    the sweep, and ``run_point`` must pass the stop on (else the child runs on, orphaned).
    Call on the main thread."""
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(args) -> int:
    """Handler of ``rudra-zmq sweep``: exit 0 all done, 1 a point failed, 2 a bad grid;
    stopped by SIGINT, SIGTERM or SIGHUP, it stops the running point (a simulated one keeps its
    checkpoint for the next sweep) and ``rudra-zmq`` exits 128 + the signal."""
    try:
        grid = load_grid(args.grid, args.budget, args.set, args.schedule_scale)
        if args.only:
            grid.points = select(grid.points, args.only.split(","))
        if args.list:
            for p in grid.points:
                print(f"{p.name}: {' '.join(p.overrides)}")
            return 0
        parent = args.parent or f"runs/{grid.name}{'-sim' if args.simulate else ''}"
        with _interrupted_by_term_and_hup():
            return sweep(grid, parent, simulate=args.simulate, jitter=args.jitter)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"rudra-zmq: error: {exc}", file=sys.stderr)
        return 2
