"""What ``bench lan-table1`` prints and draws: one line per case, Table 1's order, and the
plot of seconds per epoch (beside each case's link bound) and the busiest server's ingress.
Pure but for ``write_png``, which writes its file."""

from __future__ import annotations

from . import common
from .lan_link import BASELINES, MIB, retries_text


def links_text(r: dict) -> str:
    """The links' and the CPU's use over the timed epochs (``lan_links.summary``, ``cpu_idle``),
    for a result line ("" where not measured). Pure."""
    said = []
    for who in ("learner", "server"):
        if r.get(f"{who}_links_sent") is not None:
            said.append(
                f"{who} links busy {r[f'{who}_links_sent']:.2f} out {r[f'{who}_links_received']:.2f} in"
            )
    if r.get("tcp_OutSegs"):
        said.append(
            f"tcp retrans {r['tcp_RetransSegs'] / r['tcp_OutSegs']:.2%} of segments, "
            f"{r['tcp_TCPTimeouts']} timeouts, {r['tcp_tbf_dropped']} tbf drops"
        )
    if r.get("cpu_idle") is not None:
        said.append(f"cpu idle {r['cpu_idle']:.2f}")
        if r.get("cpu_niced"):  # nice-19 background work, which yields to the benchmark
            said[-1] += f" (+{r['cpu_niced']:.2f} niced)"
    return f"  [{'; '.join(said)}]" if said else ""


def line(r: dict) -> str:
    eps = " ".join(f"{x:.2f}" for x in r["epoch_s"])
    bound = "" if r["of_bound"] is None else f"  {r['of_bound']:.2f} of its bound"
    bound += links_text(r)
    head = (
        f"table1 {r['case']:<17} λ={r['learners']} ({r['hosts']} hosts x {r['per_host']}) "
        f"n={common.fmt_count(r['params'])} {r['rate']}  {r['s_per_epoch']:7.2f} s/epoch "
        f"[epochs {eps}]"
    )
    if r["case"].startswith(BASELINES):
        step = r["s_per_epoch"] * r["learners"] / r["epoch_gradients"]
        return f"{head}  {step:.3f} s/step{bound}"
    return (
        f"{head}  root in {r['root_rx_bytes_per_epoch'] / MIB:8.1f} MiB/epoch "
        f"({r['root_rx_bytes_per_gradient'] / MIB:.2f} MiB/grad) out "
        f"{r['root_tx_bytes_per_epoch'] / MIB:8.1f} MiB/epoch  {r['updates_per_epoch']:.0f} "
        f"upd/epoch  <σ> {r['mean_sigma']:.2f}  root cpu {r['root_cpu_s']:.1f} s  "
        f"wall {r['wall_s']:.1f} s{bound}{retries_text(r)}{streamed_text(r)}"
    )


def streamed_text(r: dict) -> str:
    """The product learners' messages sent from inside backward, of all they sent
    (``lan_link.pushed_in_backward``), for a result line ("" for other learners). Pure."""
    if "sent_during_backward" not in r:
        return ""
    d, a = r["sent_during_backward"], r["sent_after_backward"]
    if not r["streamed"]:
        return "  [product learner: every push after backward]"
    ahead = r.get("layers_ahead")
    early = f"; {ahead} layer forwards ran before their reply was whole" if ahead else ""
    return f"  [product learner: {d} of {d + a} messages pushed during backward{early}]"


def ordering(rows: list[dict], cases: list[str]) -> tuple[str, bool]:
    """The measured order (slowest first) and whether it is the expected one (CASES' order:
    each case faster than the one before it)."""
    measured = [r["case"] for r in sorted(rows, key=lambda r: -r["s_per_epoch"])]
    expected = [c for c in cases if c in measured]
    return " > ".join(measured), measured == expected


def write_png(path: str, rows: list[dict]) -> None:
    """Horizontal bars, one per case (first on top; long names stay readable with many
    rows): seconds per epoch with its link bound, and the busiest server's ingress."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    height = 1.6 + 0.28 * len(rows)
    fig = Figure(figsize=(12, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    names = [r["case"] for r in rows]
    ys = list(range(len(rows)))
    for ax, (key, scale, label) in zip(
        fig.subplots(1, 2, sharey=True),
        [
            ("s_per_epoch", 1, "seconds per epoch"),
            ("busiest_rx_bytes_per_epoch", MIB, "busiest server's ingress per epoch (MiB)"),
        ],
    ):
        # one root: its ingress; sharded servers: the busiest one's, not their sum
        vals = [r.get(key, r.get("root_rx_bytes_per_epoch")) or 0 for r in rows]
        ax.barh(ys, [v / scale for v in vals], height=0.7)
        if key == "s_per_epoch":  # each case's link bound, where one is stated
            pts = [(r["bound_s_per_epoch"], y) for y, r in zip(ys, rows)]
            pts = [(b, y) for b, y in pts if b is not None]
            if pts:
                ax.scatter(*zip(*pts), marker="|", s=300, color="k", label="link bound")
                ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_yticks(ys, names, fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    ax.invert_yaxis()  # shared: the first case on top in both panels
    r0 = rows[0]
    title = (
        f"rudra_zmq Table 1 on emulated hosts: λ={r0['learners']} ({r0['hosts']} "
        f"hosts), {common.fmt_count(r0['params'])} parameters, {r0['rate']} links"
    )
    common.save_png(fig, title, path)
