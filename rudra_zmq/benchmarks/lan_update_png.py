"""Draw one update of one learner from a ``lan-table1 --timeline`` trace (docs/architecture.md's
picture): its compute span (forward, then backward, whose hooks push the parts), each part it
queued to each server (``send`` marks: handed to ZeroMQ, not yet on the wire) and each part it
received (``recv``).

    python -m rudra_zmq.benchmarks.lan_update_png TRACE.json OUT.png STEP "TITLE" [PROCESS]

STEP: the learner's step (0 = first); PROCESS: the trace's process name (default learners0).
The forward share is the synthetic model's (a third of its compute).
"""

import json
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def main(src: str, out: str, step: int, title: str, process: str = "learners0") -> None:
    with open(src) as f:
        trace = json.load(f)
    pid = 1 + trace["otherData"]["processes"].index(process)
    mine = [e for e in trace["traceEvents"] if e["pid"] == pid]
    steps = sorted(
        (e for e in mine if e["name"] == "step" and e["ph"] == "X"), key=lambda e: e["ts"]
    )
    t0 = steps[step]["ts"]
    t1 = t0 + steps[step]["dur"]
    comp = next(e for e in mine if e["name"] == "compute" and t0 <= e["ts"] <= t1)
    peers = sorted({e["args"]["peer"] for e in mine if e["name"] in ("send", "recv")})
    fig = Figure(figsize=(10, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    top, fwd = len(peers) + 0.3, comp["dur"] / 3e6
    ax.broken_barh([(0, fwd)], (top, 0.5), color="0.6")
    ax.broken_barh([(fwd, comp["dur"] / 1e6 - fwd)], (top, 0.5), color="0.3")
    ax.text(0.01, top + 0.25, "forward", va="center", fontsize=8, color="w")
    ax.text(
        fwd + 0.01, top + 0.25, "backward (hooks push parts)", va="center", fontsize=8, color="w"
    )
    labels = {"send": "part queued to the server", "recv": "part received"}
    for y, peer in enumerate(peers):
        for name, color, dy in (("send", "tab:blue", 0.15), ("recv", "tab:orange", -0.15)):
            xs = [
                (e["ts"] - t0) / 1e6
                for e in mine
                if e["name"] == name and e["args"]["peer"] == peer and t0 <= e["ts"] <= t1
                and e["args"].get("bytes")
            ]  # fmt: skip
            ax.plot(
                xs,
                [y + dy] * len(xs),
                "|",
                color=color,
                ms=8,
                label=labels[name] if y == 0 else None,
            )
    ax.set_yticks([*range(len(peers)), top + 0.25], [*peers, process])
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("seconds from the step's start")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center left")
    ax.grid(True, axis="x", alpha=0.3)
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
