"""How busy each host link of the emulated LAN is, over time: its interface counters sampled
in the bridge's namespace, drawn as a PNG and written into the timeline as counters; and,
from the same samples, how idle the machine's CPU was meanwhile (``/proc/stat``), so that a
figure shows in the same run whether the links or the cores bound it.

``bench/lan/netns.sh`` joins host I to the bridge by a veth pair whose bridge end ``hI``
lives in the namespace ``PREFIX-br``; that end's counters are host I's link after the
shaping: its ``rx_bytes`` is what host I sent, its ``tx_bytes`` what it received. One
sleeping process in that namespace (its ``/proc/PID/net/dev`` is the namespace's) lets this
process read every link at once, every ``interval_s``, without entering the namespace.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

from .. import timeline

INTERVAL_S = 0.02  # 50 samples a second: a 20 ms bin at 250 Mbit/s is 625 KB
MAX_SAMPLES = 200_000  # about an hour at 50 a second
MIN_JIFFIES = 50  # the least CPU time (1/100 s each, all cores) an idle share is told over


def read_cpu() -> tuple[int, int, int]:
    """(idle, niced, total) jiffies of every core so far (``/proc/stat``; idle counts
    iowait; niced: user time of processes at a positive nice, such as the machine's nice-19
    background work, which yields the cores to the benchmark's)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], fields[1], sum(fields[:8])


def read_dev(path: str) -> dict[str, tuple[int, int]]:
    """``/proc/.../net/dev`` as {interface: (rx_bytes, tx_bytes)}. Blocks for the read."""
    out = {}
    with open(path) as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            fields = rest.split()
            out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


class LinkSampler:
    """Samples the links of hosts ``0..hosts-1`` of the LAN ``prefix`` in a thread of its own
    from ``start`` to ``stop``. ``samples``: (time in µs, [(sent, received) bytes per host],
    (CPU idle, total) jiffies). Not thread-safe beyond that one sampling thread and its owner."""

    def __init__(self, prefix: str, hosts: int, interval_s: float = INTERVAL_S):
        self.prefix, self.hosts, self.interval_s = prefix, hosts, interval_s
        self.samples: list[tuple[int, list[tuple[int, int]], tuple[int, int]]] = []
        self._stop = threading.Event()
        self._anchor = self._thread = None

    def start(self) -> LinkSampler:
        """Start the anchor process in the bridge's namespace and the sampling thread."""
        self._anchor = subprocess.Popen(
            ["ip", "netns", "exec", f"{self.prefix}-br", "sleep", "infinity"]
        )
        path = f"/proc/{self._anchor.pid}/net/dev"
        deadline = time.monotonic() + 10
        while f"h{self.hosts - 1}" not in self._try(path):  # exec'd into the namespace
            if time.monotonic() > deadline or self._anchor.poll() is not None:
                self._anchor.kill()
                raise RuntimeError(f"cannot read the links of {self.prefix}-br ({path})")
            time.sleep(0.01)
        self._thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _try(path: str) -> dict:
        try:
            return read_dev(path)
        except (OSError, ValueError, IndexError):
            return {}

    def _run(self, path: str) -> None:
        names = [f"h{i}" for i in range(self.hosts)]
        while not self._stop.is_set() and len(self.samples) < MAX_SAMPLES:
            dev = self._try(path)
            if dev:
                links = [dev.get(n, (0, 0)) for n in names]
                self.samples.append((timeline.now_us(), links, read_cpu()))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop sampling and the anchor process. Blocks until both ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._anchor is not None and self._anchor.poll() is None:
            self._anchor.kill()
            self._anchor.wait(5)

    def rates(self, t0_us: int = 0, t1_us: int | None = None):
        """Per host, (bin start µs, sent B/s, received B/s) over consecutive samples within
        [t0_us, t1_us]. Pure."""
        s = [x for x in self.samples if x[0] >= t0_us and (t1_us is None or x[0] <= t1_us)]
        out = [[] for _ in range(self.hosts)]
        for (ta, a, _), (tb, b, _) in zip(s, s[1:]):
            dt = (tb - ta) / 1e6
            if dt <= 0:
                continue
            for h in range(self.hosts):
                out[h].append((ta, (b[h][0] - a[h][0]) / dt, (b[h][1] - a[h][1]) / dt))
        return out

    def busy(self, rate_bytes_s: float, t0_us: int, t1_us: int) -> list[tuple[float, float]]:
        """Per host, the fraction of the link's rate used sending and receiving between
        ``t0_us`` and ``t1_us`` (bytes moved / rate x time; TCP/IP headers included). Pure."""
        s = [x for x in self.samples if t0_us <= x[0] <= t1_us]
        if len(s) < 2:
            return [(0.0, 0.0)] * self.hosts
        dt = (s[-1][0] - s[0][0]) / 1e6
        return [
            (
                (s[-1][1][h][0] - s[0][1][h][0]) / (rate_bytes_s * dt),
                (s[-1][1][h][1] - s[0][1][h][1]) / (rate_bytes_s * dt),
            )
            for h in range(self.hosts)
        ]

    def cpu_idle(self, t0_us: int, t1_us: int) -> float | None:
        """The share of the machine's CPU time that was idle between ``t0_us`` and
        ``t1_us`` (every core; None over less than MIN_JIFFIES of CPU time). Pure."""
        return self._cpu_share(t0_us, t1_us, 0)

    def cpu_niced(self, t0_us: int, t1_us: int) -> float | None:
        """As ``cpu_idle``, the share spent in niced processes (background work that the
        benchmark's processes, at nice 0, would have had at once had they asked). Pure."""
        return self._cpu_share(t0_us, t1_us, 1)

    def _cpu_share(self, t0_us: int, t1_us: int, which: int) -> float | None:
        s = [x for x in self.samples if t0_us <= x[0] <= t1_us]
        if len(s) < 2:
            return None
        a, b = s[0][2], s[-1][2]
        n = b[2] - a[2]
        return (b[which] - a[which]) / n if n >= MIN_JIFFIES else None

    def counter_events(self, names: list[str], pid: int) -> list[dict]:
        """The samples as trace counters (Mbit/s sent and received per host, named by
        ``names``) of a process ``pid`` named "links"; timestamps in µs of the wall clock."""
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "links"}}]
        for h, series in enumerate(self.rates()):
            for t, tx, rx in series:
                out.append(
                    {"ph": "C", "name": f"link {names[h]}", "cat": "link", "ts": t, "pid": pid,
                     "tid": 0, "args": {"sent Mbit/s": round(tx * 8e-6, 1),
                                        "received Mbit/s": round(rx * 8e-6, 1)}}
                )  # fmt: skip
        return out


def series_of(sampler: LinkSampler, names: list[str]) -> dict[str, list[tuple]]:
    """Per host name, (µs, sent B/s, received B/s) between consecutive samples. Pure."""
    return dict(zip(names, sampler.rates()))


def series_from_trace(path) -> dict[str, list[tuple]]:
    """The same series read back from a timeline's ``link HOST`` counters (Mbit/s), so a
    trace's PNG can be drawn again from the trace alone. Blocks for the read."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    out: dict[str, list[tuple]] = {}
    for e in events:
        if e["ph"] == "C" and e["name"].startswith("link "):
            a = e["args"]
            out.setdefault(e["name"][5:], []).append(
                (e["ts"], a["sent Mbit/s"] * 125_000, a["received Mbit/s"] * 125_000)
            )
    return out


def write_png(path: str, series: dict[str, list[tuple]], rate_bytes_s: float, title: str,
              bin_s: float = 0.1, spans=()) -> None:  # fmt: skip
    """One panel per host that carried traffic (over 1 % of the busiest one's): the share of its link's rate used sending
    and receiving over time (``bin_s`` bins) from ``series`` (``series_of`` or
    ``series_from_trace``), with ``spans`` ((t0 µs, t1 µs, label), the series' clock)
    shaded in every panel (e.g. the timed epochs). Writes ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from . import common

    moved = {h: sum(tx + rx for _, tx, rx in pts) for h, pts in series.items()}
    most = max(moved.values(), default=0)
    busy = {h: pts for h, pts in series.items() if most and moved[h] >= 0.01 * most}
    if not busy:  # (a host with 1 % of the busiest one's bytes or less is left out)
        return
    t0 = min(pts[0][0] for pts in busy.values())
    fig = Figure(figsize=(10, 0.6 * len(busy) + 1.0), dpi=80, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(busy), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, pts) in zip(axes, busy.items()):
        bins: dict[int, list[float]] = {}
        for t, tx, rx in pts:
            b = bins.setdefault(int((t - t0) / 1e6 / bin_s), [0.0, 0.0, 0])
            b[0], b[1], b[2] = b[0] + tx, b[1] + rx, b[2] + 1
        xs = sorted(bins)
        for j, label in ((0, "sent"), (1, "received")):
            ys = [bins[x][j] / bins[x][2] / rate_bytes_s for x in xs]
            ax.plot([x * bin_s for x in xs], ys, lw=0.8, label=label, antialiased=False)
        for a, b, _label in spans:
            ax.axvspan((a - t0) / 1e6, (b - t0) / 1e6, color="0.9", zorder=0)
        ax.set_ylim(0, 1.1)
        ax.set_yticks([0, 1])
        ax.set_ylabel(name, rotation=0, ha="right", fontsize=7)
    axes[0].legend(fontsize=7, loc="upper right", ncols=2)
    axes[-1].set_xlabel("seconds (share of each link's rate; shaded: timed)")
    common.save_png(fig, title, path)


def main(argv=None) -> None:
    """``python -m rudra_zmq.benchmarks.lan_links TRACE RATE PNG``: draw a timeline's links."""
    import argparse

    from .lan_link import parse_rate

    p = argparse.ArgumentParser(prog="python -m rudra_zmq.benchmarks.lan_links")
    p.add_argument("trace")
    p.add_argument("rate", help="the links' tc rate, e.g. 250mbit")
    p.add_argument("png")
    p.add_argument("--title", help="the figure's title (default: the trace's path)")
    a = p.parse_args(argv)
    title = a.title or f"{a.trace}: each link's use"
    write_png(a.png, series_from_trace(a.trace), parse_rate(a.rate), title)


def summary(
    busy: list[tuple[float, float]], learner_hosts: list[int], server_hosts: list[int]
) -> dict:
    """A row's link columns from ``LinkSampler.busy``: every host's (sent, received) share
    and the means over the learner hosts and over the servers' hosts (None: none). Pure."""

    def mean(hosts, j):
        return sum(busy[h][j] for h in hosts) / len(hosts) if hosts else None

    return {
        "link_busy": [[round(x, 3), round(y, 3)] for x, y in busy],
        "learner_links_sent": mean(learner_hosts, 0),
        "learner_links_received": mean(learner_hosts, 1),
        "server_links_sent": mean(server_hosts, 0),
        "server_links_received": mean(server_hosts, 1),
    }


TCP_KEYS = ("OutSegs", "RetransSegs", "TCPTimeouts", "TCPFastRetrans", "TCPLossProbes")


def tcp_counters(namespaces: list[str]) -> dict[str, int]:
    """TCP's counters (``TCP_KEYS``) summed over the hosts' namespaces, and the packets the
    links' tbf queues dropped (``tbf_dropped``, both ends of every link). Spawns a process per
    namespace: call it between cases, not while one runs. Blocks."""
    out = dict.fromkeys((*TCP_KEYS, "tbf_dropped"), 0)
    for ns in namespaces:
        res = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/snmp", "/proc/net/netstat"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        lines = res.stdout.splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            if head.startswith(("Tcp:", "TcpExt:")):
                for k, v in zip(head.split()[1:], vals.split()[1:]):
                    if k in out:
                        out[k] += int(v)
        qd = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show"], capture_output=True,
                            text=True, timeout=10).stdout  # fmt: skip
        out["tbf_dropped"] += _dropped(qd)
    return out


def _dropped(tc_text: str) -> int:
    """The ``dropped N`` of every qdisc in ``tc -s qdisc show``'s output, summed. Pure."""
    words = tc_text.replace(",", " ").replace("(", " ").split()
    return sum(int(words[i + 1]) for i, w in enumerate(words[:-1]) if w == "dropped")


if __name__ == "__main__":
    main()
