"""Read a run's ``metrics.jsonl`` and turn it into ``summary.csv`` and PNG plots.

The statistics server appends one JSON object per line, each with a ``"type"``:

    update   {"ts", "t", "epoch", "mean_sigma", "sigmas": [int, ...], "lr", "n_grads"}
    eval     {"ts", "t", "epoch", "test_error" (0..1), "test_loss"}
    learner  {"learner", "t", "step", "samples_per_s", "loss"}
    ps       {"t", "ts", "updates_per_s", "gradients_per_s", "invalid", "duplicates",
              "evictions", "lost_updates"}
    members  {"t", "ts", "epoch", "learner", "event" (evicted | joined), "learners" (λ), "c",
              "incarnation", "n" (its server's n-th λ change in it), "source" (read from a file)}
    restart  {"t", "ts", "epoch", "incarnation", "checkpoint"}   (a PS resumed a checkpoint)
    resume   {"t"}                                  (``rudra-zmq run --resume``)
    start    {"t": 0, "unix"}                       (the run's clock: the first line)
    done     {"t", "ts", "epoch", counters as ``ps``, "evals_sent"}

``t`` is wall seconds since the start of the run, across restarts and resumes (absolute Unix
times are accepted too: they are shifted so the earliest record is 0). λ changes, PS restarts
and resumes are drawn as vertical lines. ``ts`` is the weights timestamp, i.e. updates applied.
An ``eval`` record with ``"weights": "weights.npy"`` was evaluated from the file the PS saved
at the end (its final EVAL never reached the statistics server).

Training starts when the parameter server applies its first update (the earliest ``update``
record); what comes before -- processes starting, data loading, learners registering and
computing their first gradients -- is start-up (``startup_s``). Time axes, ``summary.csv``'s
``wall_s`` and ``rudra-zmq compare`` count seconds of training (``records.TrainingClock``):
from the start of training, leaving out each resumed run's idle gap and start-up (drawn as a
"run resumed" line that names the seconds left out); an evaluation from before training (of
the initial weights) is placed at its start. A simulation, which writes update and eval
records only, has no start-up: its clock starts with training.

Plots use matplotlib's object API (``Figure`` + ``FigureCanvasAgg``), never pyplot, so nothing
global (backend, current figure) changes for other users in the process, and it is safe to call
from a background thread. Every function here blocks on file I/O only.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path

import numpy as np

from .record_fields import DamagedRecord
from .records import (
    KNOWN_TYPES,
    Metrics,
    TrainingClock,
    read_config,
    read_metrics,
    sigma_sum,
    startup_s,
    time_origin,
)
from .records import num as _num

log = logging.getLogger(__name__)

TIME_LABEL = "time since training started (s)"
SUMMARY_FIELDS = ("epoch", "wall_s", "ts", "test_error", "test_loss", "mean_sigma", "updates_per_s")


def eval_series(metrics, xkey: str):
    """(x, test error) arrays of the eval records, x being ``epoch`` or ``t`` (seconds of
    training, ``records.TrainingClock``: an evaluation from before it, of the initial weights,
    at 0)."""
    if xkey != "t":
        return _series(metrics["eval"], xkey, "test_error")
    return _series(metrics["eval"], "t", "test_error", TrainingClock(metrics))


def _startup_note(metrics, before: str = ", ", after: str = "") -> str:
    """``start-up 7.2 s`` between ``before`` and ``after`` for a title; "" without one."""
    s = startup_s(metrics)
    return "" if s is None else f"{before}start-up {s:.1f} s{after}"


def _series(records, xkey, ykey, clock: TrainingClock | None = None, during=False):
    """Sorted (x, y) arrays from the records that have numeric values for both keys; ``t``
    values as seconds of training by ``clock`` (with ``during``, only those in training)."""
    pts = []
    for r in records:
        x, y = _num(r.get(xkey)), _num(r.get(ykey))
        if x is not None and clock is not None:
            x = clock.at(x, during)
        if x is not None and y is not None:
            pts.append((x, y))
    pts.sort()
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


def summary_rows(metrics) -> list[dict]:
    """One dict per eval (``SUMMARY_FIELDS``), in timestamp order; missing values are None.

    ``wall_s`` is seconds of training (``records.TrainingClock``; 0 for an evaluation from
    before it). ``mean_sigma`` averages every gradient's staleness over the updates since the
    previous eval (previous eval's ts < update ts <= this eval's ts); ``updates_per_s`` is the
    updates applied since the previous eval over the seconds of training since it (since
    training started for the first eval).
    """
    clock = TrainingClock(metrics)
    evals = sorted(
        (e for e in metrics.get("eval", []) if _num(e.get("ts")) is not None),
        key=lambda e: (e["ts"], _num(e.get("t")) or 0.0),
    )
    updates = sorted(
        (u for u in metrics.get("update", []) if _num(u.get("ts")) is not None),
        key=lambda u: u["ts"],
    )
    rows, j = [], 0
    prev_ts, prev_t = 0, 0.0
    for e in evals:
        total, count = 0.0, 0
        while j < len(updates) and updates[j]["ts"] <= e["ts"]:
            s, n = sigma_sum(updates[j])  # updates up to prev_ts were taken by earlier evals
            total, count = total + s, count + n
            j += 1
        wall = clock.at(e.get("t"))
        rate = None
        if wall is not None and wall - prev_t > 0:
            rate = (e["ts"] - prev_ts) / (wall - prev_t)
        rows.append(
            {
                "epoch": _num(e.get("epoch")),
                "wall_s": wall,
                "ts": int(e["ts"]),
                "test_error": _num(e.get("test_error")),
                "test_loss": _num(e.get("test_loss")),
                "mean_sigma": total / count if count else None,
                "updates_per_s": rate,
            }
        )
        prev_ts = e["ts"]
        prev_t = wall if wall is not None else prev_t
    return rows


def write_summary_csv(metrics, path) -> Path:
    """Write ``summary_rows(metrics)`` as CSV (header ``SUMMARY_FIELDS``; blanks for missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        w.writeheader()
        for row in summary_rows(metrics):
            w.writerow(
                {
                    k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                    for k, v in row.items()
                }
            )
    return path


# ----------------------------------------------------------------------------- plots
def _figure(ncols=1, nrows=1, size=(6.4, 4.0), **kw):
    # matplotlib (~0.5 s of CPU to import) loads with the first figure: the statistics server
    # reads and writes metrics from its start but draws only when the run ends.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _save(fig, path: Path) -> Path:
    """Write a PNG atomically, so a viewer never sees half a file while plots refresh."""
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _plot_error(ax, x, y, label=None, **style):
    """Test error (0..1) as a percentage line; ``style``: matplotlib line keywords."""
    ax.plot(x, 100 * y, marker="o", markersize=3, label=label, **style)
    ax.set_ylabel("test error (%)")
    ax.grid(True, alpha=0.3)


def _mark_events(ax, m, xkey: str, clock: TrainingClock | None = None) -> None:
    """Vertical lines where λ changed (``members``: evicted/joined, labelled λ and c) and where
    the PS restarted or the run was resumed (``restart``/``resume``), where the protocol
    changed (update records' ``protocol``: ``sync.schedule``, ``sync.target_staleness``), on an
    x of ``epoch`` or
    of seconds of training by ``clock``, where a resume is drawn with the seconds of idle time
    and start-up left out there."""
    seen, ups = set(), m["update"]
    m = {
        **m,
        "protocol": [u for a, u in zip(ups, ups[1:]) if a.get("protocol") != u.get("protocol")],
    }
    for kind, style in (
        ("protocol", dict(color="tab:green", linestyle="-")),
        ("members", dict(color="tab:orange", linestyle=":")),
        ("restart", dict(color="tab:red", linestyle="--")),
        ("resume", dict(color="tab:purple", linestyle="-.")),
    ):
        points = [(_num(r.get(xkey)), r) for r in m[kind]]
        if kind == "resume" and clock is not None:
            points = [(at, {"idle": idle, "up": up or 0.0}) for at, idle, up in clock.breaks]
        elif clock is not None:
            points = [(clock.at(x), r) for x, r in points]
        for x, r in points:
            if x is None:
                continue
            if kind == "protocol":
                label = f"then {r.get('protocol')}"
            elif kind == "members":
                label = f"λ={r.get('learners')}, c={r.get('c')} ({r.get('event')})"
            elif kind == "restart":
                label = "PS restarted"
            else:
                label = (
                    "run resumed"
                    if "idle" not in r
                    else (
                        f"run resumed ({r['idle']:.1f} s idle + {r['up']:.1f} s start-up left out)"
                    )
                )
            ax.axvline(x, linewidth=1, alpha=0.8, label=None if label in seen else label, **style)
            seen.add(label)
    if seen:
        ax.legend(fontsize="small")


def plot_run(run_dir, out_dir=None) -> list[Path]:
    """Write a run's PNG plots into ``out_dir`` (default: the run directory).

    ``test_error_vs_epoch.png`` and ``test_error_vs_time.png`` need eval records,
    ``staleness_hist.png`` update records with ``sigmas``, ``throughput.png`` learner or ps
    records; a plot whose data is missing is skipped. Returns the paths written.
    """
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    m = read_metrics(run_dir)
    run_cfg = read_config(run_dir)
    name = run_label(run_dir, run_cfg)
    clock = TrainingClock(m)
    written = []

    for xkey, xlabel, fname in (
        ("epoch", "epoch", "test_error_vs_epoch.png"),
        ("t", TIME_LABEL, "test_error_vs_time.png"),
    ):
        x, y = eval_series(m, xkey)
        if len(x):
            fig, ax = _figure()
            _plot_error(ax[0, 0], x, y)
            _mark_events(ax[0, 0], m, xkey, clock if xkey == "t" else None)
            ax[0, 0].set_xlabel(xlabel)
            ax[0, 0].set_title(
                f"{name}: test error vs {xkey if xkey == 'epoch' else 'time'} "
                f"(last {100 * y[-1]:.2f} %"
                f"{_startup_note(m) if xkey == 't' else ''})"
            )
            written.append(_save(fig, out_dir / fname))

    sigmas = [
        s
        for u in m["update"]
        if isinstance(u.get("sigmas"), list)
        for s in map(_num, u["sigmas"])
        if s is not None
    ]
    if sigmas:
        sig = np.array(sigmas)
        mean = float(sig.mean())
        fig, ax = _figure()
        a = ax[0, 0]
        lo, hi = math.floor(sig.min()), math.ceil(sig.max())
        bins = np.arange(lo - 0.5, hi + 1.5) if hi - lo <= 200 else 100
        a.hist(sig, bins=bins, color="tab:blue", alpha=0.8, edgecolor="white")
        mean_tex = rf"$\langle\sigma\rangle$ = {mean:.2f}"
        a.axvline(mean, color="tab:red", linestyle="--", label=mean_tex)
        sync = (run_cfg or {}).get("sync")
        bound = sync.get("max_staleness") if isinstance(sync, dict) else None
        if _num(bound) is not None:  # bounded staleness: the cap, beside the largest σ
            a.axvline(bound + 0.5, color="k", label=f"sync.max_staleness = {bound}")
        a.set_xlabel(r"staleness $\sigma$ of each gradient (updates)")
        a.set_ylabel("gradients")
        a.set_title(
            f"{name}: staleness, {mean_tex}, max {sig.max():g}, over {len(sig):,} gradients"
        )
        a.legend()
        written.append(_save(fig, out_dir / "staleness_hist.png"))

    if m["learner"] or m["ps"]:
        panels = int(bool(m["learner"])) + int(bool(m["ps"]))
        fig, ax = _figure(nrows=panels, sharex=True)
        row = 0
        if m["learner"]:
            a = ax[row, 0]
            by_id = {}
            for r in m["learner"]:
                by_id.setdefault(r.get("learner"), []).append(r)
            for lid in sorted(by_id, key=str):
                x, y = _series(by_id[lid], "t", "samples_per_s", clock, during=True)
                a.plot(x, y, linewidth=1, alpha=0.7, label=f"learner {lid}")
            x, y = _total_rate(m["learner"], clock)
            a.plot(x, y, color="black", linewidth=2, drawstyle="steps-post", label="total")
            a.set_ylabel("samples / s")
            a.set_title(f"{name}: throughput{_startup_note(m, ' (', ')')}")
            a.legend(fontsize="small", ncol=2)
            a.grid(True, alpha=0.3)
            row += 1
        if m["ps"]:
            a = ax[row, 0]
            for key, label in (
                ("updates_per_s", "PS updates / s"),
                ("gradients_per_s", "PS gradients / s"),
            ):
                x, y = _series(m["ps"], "t", key, clock, during=True)
                if len(x):
                    a.plot(x, y, linewidth=1.5, label=label)
            a.set_ylabel("per second")
            if a.lines:  # none when the PS reported during start-up only
                a.legend(fontsize="small")
            a.grid(True, alpha=0.3)
            if not m["learner"]:
                a.set_title(f"{name}: parameter server throughput{_startup_note(m, ' (', ')')}")
        for a in ax[:, 0]:
            _mark_events(a, m, "t", clock)
        ax[-1, 0].set_xlabel(TIME_LABEL)
        ax[-1, 0].set_xlim(left=0)  # the start of training, though the first report is later
        written.append(_save(fig, out_dir / "throughput.png"))
    return written


def _total_rate(records, clock: TrainingClock):
    """Sum over learners of each one's latest samples/s, at every report time in training
    (step-hold; x in seconds of training)."""
    latest, xs, ys = {}, [], []
    pts = sorted(
        (
            (t, r)
            for r in records
            if (t := _num(r.get("t"))) is not None and _num(r.get("samples_per_s")) is not None
        ),
        key=lambda p: p[0],
    )
    for t, r in pts:
        latest[r.get("learner")] = r["samples_per_s"]
        x = clock.at(t, during=True)
        if x is not None:
            xs.append(x)
            ys.append(sum(latest.values()))
    return np.array(xs), np.array(ys)


def run_label(run_dir, run_cfg: dict | None = None) -> str:
    """The run's config ``name`` from ``config.yaml`` in its directory (or ``run_cfg``, read
    already), else the folder name."""
    if run_cfg is None:
        try:
            run_cfg = read_config(run_dir)
        except DamagedRecord:  # a label only: the commands that read the config refuse it
            run_cfg = None
    data = run_cfg
    if isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]:
        return data["name"]
    return Path(run_dir).resolve().name


def run_labels(run_dirs) -> list[str]:
    """``run_label`` of each run, with its folder name added where two runs share a label."""
    labels = [run_label(d) for d in run_dirs]
    dup = {lab for lab in labels if labels.count(lab) > 1}
    return [
        f"{lab} ({Path(d).resolve().name})" if lab in dup else lab
        for lab, d in zip(labels, run_dirs)
    ]


__all__ = [
    "read_config",
    "read_metrics",
    "summary_rows",
    "write_summary_csv",
    "plot_run",
    "run_label",
    "run_labels",
    "Metrics",
    "startup_s",
    "time_origin",
    "eval_series",
    "TIME_LABEL",
    "sigma_sum",
    "TrainingClock",
    "KNOWN_TYPES",
]
