"""``rudra-zmq compare RUN_DIR ...``: runs side by side, as a protocol study reads them.

One table row per run directory -- protocol, λ, µ, learning-rate policy, how far it trained,
final and best test error, the average staleness ⟨σ⟩ over all its gradients, wall time and
seconds per epoch -- and one PNG with the runs' test error against epoch and against wall
time (``plots.compare_runs``). Reads only what a run wrote (``config.yaml``,
``metrics.jsonl``), so it works on finished, stopped and crashed runs alike; nothing is
imported from torch.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

from . import plots
from .config import protocol_label

COLUMNS = ("run", "protocol", "learners", "batch", "lr_policy", "lr", "epochs", "final_error",
           "best_error", "mean_sigma", "wall_s", "s_per_epoch")


class CompareError(ValueError):
    """A run directory that cannot be compared (the message names it and says why)."""


def _config(run_dir: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _get(cfg: dict, section: str, key: str):
    sec = cfg.get(section)
    return sec.get(key) if isinstance(sec, dict) else None


def protocol_name(cfg: dict) -> str:
    """``hardsync``, ``softsync n=2`` or ``async``, with the architecture when not base."""
    name = protocol_label(_get(cfg, "sync", "protocol") or "?", _get(cfg, "sync", "n"))
    arch = _get(cfg, "architecture", "kind")
    return name if arch in (None, "base") else f"{name} ({arch})"


def _checked(run_dir) -> Path:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise CompareError(f"{run_dir}: no metrics.jsonl here; give the run directories that "
                           "`rudra-zmq run` or `simulate` printed")
    return run_dir


def run_summary(run_dir, label: str | None = None) -> dict:
    """The table row of one run directory (``COLUMNS``; None where the run has no value),
    named ``label`` (default ``plots.run_label``). Raises CompareError if it holds no
    ``metrics.jsonl``."""
    run_dir = _checked(run_dir)
    metrics = plots.read_metrics(run_dir)
    cfg = _config(run_dir)
    rows = [r for r in plots.summary_rows(metrics) if r["test_error"] is not None]
    total, count = 0.0, 0
    for u in metrics["update"]:
        s, n = plots.sigma_sum(u)
        total, count = total + s, count + n
    last = rows[-1] if rows else {}
    epochs, wall = last.get("epoch"), last.get("wall_s")
    return {"run": label or plots.run_label(run_dir), "protocol": protocol_name(cfg),
            "learners": _get(cfg, "sync", "learners"), "batch": _get(cfg, "sync", "batch_size"),
            "lr_policy": _get(cfg, "optimizer", "lr_policy"), "lr": _get(cfg, "optimizer", "lr"),
            "epochs": epochs,
            "final_error": last.get("test_error"),
            "best_error": min(r["test_error"] for r in rows) if rows else None,
            "mean_sigma": total / count if count else None, "wall_s": wall,
            "s_per_epoch": wall / epochs if wall and epochs else None}


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key.endswith("_error"):
        return f"{100 * v:.2f}%"
    if isinstance(v, float):
        return f"{v:g}" if key == "lr" else f"{v:.1f}" if key == "wall_s" else f"{v:.2f}"
    return str(v)


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text, one line per run under a header."""
    cells = [list(COLUMNS)] + [[_fmt(k, r[k]) for k in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i])
                               for i in range(len(COLUMNS))).rstrip() for c in cells)


def cmd_compare(args) -> int:
    """Print the table, write the PNG (and the CSV if asked). Returns 0, or 2 on a bad
    run directory (named in the message)."""
    import sys

    try:
        for d in args.run_dirs:   # every directory checked before any is read
            _checked(d)
        rows = [run_summary(d, lab) for d, lab in zip(args.run_dirs,
                                                      plots.run_labels(args.run_dirs))]
    except CompareError as exc:
        print(f"rudra-zmq compare: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
        print(f"table: {args.csv}")
    if plots.compare_runs(args.run_dirs, args.output) is not None:
        print(f"plot: {args.output}")
    else:
        print("plot: none (no run has test-error records)")
    return 0


def add_parser(sub) -> None:
    """Register ``rudra-zmq compare`` on the CLI's subparsers."""
    p = sub.add_parser("compare", help="compare runs: accuracy, staleness, runtime (+ a plot)",
                       description="Runs side by side: protocol, λ, µ, learning rate, final "
                                   "and best test error, mean staleness, wall time; and one "
                                   "PNG of their test error against epoch and wall time.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument("-o", "--output", default="compare.png",
                   help="the PNG of test error vs epoch and vs wall time (default compare.png)")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.set_defaults(func=cmd_compare)
