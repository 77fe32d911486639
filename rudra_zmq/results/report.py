"""``rudra-zmq report PARENT|RUN ...``: runs laid out as the paper's Table 2 and Figures 3-4.

One table row per run (a sweep's point, or any run directory): protocol, σ as Table 2 writes it,
µ, λ, µ·λ, learning-rate policy, the test error at an epoch budget, ⟨σ⟩, and the paper's own
140-epoch error for the same Table 2 row (``paper.TABLE2``). Written as ``report.md`` (also
printed) and ``report.csv``, with ``fig3_error_vs_epoch.png`` and ``fig4_error_vs_time.png``.
Where the runs hold the µ = 128, λ = 1 baseline and another setting, also the gap of each
setting to the baseline over seeds and schedule lengths (``gaps``: ``gaps.md``, ``gaps.csv``,
``gap_vs_length.png``, ``gap_vs_step.png``).
Reads only what runs wrote (``config.yaml``, ``metrics.jsonl``, a sweep's ``point.json``,
a real run's ``processes.json``), so failed and unfinished runs are listed too; every
function here blocks on file I/O only, and nothing is imported from torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from ..run_files import METRICS_FILE, POINT_FILE, PROCESSES_FILE
from ..sync import PROTOCOLS, nominal_staleness
from . import gaps, paper, plots
from . import record_fields as fields
from .compare import (
    CompareError,
    add_run_dirs_argument,
    config_value,
    expand_run_dirs,
    is_run_dir,
    mean_sigma,
    protocol_name,
    read_config,
    restarts_text,
    server_restarts,
    server_sigmas,
)

log = logging.getLogger(__name__)

RUN_MARKERS = (METRICS_FILE, POINT_FILE)  # a failed point may have no metrics at all
COLUMNS = (
    ("run", "run"),
    ("mode", "mode"),
    ("status", "status"),
    ("protocol", "protocol"),
    ("sigma", "σ"),
    ("batch", "µ"),
    ("learners", "λ"),
    ("mu_lambda", "µ·λ"),
    ("lr_policy", "lr policy"),
    ("lr", "α0"),
    ("epochs", "epochs"),
    ("budget", "budget"),
    ("schedule", "schedule⁴"),
    ("error_at_budget", "error at budget"),
    ("best_error", "best error¹"),
    ("time", "time²"),
    ("mean_sigma", "⟨σ⟩"),
    ("paper_error", "paper³"),
)
CSV_FIELDS = tuple(k for k, _ in COLUMNS) + ("time_unit",)
POLICY = {"constant": "α0", "staleness": "α0/⟨σ⟩", "per_gradient": "α0/σ per gradient"}
LINESTYLE = {"staleness": "-", "constant": "--", "per_gradient": "-."}
ERRORS = {"error_at_budget", "best_error", "paper_error"}  # fractions, shown in %
TIME_UNIT = {"real": "s", "simulated": "sim"}
TIME_AXIS = {"real": plots.TIME_LABEL, "simulated": "simulated time"}
FOOTNOTES = (
    "σ: n for n-softsync, 0 for hardsync, λ for async (as Table 2 writes it); ⟨σ⟩: the mean "
    "staleness over every gradient of the run (a sharded run: each server's, server 0 "
    "first). Error at budget: the last eval at or before the budget epoch (the eval of the "
    "update that reached it counts).",
    "¹ the best eval up to the budget.",
    "² at the eval of the error at budget: wall seconds since training started (s; the "
    "parameter server's first update, start-up left out) for real runs, simulated time (sim; "
    "1 = one gradient's compute time) for simulated runs; not comparable.",
    f"³ the paper's Table 2 (CIFAR-10, Rudra-base, n-softsync, α0/⟨σ⟩, "
    f"{paper.TABLE2_EPOCHS} epochs) row with the same µ·λ group, σ, µ and λ; blank where it "
    "has none.",
    "⁴ the schedule's scale: ×0.1 is a compressed schedule (epochs and ÷10 steps at a tenth "
    "of the config's, `--schedule-scale 0.1`), not the paper's budget; blank: the config's "
    "own schedule.",
)


@dataclass
class Run:
    """What one run directory holds, read once: its config, sweep point record and metrics."""

    path: Path
    label: str
    cfg: dict
    point: dict
    mode: str  # "real" | "simulated"
    metrics: plots.Metrics


# point.json as ``sweep`` writes it (what the report reads of it).
POINT_FIELDS = {
    "point": fields.text(),
    "mode": fields.text("run", "simulate"),
    "status": fields.text("done", "failed"),
    "exit_code": fields.integer(-255, 255),
    "wall_s": fields.number().optional(),
}


def read_point(run_dir: Path) -> dict:
    """The sweep's ``point.json`` of a run directory ({} when there is none), checked
    (``POINT_FIELDS``): raises record_fields.DamagedRecord for a damaged one."""
    path = run_dir / POINT_FILE
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise fields.DamagedRecord(f"{path} is not JSON ({exc}): truncated or damaged") from None
    return fields.check(data, POINT_FIELDS, str(path))


def run_mode(run_dir: Path, point: dict) -> str:
    """``real`` or ``simulated``: the sweep's word for it, else ``real`` where the launcher
    left ``processes.json``."""
    if point.get("mode") in ("run", "simulate"):
        return "real" if point["mode"] == "run" else "simulated"
    return "real" if (run_dir / PROCESSES_FILE).is_file() else "simulated"


def load_runs(run_dirs) -> list[Run]:
    """Read every run directory (a missing ``metrics.jsonl`` reads as no records). Labels are
    sweep point names, else ``plots.run_labels``; a repeated one gets its parent's name.
    Raises record_fields.DamagedRecord for a damaged file in one."""
    dirs = [Path(d) for d in run_dirs]
    points = [read_point(d) for d in dirs]
    labels = [str(p.get("point") or lab) for p, lab in zip(points, plots.run_labels(dirs))]
    dup = {lab for lab in labels if labels.count(lab) > 1}
    labels = [
        f"{lab} ({d.resolve().parent.name})" if lab in dup else lab for lab, d in zip(labels, dirs)
    ]
    empty = plots.Metrics({k: [] for k in plots.KNOWN_TYPES})
    return [
        Run(
            d,
            lab,
            read_config(d),
            p,
            run_mode(d, p),
            plots.read_metrics(d) if is_run_dir(d) else empty,
        )
        for d, lab, p in zip(dirs, labels, points)
    ]


def sigma_column(cfg: dict):
    """σ as Table 2 writes it: n for n-softsync, 0 for hardsync, λ for async."""
    protocol = config_value(cfg, "sync", "protocol")
    if protocol not in PROTOCOLS:
        return None
    return nominal_staleness(
        protocol, config_value(cfg, "sync", "n"), config_value(cfg, "sync", "learners")
    )


def _first_ts_past(evals: list[dict], budget: float) -> int:
    """The ts of the first eval past ``budget`` epochs by less than half the median interval
    between evals, or -1 (no such eval, or fewer than two evals to measure it by)."""
    epochs = sorted(r["epoch"] for r in evals)
    gaps = [b - a for a, b in zip(epochs, epochs[1:]) if b > a]
    if not gaps:
        return -1
    half = statistics.median(gaps) / 2
    past = [r for r in evals if isinstance(r["ts"], int) and budget < r["epoch"] < budget + half]
    return min((r["ts"] for r in past), default=-1)


def _at_budget(metrics, budget) -> tuple[dict | None, dict | None]:
    """(the last eval at or before ``budget`` epochs, the best of those) as ``summary_rows``
    rows; (None, None) without one. ``budget`` None: all evals count."""
    evals = [
        r
        for r in plots.summary_rows(metrics)
        if r["test_error"] is not None and r["epoch"] is not None
    ]
    if budget is not None:
        # A run stops at the update that reaches its epochs, a little past them: the eval
        # of that update is the one at the budget, so it counts.
        reached = [
            u["ts"]
            for u in metrics["update"]
            if isinstance(u.get("ts"), int)
            and isinstance(u.get("epoch"), (int, float))
            and u["epoch"] >= budget
        ]
        last_ts = min(reached, default=-1)
        if last_ts < 0:
            # Records kept as evaluations only (docs/reproduction/*-evals.jsonl), or with
            # every Nth update only, may not hold the update that reached the budget: the
            # eval of that update is the one less than half an evaluation interval past it.
            last_ts = _first_ts_past(evals, budget)
        evals = [r for r in evals if r["epoch"] <= budget or r["ts"] <= last_ts]
    if not evals:
        return None, None
    return (sorted(evals, key=lambda r: r["epoch"])[-1], min(evals, key=lambda r: r["test_error"]))


def table_row(run: Run, budget: float | None = None) -> dict:
    """The report row of one run (``CSV_FIELDS``; None where it has no value). ``budget``:
    epochs for the error at budget (default: the run's ``train.epochs``)."""
    cfg, m = run.cfg, run.metrics
    mu, lam = config_value(cfg, "sync", "batch_size"), config_value(cfg, "sync", "learners")
    sigma = sigma_column(cfg)
    budget = budget if budget is not None else config_value(cfg, "train", "epochs")
    at, best = _at_budget(m, budget)
    epochs = [e for r in m["update"] + m["eval"] if isinstance(e := r.get("epoch"), (int, float))]
    status = [run.point.get("status")] if run.point.get("status") else []
    if status == ["failed"]:
        status = [f"failed (exit {run.point.get('exit_code', '?')})"]
    if not is_run_dir(run.path):
        status.append("no metrics")
    elif not m["eval"]:
        status.append("no eval")
    if is_run_dir(run.path) and (restarts := server_restarts(run.path)):
        status.append(f"restarted: {restarts_text(restarts, bool(server_sigmas(m)))}")
    ref = paper.table2_row(mu, lam, sigma)
    return {
        "run": run.label,
        "mode": run.mode,
        "status": ", ".join(status),
        "protocol": protocol_name(cfg, paper=True) if cfg else None,
        "sigma": sigma,
        "batch": mu,
        "learners": lam,
        "mu_lambda": mu * lam if mu and lam else None,
        "lr_policy": config_value(cfg, "optimizer", "lr_policy"),
        "lr": config_value(cfg, "optimizer", "lr"),
        "epochs": max(epochs, default=None),
        "budget": budget,
        "schedule": schedule_scale(cfg),
        "error_at_budget": at and at["test_error"],
        "best_error": best and best["test_error"],
        "time": at and at["wall_s"],
        "mean_sigma": mean_sigma(m),
        "server_sigmas": server_sigmas(m),  # a sharded run: each server's (the cell shows all)
        "paper_error": round(ref.test_error_pct / 100, 6) if ref else None,
        "time_unit": TIME_UNIT[run.mode],
    }


def _cell(key: str, row: dict) -> str:
    v = row[key]
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return ""
    if key in ERRORS:
        return f"{100 * v:.2f} %"
    if key == "time":
        return f"{v:.1f} {row['time_unit']}"
    if key == "lr_policy":
        return POLICY.get(v, str(v))
    if key == "mean_sigma":
        each = row.get("server_sigmas") or [v]
        return " / ".join("-" if x is None else f"{x:.2f}" for x in each)
    if key == "schedule":
        return f"×{v:g}"
    if isinstance(v, float):
        return f"{v:g}" if key == "lr" else f"{round(v, 2):g}"
    return str(v).replace("|", "\\|")


def schedule_scale(cfg: dict) -> float | None:
    """A run's ``train.schedule_scale`` where it is not 1 (a compressed schedule), else None."""
    scale = config_value(cfg, "train", "schedule_scale")
    return scale if isinstance(scale, (int, float)) and scale != 1 else None


def schedule_header(rows: list[dict]) -> str:
    """One line saying which rows ran a scaled schedule (never the paper's budget), or ''."""
    scales = sorted({r["schedule"] for r in rows if r["schedule"] is not None})
    if not scales:
        return ""
    which = "every run" if all(r["schedule"] is not None for r in rows) else "some runs"
    return (
        f"**Schedule scaled ×{', ×'.join(f'{s:g}' for s in scales)} in {which} — not the "
        f"paper's budget** ({paper.TABLE2_EPOCHS} epochs, ÷10 at 120 and 130): epochs "
        "and ÷10 steps are that fraction of the config's; the paper column is its "
        f"{paper.TABLE2_EPOCHS}-epoch error.\n\n"
    )


def format_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table in Table 2's layout, with its footnotes (and, above it,
    a line saying so when any run's schedule was scaled)."""
    right = {
        "sigma",
        "batch",
        "learners",
        "mu_lambda",
        "lr",
        "epochs",
        "budget",
        "time",
        "mean_sigma",
    } | ERRORS
    lines = [
        "| " + " | ".join(h for _, h in COLUMNS) + " |",
        "|" + "|".join("---:" if k in right else "---" for k, _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_cell(k, r) for k, _ in COLUMNS) + " |" for r in rows]
    return (
        schedule_header(rows)
        + "\n".join(lines + [""] + [f"{note}  " for note in FOOTNOTES]).rstrip()
        + "\n"
    )


def write_csv(rows: list[dict], path: Path) -> Path:
    """The rows as CSV (``CSV_FIELDS``; errors as fractions, blanks for missing values)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows({k: ("" if r[k] is None else r[k]) for k in CSV_FIELDS} for r in rows)
    return path


def line_styles(runs: list[Run], rows: list[dict]) -> list[dict]:
    """Figure 3's style of each run: runs that differ only in the learning-rate policy share
    a colour; solid for α0/⟨σ⟩, dashed for constant α0; the label names protocol, µ, λ and
    policy (and the run where that is not enough to tell two apart)."""

    def same_but_policy(run):
        # runtime.* (paths, threads, device) does not change what is learned
        cfg = {k: v for k, v in run.cfg.items() if k not in ("name", "runtime")}
        cfg["optimizer"] = {
            k: v for k, v in (cfg.get("optimizer") or {}).items() if k != "lr_policy"
        }
        return run.mode, json.dumps(cfg, sort_keys=True, default=str) if run.cfg else run.label

    colours, styles = {}, []
    for run, row in zip(runs, rows):
        colour = colours.setdefault(same_but_policy(run), f"C{len(colours) % 10}")
        styles.append(
            {
                "label": f"{row['protocol']}, µ={row['batch']}, λ={row['learners']}, "
                f"{_cell('lr_policy', row)}",
                "color": colour,
                "linestyle": LINESTYLE.get(row["lr_policy"], ":"),
            }
        )
    labels = [s["label"] for s in styles]
    for s, run in zip(styles, runs):
        if labels.count(s["label"]) > 1:
            s["label"] += f" [{run.label}]"
    return styles


def write_figures(runs: list[Run], rows: list[dict], out_dir: Path) -> list[Path]:
    """Write ``fig3_error_vs_epoch.png`` (test error vs epoch, Figure 3's styles) and
    ``fig4_error_vs_time.png`` (vs time, the same styles; a panel each for real and
    simulated runs) into ``out_dir``. Runs without evals are left out; returns the paths
    written (none when no run has an eval)."""
    styles = line_styles(runs, rows)
    shown = [(run, row, st) for run, row, st in zip(runs, rows, styles) if run.metrics["eval"]]
    if not shown:
        return []
    fig, ax = plots._figure(size=(8.0, 5.0))
    for run, _, st in shown:
        plots._plot_error(ax[0, 0], *plots.eval_series(run.metrics, "epoch"), **st)
    ax[0, 0].set_xlabel("epoch")
    ax[0, 0].set_title("test error vs epoch (solid α0/⟨σ⟩, dashed α0)")
    ax[0, 0].legend(fontsize="small")
    written = [plots._save(fig, out_dir / "fig3_error_vs_epoch.png")]

    kinds = [k for k in TIME_AXIS if any(run.mode == k for run, _, _ in shown)]
    fig, ax = plots._figure(ncols=len(kinds), size=(8.0, 5.0))
    for run, _, st in shown:
        plots._plot_error(ax[0, kinds.index(run.mode)], *plots.eval_series(run.metrics, "t"), **st)
    for a, kind in zip(ax[0], kinds):
        a.set_xlabel(TIME_AXIS[kind])
        a.set_title(f"test error vs {TIME_AXIS[kind].split(' (')[0]} ({kind} runs)")
        a.legend(fontsize="small")
    written.append(plots._save(fig, out_dir / "fig4_error_vs_time.png"))
    return written


def cmd_report(args) -> int:
    """Print the table; write report.md, report.csv and the figures into --out. Returns 0,
    or 2 on a path that is neither a run nor a parent of runs, or a damaged file in a run
    (named in the message, with the record, the field and its value)."""
    try:
        run_dirs = expand_run_dirs(args.paths, RUN_MARKERS)  # all checked before any is read
        runs = load_runs(run_dirs)
        rows = [table_row(run, args.budget) for run in runs]  # (ps_final.json's restarts)
    except (CompareError, fields.DamagedRecord) as exc:
        print(f"rudra-zmq report: error: {exc}", file=sys.stderr)
        return 2
    one_parent = len(args.paths) == 1 and not is_run_dir(args.paths[0], RUN_MARKERS)
    out = Path(args.out) if args.out else Path(args.paths[0]) if one_parent else Path(".")
    out.mkdir(parents=True, exist_ok=True)
    text = format_markdown(rows)
    figures = write_figures(runs, rows, out)
    gap_text, gap_files = gaps.write_gaps(runs, rows, out)
    figures += [p for p in gap_files if p.suffix == ".png"]
    links = "".join(f"\n![{p.stem}]({p.name})\n" for p in figures)
    more = f"\n## The gap to the baseline\n\n{gap_text}" if gap_text else ""
    (out / "report.md").write_text(f"# rudra-zmq report\n\n{text}{more}{links}")
    write_csv(rows, out / "report.csv")
    print(text)
    if gap_text:
        print(gap_text)
        print(f"gaps: {out / 'gaps.md'}, {out / 'gaps.csv'}")
    print(f"report: {out / 'report.md'}, {out / 'report.csv'}")
    print("figures: " + (", ".join(map(str, figures)) or "none (no run has test-error records)"))
    return 0


def _epochs(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of epochs > 0, got {text!r}")
    return value


def add_parser(sub) -> None:
    """Register ``rudra-zmq report`` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help="runs or a sweep as the paper's Table 2 and Figures 3-4",
        description="A table of runs in the layout of the paper's Table 2 "
        "(markdown and CSV, beside the paper's own errors) and "
        "figures of their test error against epoch and time.",
    )
    add_run_dirs_argument(p, "paths", "PARENT|RUN")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where to write report.md, report.csv and the PNGs (default: the "
        "parent directory when it is the only path given, else .)",
    )
    p.add_argument(
        "--budget",
        type=_epochs,
        metavar="EPOCHS",
        help="epochs at which to read each run's test error (default: each run's train.epochs)",
    )
    p.set_defaults(func=cmd_report)
