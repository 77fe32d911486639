"""The staleness cost of a protocol as the gap to the baseline, over seeds and schedule lengths.

``rudra-zmq report`` calls this when its runs include the µ = 128, λ = 1 hardsync baseline and
at least one other setting. Runs are grouped by *setting* (the config less its seeds, its
schedule length and ``runtime.*``) and *schedule scale* (``train.schedule_scale``); the seeds
of one group are its repeats. For each group it gives the final test error's mean and spread
over seeds and the **gap**: the group's mean minus the baseline's mean at the same scale, in
points, with the standard error of that difference where both sides have two seeds or more.

Two quantities explain a gap or rule a cause out (issue 44, docs/reproduction.md):

- **the step per epoch relative to the baseline's**: per epoch a run makes N/(c·µ) updates of
  α = α0/max(⟨σ⟩, 1) (α0 under the constant policy), the baseline N/128 of its α0, so the
  ratio is (α/(c·µ)) / (α0_base/128). Rows of Table 2 at µ·λ ≈ 128 are not equal in it:
  2-softsync at λ = 2 takes twice the baseline's step per sample;
- **the schedule's length** (epochs = scale × the config's): whether a gap closes as the
  schedule lengthens, beside the paper's own gap at 140 epochs (its Table 2 row minus the
  baseline's 18 % that its text gives).

Writes ``gaps.md``, ``gaps.csv``, ``gap_vs_length.png`` (gap against epochs, one line per
setting, the paper's points at its 140 epochs), ``gap_vs_step.png`` (gap against λ and
against the relative step per epoch, one panel each, a marker per scale) and
``gap_over_training.png`` (the gap at every evaluation both sides made, against the fraction
of the schedule run, one line per setting and length, the rate steps marked: where in a run
the cost is paid and where it closes). Reads only what ``report`` read; blocks on file I/O
only.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..sync import gradients_per_update
from . import paper, plots
from .compare import config_value

PAPER_BASELINE_ERROR_PCT = 18.0  # the paper's text: the µ = 128, λ = 1 baseline reaches 18 %
PAPER_SOLVER = {"lr": 0.001, "momentum": 0.9}  # cifar10_full's α0 and momentum (its Table 2)
# What a setting is not: seeds (repeats), the schedule's length (a scale of the same schedule)
# and runtime.* (paths, threads, device: nothing learned differs).
NOT_THE_SETTING = {
    "model": ("seed",),
    "train": ("seed", "epochs", "schedule_scale", "checkpoint_every_s"),
    "optimizer": ("lr_steps",),
    "data": ("root", "download"),
}
CSV_FIELDS = (
    "setting",
    "protocol",
    "batch",
    "learners",
    "lr",
    "lr_policy",
    "schedule",
    "epochs",
    "seeds",
    "errors",
    "mean_error",
    "sd_error",
    "gap_points",
    "gap_se_points",
    "relative_step",
    "epoch_factor",
    "paper_gap_points",
)


@dataclass
class Group:
    """The runs of one setting at one schedule scale (each a seed): their final test errors
    (fractions) and what the gap is read against."""

    setting: str  # a short label: protocol, µ, λ, and α0 where it is not the baseline's
    key: str  # the setting's config as canonical JSON (seeds, schedule length, runtime out)
    scale: float
    epochs: float | None
    row: dict  # the first run's report row (protocol, µ, λ, policy, α0, ⟨σ⟩)
    cfg: dict
    errors: list[float]
    sigmas: list[float]
    curves: list[dict[float, float]]  # each seed's test error (fraction) by evaluated epoch

    @property
    def mean(self) -> float:
        return statistics.fmean(self.errors)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.errors) if len(self.errors) > 1 else None


def setting_key(cfg: dict) -> str:
    """The setting a run's ``config.yaml`` dict trains: the config less seeds, schedule
    length, data location and ``runtime.*``, as canonical JSON. Pure."""
    kept = {}
    for section, values in cfg.items():
        if section in ("name", "runtime") or not isinstance(values, dict):
            continue
        drop = NOT_THE_SETTING.get(section, ())
        kept[section] = {k: v for k, v in values.items() if k not in drop}
    return json.dumps(kept, sort_keys=True, default=str)


def is_baseline(cfg: dict) -> bool:
    """The paper's baseline: hardsync with one learner (µ = 128 in the paper). Pure."""
    return (
        config_value(cfg, "sync", "protocol") == "hardsync"
        and config_value(cfg, "sync", "learners") == 1
    )


def relative_step(group: Group, base: Group) -> float | None:
    """The summed step per epoch of ``group`` over the baseline's: per epoch N/(c·µ) updates
    of α0/max(⟨σ⟩, 1) (staleness and per-gradient policies; α0 under the constant one)
    against the baseline's N/(c·µ) of its α0. None where a value is missing. Pure."""

    def step_per_sample(g: Group) -> float | None:
        cfg, row = g.cfg, g.row
        protocol, mu, lam = row["protocol_raw"], row["batch"], row["learners"]
        lr, n = row["lr"], config_value(cfg, "sync", "n") or 1
        if None in (protocol, mu, lam, lr):
            return None
        alpha = lr
        if row["lr_policy"] in ("staleness", "per_gradient"):
            if not g.sigmas:
                return None
            alpha = lr / max(statistics.fmean(g.sigmas), 1.0)
        return alpha / (gradients_per_update(protocol, n, lam) * mu)

    mine, theirs = step_per_sample(group), step_per_sample(base)
    return mine / theirs if mine is not None and theirs else None


def paper_gap(group: Group) -> float | None:
    """The paper's gap for the same Table 2 row (its 140-epoch error minus its baseline's
    18 %, points), or None where Table 2 has no such row, or where the setting is not the
    paper's (another α0 or momentum than cifar10_full's, or not α0/⟨σ⟩). Pure."""
    row = group.row
    ref = paper.table2_row(row["batch"], row["learners"], row["sigma"])
    if ref is None or row["lr_policy"] != "staleness":
        return None
    if any(
        config_value(group.cfg, "optimizer", k) not in (None, v) for k, v in PAPER_SOLVER.items()
    ):
        return None
    return ref.test_error_pct - PAPER_BASELINE_ERROR_PCT


def _label(row: dict, cfg: dict, base_lr) -> str:
    text = f"{row['protocol']}, µ={row['batch']}, λ={row['learners']}"
    if row["lr"] is not None and base_lr is not None and row["lr"] != base_lr:
        text += f", α0={row['lr']:g}"
    momentum = config_value(cfg, "optimizer", "momentum")
    if momentum is not None and momentum != 0.9:
        text += f", momentum {momentum:g}"
    return text


def group_runs(runs, rows) -> list[Group]:
    """Group ``report``'s runs and rows by (setting, scale); runs without a final error are
    left out. Groups come in the order their first run came."""
    groups: dict[tuple[str, float], Group] = {}
    base_lr = next((r["lr"] for run, r in zip(runs, rows) if is_baseline(run.cfg)), None)
    for run, row in zip(runs, rows):
        if row["error_at_budget"] is None or not run.cfg:
            continue
        scale = row["schedule"] or 1.0
        key = setting_key(run.cfg)
        row = dict(row, protocol_raw=config_value(run.cfg, "sync", "protocol"))
        g = groups.get((key, scale))
        if g is None:
            g = groups[key, scale] = Group(
                _label(row, run.cfg, base_lr), key, scale, row["budget"], row, run.cfg, [], [], []
            )
        g.errors.append(row["error_at_budget"])
        g.curves.append(_curve(run.metrics, config_value(run.cfg, "train", "eval_every_epochs")))
        if row["mean_sigma"] is not None:
            g.sigmas.append(row["mean_sigma"])
    return list(groups.values())


def _curve(metrics, every) -> dict[float, float]:
    """A run's test error (fraction) by the epoch of each evaluation, the epoch rounded to
    the evaluation period ``every`` (``train.eval_every_epochs``; 0.01 without one): an
    evaluation comes after the update that crosses its epoch, at 1.00096 for µ = 128 and
    1.0008 for µ = 4, and those must meet. The later record wins a repeated epoch. Pure."""
    step = float(every) if isinstance(every, (int, float)) and every > 0 else 0.01
    out = {}
    for r in metrics.get("eval", ()):
        e, err = r.get("epoch"), r.get("test_error")
        if isinstance(e, (int, float)) and isinstance(err, (int, float)):
            out[round(round(float(e) / step) * step, 6)] = float(err)
    return out


def _mean_curve(g: Group) -> dict[float, float]:
    """The mean over ``g``'s seeds at each epoch that every seed evaluated."""
    common = set.intersection(*(set(c) for c in g.curves)) if g.curves else set()
    return {e: statistics.fmean(c[e] for c in g.curves) for e in sorted(common)}


def _smoothed(curve: dict[float, float]) -> list[tuple[float, float]]:
    """(epoch, error) with each error the mean of itself and its neighbours (evaluations
    move ±2 points from one epoch to the next); epoch 0 (the initial weights) left out."""
    pts = [(e, v) for e, v in sorted(curve.items()) if e > 0]
    out = []
    for i, (e, _) in enumerate(pts):
        near = pts[max(i - 1, 0) : i + 2]
        out.append((e, statistics.fmean(v for _, v in near)))
    return out


def _first_reach(curve: list[tuple[float, float]], level: float) -> float | None:
    """The epoch at which ``curve`` first falls to ``level``, interpolated linearly between
    its evaluations; None where it never does (or already starts below it)."""
    for (e0, v0), (e1, v1) in zip(curve, curve[1:]):
        if v1 <= level < v0:
            return e0 + (e1 - e0) * (v0 - level) / (v0 - v1)
    return None


def epoch_factor(g: Group, base: Group) -> float | None:
    """How many times the baseline's epochs ``g`` needs to reach the same test error, in the
    schedule's first phase (before its first rate step, where both run at their α0): the
    median over ``g``'s evaluations from epoch 2 on of E ÷ the epoch at which the baseline
    first reached ``g``'s error at E, both curves seed-averaged and smoothed over three
    evaluations. A constant factor f means that the final gap is what the baseline still
    gains between E/f and E epochs, which shrinks as its curve flattens. None without two
    evaluations to compare. Pure."""
    steps = [s for s in config_value(g.cfg, "optimizer", "lr_steps") or () if s and s > 0]
    first = min(steps) if steps else math.inf
    mine = [(e, v) for e, v in _smoothed(_mean_curve(g)) if 2 <= e <= first]
    ref = [(e, v) for e, v in _smoothed(_mean_curve(base)) if e <= first]
    ratios = []
    for e, v in mine:
        at = _first_reach(ref, v)
        if at:
            ratios.append(e / at)
    return statistics.median(ratios) if len(ratios) >= 2 else None


def with_baselines(groups: list[Group]) -> list[tuple[Group, Group]]:
    """Each group paired with the baseline group of its schedule scale (the baseline with
    itself), in order; groups whose scale has no baseline, or more than one baseline
    setting, are left out. Pure."""
    bases: dict[float, list[Group]] = {}
    for g in groups:
        if is_baseline(g.cfg):
            bases.setdefault(g.scale, []).append(g)
    return [(g, bases[g.scale][0]) for g in groups if len(bases.get(g.scale, [])) == 1]


def gap_curves(groups: list[Group]) -> list[tuple[Group, list[float], list[float]]]:
    """For each non-baseline group with one baseline at its scale: (group, epochs, gap in
    points) at the epochs both evaluated, seeds averaged on each side. Pure."""
    out = []
    for g, base_group in with_baselines(groups):
        if g is base_group:
            continue
        mine, base = _mean_curve(g), _mean_curve(base_group)
        epochs = [e for e in mine if e in base]
        if epochs:
            out.append((g, epochs, [100 * (mine[e] - base[e]) for e in epochs]))
    return out


def write_gap_curves(groups: list[Group], out_dir: Path) -> list[Path]:
    """``gap_over_training.png``: each setting's gap to the baseline at every evaluation,
    against the fraction of its schedule run (so that lengths line up), a colour per setting,
    a line style per length; the rate steps of each length dotted. [] when no setting has a
    baseline curve to be read against."""
    curves = gap_curves(groups)
    if not curves:
        return []
    settings = list(dict.fromkeys(g.setting for g, *_ in curves))
    scales = sorted({g.scale for g, *_ in curves})
    styles = ("-", "--", "-.", ":")
    fig, ax = plots._figure(size=(8.0, 4.8))
    a = ax[0, 0]
    steps = set()
    for g, epochs, gap in curves:
        length = g.epochs or max(epochs)
        i, k = settings.index(g.setting), scales.index(g.scale)
        a.plot(
            [e / length for e in epochs],
            gap,
            color=f"C{i % 10}",
            linestyle=styles[k % len(styles)],
            marker="o",
            markersize=2.5,
            label=f"{g.setting}, ×{g.scale:g} ({length:g} epochs, {len(g.curves)} seed"
            + ("s)" if len(g.curves) > 1 else ")"),
        )
        for s in config_value(g.cfg, "optimizer", "lr_steps") or ():
            if isinstance(s, (int, float)) and 0 < s < length:
                steps.add(round(s / length, 4))
    for s in sorted(steps):
        a.axvline(s, color="0.4", linestyle=":", linewidth=1)
    a.axhline(0, color="0.5", linewidth=0.8)
    a.set_xlabel("fraction of the schedule run (dotted: the rate's ÷10 steps)")
    a.set_ylabel("test error − baseline's (points)")
    a.set_title("where the staleness cost is paid: the gap at each evaluation")
    a.grid(True, alpha=0.3)
    a.legend(fontsize="small")
    return [plots._save(fig, out_dir / "gap_over_training.png")]


def gap_rows(groups: list[Group]) -> list[dict]:
    """One ``CSV_FIELDS`` row per group that has a baseline at its scale (the baseline's own
    rows included, gap 0). Empty when no scale has exactly one baseline setting."""
    out = []
    for g, base in with_baselines(groups):
        gap = 100 * (g.mean - base.mean)
        se = None
        if g is not base and g.sd is not None and base.sd is not None:
            se = 100 * math.sqrt(g.sd**2 / len(g.errors) + base.sd**2 / len(base.errors))
        out.append(
            {
                "setting": g.setting,
                "protocol": g.row["protocol"],
                "batch": g.row["batch"],
                "learners": g.row["learners"],
                "lr": g.row["lr"],
                "lr_policy": g.row["lr_policy"],
                "schedule": g.scale,
                "epochs": g.epochs,
                "seeds": len(g.errors),
                "errors": " ".join(f"{100 * e:.2f}" for e in g.errors),
                "mean_error": 100 * g.mean,
                "sd_error": None if g.sd is None else 100 * g.sd,
                "gap_points": gap,
                "gap_se_points": se,
                "relative_step": relative_step(g, base),
                "epoch_factor": None if g is base else epoch_factor(g, base),
                "paper_gap_points": paper_gap(g),
            }
        )
    return out


def format_markdown(rows: list[dict]) -> str:
    """The gap rows as a markdown table with a line of explanation under it."""
    head = (
        "| setting | schedule | epochs | seeds | final error (each) | mean ± sd | gap "
        "(points) | step per epoch ÷ baseline's | epochs ÷ baseline's to its error | paper's "
        "gap at 140 epochs |"
    )
    lines = [head, "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        sd = "" if r["sd_error"] is None else f" ± {r['sd_error']:.2f}"
        se = "" if r["gap_se_points"] is None else f" ± {r['gap_se_points']:.2f}"
        step = "" if r["relative_step"] is None else f"{r['relative_step']:.2f}"
        pg = "" if r["paper_gap_points"] is None else f"{r['paper_gap_points']:+.2f}"
        ef = "" if r["epoch_factor"] is None else f"{r['epoch_factor']:.2f}"
        lines.append(
            f"| {r['setting']} | ×{r['schedule']:g} | {r['epochs']:g} | {r['seeds']} | "
            f"{r['errors']} | {r['mean_error']:.2f}{sd} | {r['gap_points']:+.2f}{se} | "
            f"{step} | {ef} | {pg} |"
        )
    lines += [
        "",
        "Gap: the setting's mean final test error minus the baseline's (hardsync, λ = 1) at the "
        "same schedule scale, ± the standard error of the difference where both have 2+ seeds. "
        "Step per epoch ÷ baseline's: (α/(c·µ)) / (α0/128) with α = α0/max(⟨σ⟩, 1) under "
        "α0/⟨σ⟩. Epochs ÷ baseline's: before the first rate step, the median over the "
        "setting's evaluations of its epoch ÷ the epoch at which the baseline first reached "
        "the same error (curves seed-averaged, smoothed over 3 evaluations). The paper's gap: "
        "its Table 2 error minus the 18 % its text gives the baseline.",
    ]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict], path: Path) -> Path:
    """The gap rows as CSV (``CSV_FIELDS``; blanks for missing values)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows({k: ("" if r[k] is None else r[k]) for k in CSV_FIELDS} for r in rows)
    return path


def write_figures(rows: list[dict], out_dir: Path) -> list[Path]:
    """``gap_vs_length.png`` where some setting ran at two schedule lengths or more (or has
    a paper point), and ``gap_vs_step.png``; returns the paths written."""
    others = [r for r in rows if r["gap_points"] is not None and r["learners"] != 1]
    if not others:
        return []
    settings = list(dict.fromkeys(r["setting"] for r in others))
    written = []
    fig, ax = plots._figure(size=(7.5, 4.8))
    a = ax[0, 0]
    for i, s in enumerate(settings):
        mine = sorted((r for r in others if r["setting"] == s), key=lambda r: r["epochs"])
        colour = f"C{i % 10}"
        a.errorbar(
            [r["epochs"] for r in mine],
            [r["gap_points"] for r in mine],
            yerr=[r["gap_se_points"] or 0 for r in mine],
            marker="o",
            capsize=3,
            color=colour,
            label=s,
        )
        pg = mine[0]["paper_gap_points"]
        if pg is not None:
            a.plot([paper.TABLE2_EPOCHS], [pg], marker="*", markersize=12, color=colour)
    a.axhline(0, color="0.5", linewidth=0.8)
    a.set_xscale("log")
    ticks = sorted({r["epochs"] for r in others} | {paper.TABLE2_EPOCHS})
    a.set_xticks(ticks, [f"{t:g}" for t in ticks])
    a.minorticks_off()
    a.set_xlabel("schedule length (epochs; ★ the paper's Table 2 at 140)")
    a.set_ylabel("final test error − baseline's (points)")
    a.set_title("staleness cost against the schedule's length (bars: ± s.e. over seeds)")
    a.grid(True, alpha=0.3)
    a.legend(fontsize="small")
    written.append(plots._save(fig, out_dir / "gap_vs_length.png"))

    fig, ax = plots._figure(ncols=2, size=(5.5, 4.5))
    scales = sorted({r["schedule"] for r in others})
    markers = "osD^v"
    for j, (key, xlabel) in enumerate(
        (("learners", "λ"), ("relative_step", "step per epoch ÷ the baseline's"))
    ):
        a = ax[0, j]
        for k, scale in enumerate(scales):
            mine = [r for r in others if r["schedule"] == scale and r[key] is not None]
            a.errorbar(
                [r[key] for r in mine],
                [r["gap_points"] for r in mine],
                yerr=[r["gap_se_points"] or 0 for r in mine],
                linestyle="none",
                marker=markers[k % len(markers)],
                capsize=3,
                label=f"×{scale:g} ({mine[0]['epochs']:g} epochs)" if mine else None,
            )
            for r in mine:
                a.annotate(
                    r["setting"].split(",")[0] + ("*" if "α0=" in r["setting"] else ""),
                    (r[key], r["gap_points"]),
                    fontsize="x-small",
                    xytext=(3, 3),
                    textcoords="offset points",
                )
        a.axhline(0, color="0.5", linewidth=0.8)
        a.set_xlabel(xlabel)
        a.set_ylabel("final test error − baseline's (points)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize="small")
    ax[0, 0].set_xscale("log")
    ax[0, 0].set_title("gap against λ (* α0 scaled)")
    ax[0, 1].set_title("gap against the step per epoch")
    written.append(plots._save(fig, out_dir / "gap_vs_step.png"))
    return written


def write_gaps(runs, rows, out_dir: Path) -> tuple[str, list[Path]]:
    """Write ``gaps.md``, ``gaps.csv`` and the figures into ``out_dir`` when ``runs`` hold a
    baseline and another setting at one scale; returns (the markdown, paths), ('', []) else."""
    groups = group_runs(runs, rows)
    gaps = gap_rows(groups)
    if not any(r["learners"] != 1 for r in gaps):
        return "", []
    text = format_markdown(gaps)
    (out_dir / "gaps.md").write_text("# The gap to the baseline\n\n" + text)
    paths = [out_dir / "gaps.md", write_csv(gaps, out_dir / "gaps.csv")]
    return text, paths + write_figures(gaps, out_dir) + write_gap_curves(groups, out_dir)
