"""``rudra-zmq compare RUN_DIR ...``: runs side by side, as a protocol study reads them.

One table row per run directory -- protocol, λ, µ, learning-rate policy, how far it trained,
final and best test error, the average staleness ⟨σ⟩ over all its gradients, start-up, wall
time since training started and seconds per epoch of it -- and one PNG with the runs' test
error against epoch and against time since training started (``compare_runs``). Start-up
(processes starting until the parameter server's first update, ``plots.startup_s``) is
reported apart, so runs that started up slower or faster compare on their training alone.
Reads only what a run wrote (``config.yaml``, ``metrics.jsonl``), so it works on finished,
stopped and crashed runs alike; nothing is imported from torch. A parent directory (a
sweep's) stands for the runs inside it (``expand_run_dirs``, which ``rudra-zmq report`` uses
too).
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import yaml

from ..run_files import METRICS_FILE, SWEEP_FILE
from ..sync import protocol_label
from . import plots
from .record_fields import DamagedRecord
from .records import load_final

COLUMNS = (
    "run",
    "protocol",
    "learners",
    "batch",
    "lr_policy",
    "lr",
    "epochs",
    "final_error",
    "best_error",
    "mean_sigma",
    "restarts",
    "startup_s",
    "wall_s",
    "s_per_epoch",
)
log = logging.getLogger(__name__)


class CompareError(ValueError):
    """A run directory that cannot be compared (the message names it and says why). A
    damaged record in it is record_fields.DamagedRecord."""


def read_config(run_dir: Path) -> dict:
    """The run's ``config.yaml`` as a plain dict ({} when there is none), checked
    (``records.read_config``: raises record_fields.DamagedRecord for a damaged one)."""
    return plots.read_config(run_dir) or {}


def config_value(cfg: dict, section: str, key: str):
    """``cfg[section][key]`` of a ``read_config`` dict, or None where either is missing."""
    sec = cfg.get(section)
    return sec.get(key) if isinstance(sec, dict) else None


def protocol_name(cfg: dict, paper: bool = False) -> str:
    """``hardsync``, ``softsync n=2`` (``2-softsync`` as the paper writes it, with ``paper``)
    or ``async``, then what changes it during the run (``, then hardsync@2`` for a schedule,
    ``, n for <σ>≈2`` for a target staleness, ``, σ≤4`` for a bound), with the architecture
    when not base."""
    protocol, n = config_value(cfg, "sync", "protocol") or "?", config_value(cfg, "sync", "n")
    name = f"{n}-softsync" if paper and protocol == "softsync" else protocol_label(protocol, n)
    for stage in config_value(cfg, "sync", "schedule") or ():
        epoch, _, rest = str(stage).partition(" ")
        name += f", then {rest.replace(' ', ' n=')}@{epoch}"
    if (target := config_value(cfg, "sync", "target_staleness")) is not None:
        name += f", n for <σ>≈{target:g}" if isinstance(target, int | float) else ""
    if (bound := config_value(cfg, "sync", "max_staleness")) is not None:
        name += f", σ≤{bound}"
    arch = config_value(cfg, "architecture", "kind")
    return name if arch in (None, "base") else f"{name} ({arch})"


def _checked(run_dir) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise CompareError(
            f"{run_dir}: no {METRICS_FILE} here; give the run directories that "
            "`rudra-zmq run` or `simulate` printed"
        )
    return run_dir


def is_run_dir(path, markers=(METRICS_FILE,)) -> bool:
    """Whether ``path`` holds one of the files ``markers`` that make a directory a run."""
    return any((Path(path) / m).is_file() for m in markers)


def _sweep_order(parent: Path, names) -> list[str]:
    """``names`` in the order of the parent's ``sweep.yaml`` points (sweep.py writes
    ``points: [{name: ...}, ...]``), the others after them by name (all by name without a
    readable sweep.yaml)."""
    try:
        grid = yaml.safe_load((parent / SWEEP_FILE).read_text())
    except OSError:
        grid = None
    except yaml.YAMLError as exc:
        log.warning("%s: not valid YAML (%s); runs in name order", parent / SWEEP_FILE, exc)
        grid = None
    points = grid.get("points") if isinstance(grid, dict) else None
    listed = (
        [p["name"] for p in points if isinstance(p, dict) and "name" in p]
        if isinstance(points, list)
        else []
    )
    rank = {str(name): i for i, name in reversed(list(enumerate(listed)))}
    return sorted(names, key=lambda n: (rank.get(n, math.inf), n))


def expand_run_dirs(paths, markers=(METRICS_FILE,)) -> list[Path]:
    """The run directories that ``paths`` name: each path is a run directory (it holds one of
    ``markers``) or a parent of run directories, such as a sweep's, which stands for its
    immediate subdirectories that are runs, in ``sweep.yaml``'s point order when it has one,
    else by name. Raises CompareError naming a path that is neither. Reads directory
    listings and ``sweep.yaml`` only."""
    out = []
    for path in map(Path, paths):
        if is_run_dir(path, markers):
            out.append(path)
            continue
        runs = {
            d.name: d
            for d in (path.iterdir() if path.is_dir() else ())
            if d.is_dir() and is_run_dir(d, markers)
        }
        if not runs:
            what = " or ".join(markers)
            raise CompareError(
                f"{path}: no {what} here, nor in any subdirectory; give run "
                "directories that `rudra-zmq run` or `simulate` printed, or "
                "the parent directory that holds them (a sweep's)"
            )
        out += [runs[name] for name in _sweep_order(path, runs)]
    return out


def add_run_dirs_argument(parser, dest: str, metavar: str) -> None:
    """The positional argument of run paths that ``expand_run_dirs`` reads (compare, report)."""
    parser.add_argument(
        dest,
        nargs="+",
        metavar=metavar,
        help="run directories, or a parent directory of runs (a sweep's)",
    )


def mean_sigma(metrics, server: int | None = None) -> float | None:
    """⟨σ⟩ of a run: the mean staleness over every gradient of its update records (None
    when it has none); of a sharded run, server 0's, or ``server``'s (each has its own
    timestamp and σ)."""
    ups = metrics["update"]
    if server:
        ups = [u for u in metrics.get("server_update", []) if u.get("server") == server]
    total, count = 0.0, 0
    for u in ups:
        s, n = plots.sigma_sum(u)
        total, count = total + s, count + n
    return total / count if count else None


def server_sigmas(metrics) -> list[float | None]:
    """Each server's ⟨σ⟩ in a sharded run (server 0 first); [] for a run of one server."""
    others = {u.get("server") for u in metrics.get("server_update", [])}
    if not others:
        return []
    return [mean_sigma(metrics, k) for k in range(max(others) + 1)]


def server_restarts(run_dir) -> list[dict]:
    """The restarts ``ps_final.json`` lists (each ``{"server", "from", "ts", "lost"}``: a
    server restarted during the run, from a checkpoint, its learners' copy of its range or
    the initial weights, and the updates it lost); [] when there is no file or none.
    Raises record_fields.DamagedRecord for a damaged ``ps_final.json``."""
    final = load_final(run_dir)
    return list(final.get("restarts", [])) if final is not None else []


def restarts_text(restarts: list[dict], servers: bool) -> str:
    """``server 1 from learner 0 at ts 40, 3 updates lost; ...`` (``servers``: a sharded
    run, as is one whose restarts name a server other than 0 though its records hold no
    other server's updates; else ``the parameter server from ...``). Pure."""
    servers = servers or any(r.get("server") for r in restarts)
    return "; ".join(
        f"{'server ' + str(r['server']) if servers else 'the parameter server'} from "
        f"{r['from']} at ts {r['ts']}, {r['lost']} updates lost"
        for r in restarts
    )


def restarts_cell(restarts: list[dict]) -> str:
    """The ``restarts`` cell: how many, and the updates they lost (``0``: none)."""
    if not restarts:
        return "0"
    return f"{len(restarts)} ({sum(r['lost'] for r in restarts)} lost)"


def ps_final(run_dir, metrics) -> dict | None:
    """Where training ended -- the PS's final timestamp and epoch, from ``ps_final.json`` (its
    own state), else from its ``done`` record -- with the test error of the evaluation of those
    final weights (None when they were never evaluated); None where the run did not finish.
    Raises record_fields.DamagedRecord for a damaged ``ps_final.json``."""
    final = load_final(run_dir)
    if final is not None:
        ts, epoch = final["timestamp"], final["epoch"]
    else:
        done = [
            r
            for r in metrics.get("done", [])
            if isinstance(r.get("ts"), int) and plots._num(r.get("epoch")) is not None
        ]
        if not done:
            return None
        ts, epoch = done[-1]["ts"], done[-1]["epoch"]
    at_end = [
        r
        for r in metrics["eval"]
        if r.get("ts") == ts and plots._num(r.get("test_error")) is not None
    ]
    return {
        "epoch": float(epoch),
        "ts": ts,
        "test_error": at_end[-1]["test_error"] if at_end else None,
    }


def run_summary(run_dir, label: str | None = None) -> dict:
    """The table row of one run directory (``COLUMNS``; None where the run has no value),
    named ``label`` (default ``plots.run_label``). ``final_error``: the test error of the
    final weights of a finished run (None when they were never evaluated: then
    ``last_error``/``last_epoch`` name the last evaluation, which is not of them), else of the
    last evaluation. ``wall_s``: seconds of training (``records.TrainingClock``: a resumed
    run's idle gap and start-up left out) up to the end of training, or to the last
    evaluation of a run that did not finish; ``startup_s``: of start-up, resumes' included
    (None for a simulation); ``resumes``, and ``between_runs_s`` idle between them (left out
    of both). Raises CompareError if it holds no ``metrics.jsonl``, DamagedRecord if a file
    it reads is damaged."""
    run_dir = _checked(run_dir)
    metrics = plots.read_metrics(run_dir)
    cfg = read_config(run_dir)
    rows = [r for r in plots.summary_rows(metrics) if r["test_error"] is not None]
    final = ps_final(run_dir, metrics)
    restarts = server_restarts(run_dir)
    if final is not None:  # only what the PS itself says happened: nothing past its end
        rows = [r for r in rows if isinstance(r.get("ts"), int) and r["ts"] <= final["ts"]]
    last = rows[-1] if rows else {}
    epochs, wall, error = last.get("epoch"), last.get("wall_s"), last.get("test_error")
    clock = plots.TrainingClock(metrics)
    if final is not None:  # where the PS itself says training ended, and that evaluation
        epochs, error, wall = final["epoch"], final["test_error"], clock.trained_s
    return {
        "run": label or plots.run_label(run_dir),
        "protocol": protocol_name(cfg),
        "learners": config_value(cfg, "sync", "learners"),
        "batch": config_value(cfg, "sync", "batch_size"),
        "lr_policy": config_value(cfg, "optimizer", "lr_policy"),
        "lr": config_value(cfg, "optimizer", "lr"),
        "epochs": epochs,
        "final_error": error,
        "best_error": min(r["test_error"] for r in rows) if rows else None,
        "mean_sigma": mean_sigma(metrics),
        "restarts": restarts_cell(restarts),
        "restart_list": restarts,
        "server_sigmas": server_sigmas(metrics),
        "startup_s": plots.startup_s(metrics),
        "wall_s": wall,
        "s_per_epoch": wall / epochs if wall and epochs else None,
        "last_error": last.get("test_error"),
        "last_epoch": last.get("epoch"),
        "resumes": len(clock.periods) - 1,
        "between_runs_s": sum(idle for _, idle, _ in clock.breaks),
    }


def result_line(run_dir) -> str | None:
    """One line on how the run ended, from what it wrote (``compare.run_summary``); None
    when it wrote no metrics (the stats server reports its own trouble). The test error is
    the final weights'; where they were never evaluated, the line says so first. The
    launcher prints it at the end of a run."""
    try:
        r = run_summary(run_dir)
    except DamagedRecord as exc:
        return f"result: none shown, a record it would come from is damaged: {exc}"
    except (OSError, ValueError):
        return None
    if r["final_error"] is None and r["last_error"] is None:
        return "result: no test error was measured (see logs/stats.log)"
    sigma = "-" if r["mean_sigma"] is None else f"{r['mean_sigma']:.2f}"
    if r.get("server_sigmas"):  # a sharded run: each server's own
        sigma = "per server " + ", ".join(
            "-" if x is None else f"{x:.2f}" for x in r["server_sigmas"]
        )
    startup = "" if r.get("startup_s") is None else f" (after {r['startup_s']:.1f} s of start-up)"
    if r["resumes"] and r.get("startup_s") is not None:  # a resumed run: its gap is no training
        startup = (
            f" (after {r['startup_s']:.1f} s of start-up in {r['resumes'] + 1} runs; "
            f"{r['between_runs_s']:.1f} s between them left out)"
        )
    if r["final_error"] is not None:
        error = f"test error {100 * r['final_error']:.2f}%"
    else:
        error = (
            f"the final weights were not evaluated (see logs/stats.log); the last test "
            f"error measured was {100 * r['last_error']:.2f}% at epoch "
            f"{r['last_epoch']:.2f}"
        )
    restarts = ""
    if r.get("restart_list"):  # which servers restarted, from what, what they lost
        restarts = f"; restarted: {restarts_text(r['restart_list'], bool(r.get('server_sigmas')))}"
    return (
        f"result: {error} (best {100 * r['best_error']:.2f}%) after {r['epochs']:.2f} "
        f"epochs in {r['wall_s']:.1f} s of training{startup}; <σ> {sigma} over the "
        f"run{restarts}; `rudra-zmq compare` puts runs side by side"
    )


def compare_runs(run_dirs, out_png) -> Path | None:
    """Overlay test error vs epoch (left) and vs time since training started (right) of
    several runs, in one PNG.

    Legend labels come from ``plots.run_labels`` (on the right with each run's start-up);
    runs with no eval records are left out (with a warning). Returns ``out_png``, or None,
    writing nothing, when no run has eval records.
    """
    runs = [Path(d) for d in run_dirs]
    fig, ax = plots._figure(ncols=2)
    plotted = 0
    for d, label in zip(runs, plots.run_labels(runs)):
        m = plots.read_metrics(d)
        xe, ye = plots.eval_series(m, "epoch")
        xt, yt = plots.eval_series(m, "t")
        if not len(xe) and not len(xt):
            log.warning("%s: no eval records; left out of the comparison", d)
            continue
        startup = plots.startup_s(m)
        plots._plot_error(ax[0, 0], xe, ye, label)
        plots._plot_error(
            ax[0, 1], xt, yt, label if startup is None else f"{label} (start-up {startup:.1f} s)"
        )
        plotted += 1
    if not plotted:
        return None
    ax[0, 0].set_xlabel("epoch")
    ax[0, 1].set_xlabel(plots.TIME_LABEL)
    ax[0, 0].set_title("test error vs epoch")
    ax[0, 1].set_title("test error vs time (start-up left out)")
    for a in ax[0]:
        a.legend(fontsize="small")
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    return plots._save(fig, out_png)


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key.endswith("_error"):
        return f"{100 * v:.2f}%"
    if isinstance(v, float):
        return f"{v:g}" if key == "lr" else f"{v:.1f}" if key.endswith("_s") else f"{v:.2f}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text, one line per run under a header."""
    cells = [list(COLUMNS)] + [[_fmt(k, r[k]) for k in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(
            c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(len(COLUMNS))
        ).rstrip()
        for c in cells
    )


def cmd_compare(args) -> int:
    """Print the table, write the PNG (and the CSV if asked). Returns 0, or 2 on a bad
    run directory or a damaged file in one (named in the message, with the record, the
    field and its value)."""
    import sys

    try:
        run_dirs = expand_run_dirs(args.run_dirs)  # every path checked before any is read
        rows = [run_summary(d, lab) for d, lab in zip(run_dirs, plots.run_labels(run_dirs))]
    except (CompareError, DamagedRecord) as exc:
        print(f"rudra-zmq compare: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    for r in rows:
        if r["final_error"] is None and r["last_error"] is not None:
            print(
                f"{r['run']}: final_error -: its final weights were never evaluated (the "
                f"last evaluation, {100 * r['last_error']:.2f}% at epoch "
                f"{r['last_epoch']:.2f}, is not of them)"
            )
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows({k: ("" if r[k] is None else r[k]) for k in COLUMNS} for r in rows)
        print(f"table: {args.csv}")
    if compare_runs(run_dirs, args.output) is not None:
        print(f"plot: {args.output}")
    else:
        print("plot: none (no run has test-error records)")
    return 0


def add_parser(sub) -> None:
    """Register ``rudra-zmq compare`` on the CLI's subparsers."""
    p = sub.add_parser(
        "compare",
        help="compare runs: accuracy, staleness, runtime (+ a plot)",
        description="Runs side by side: protocol, λ, µ, learning rate, final "
        "and best test error, mean staleness, start-up, wall time "
        "since training started; and one PNG of their test error "
        "against epoch and time since training started.",
    )
    add_run_dirs_argument(p, "run_dirs", "RUN_DIR")
    p.add_argument(
        "-o",
        "--output",
        default="compare.png",
        help="the PNG of test error vs epoch and vs time since training started "
        "(default compare.png)",
    )
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.set_defaults(func=cmd_compare)
