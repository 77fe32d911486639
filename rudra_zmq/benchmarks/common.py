"""What every ``rudra-zmq bench`` command shares: sizes, timing, statistics and output.

- **Sizes**: ``parse_size("4K")`` (K/M/G are powers of 1000, Ki/Mi/Gi of 1024) and
  ``sweep(begin, end, factor)``, the ``-b/-e/-f`` of nccl-tests.
- **Timing**: a warm-up, then an iteration count calibrated from the warm-up's rate so that a
  case lasts about ``--seconds``, repeated ``--repeat`` times: min / median / max over the
  repeats and percentiles over single operations (``summary``).
- **Output**: :class:`Report` prints a machine header (CPU, load, versions, build, the
  environment that changes results), one human-readable line per case (or one JSON object per
  line with ``--json``), and writes ``--csv`` (one row per case) and ``--png`` (bandwidth and
  latency against size, log-log, one series per case label).

- **Sweeps**: ``thr`` and ``lat`` share their options and ``run()`` in
  :mod:`.transport_sweep`.

The two sides of a command (``--bind``/``--connect``) are in :mod:`.sides`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import time

import numpy as np
import zmq

DEFAULT_SECONDS = 1.0  # timed seconds per case and repeat
DEFAULT_WARMUP_S = 0.2  # untimed seconds per case
DEFAULT_REPEAT = 3  # timed repeats per case (min / median / max)
ENV_KEYS = (
    "RUDRA_ZMQ_KERNELS",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "ZMQ_IO_THREADS",
)


# ----------------------------------------------------------------------------- sizes
def parse_size(text: str) -> int:
    """``"64"``, ``"4K"`` (4,000), ``"1.5M"``, ``"16Mi"`` (16 x 2**20) -> int; ValueError."""
    s = str(text).strip()
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, mult in units.items():
        if s.endswith(suffix) or s.endswith(suffix.lower()):
            s, factor = s[: -len(suffix)], mult
            break
    else:
        factor = 1
    try:
        value = float(s.replace("_", "").replace(",", "")) * factor
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 64, 4K, 1.5M, 16Mi)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"size {text!r} must be a whole number >= 1")
    return int(value)


def fmt_count(n: int) -> str:
    """1000000 -> ``1M``, 16777216 -> ``16Mi``, 89578 -> ``89,578``."""
    for suffix, div in (
        ("Gi", 2**30),
        ("G", 10**9),
        ("Mi", 2**20),
        ("M", 10**6),
        ("Ki", 2**10),
        ("K", 10**3),
    ):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return f"{n:,}"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def sweep(begin: int, end: int, factor: float) -> list[int]:
    """begin, begin*factor, ... up to end (inclusive), like nccl-tests' ``-b -e -f``."""
    if begin > end:
        raise ValueError(f"-b {begin} is larger than -e {end}")
    if factor <= 1 and begin != end:
        raise ValueError(f"-f must be > 1 for a sweep, got {factor}")
    out, x = [], float(begin)
    while round(x) <= end:
        out.append(int(round(x)))
        if factor <= 1:
            break
        x *= factor
    return out


def add_size_args(
    p, default_begin: str, default_end: str, default_factor: float, what: str
) -> None:
    p.add_argument(
        "-b",
        "--minsize",
        default=default_begin,
        metavar="SIZE",
        help=f"smallest {what} (default {default_begin})",
    )
    p.add_argument(
        "-e",
        "--maxsize",
        default=default_end,
        metavar="SIZE",
        help=f"largest {what} (default {default_end})",
    )
    p.add_argument(
        "-f",
        "--stepfactor",
        type=float,
        default=default_factor,
        metavar="F",
        help=f"multiply the size by F between cases (default {default_factor:g})",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        metavar="SIZE",
        help="explicit sizes instead of -b/-e/-f, e.g. 90K 1M 10M",
    )


def sizes_from_args(args) -> list[int]:
    if args.sizes:
        return [parse_size(s) for s in args.sizes]
    return sweep(parse_size(args.minsize), parse_size(args.maxsize), args.stepfactor)


def add_timing_args(p) -> None:
    p.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"timed seconds per repeat of a case (default {DEFAULT_SECONDS:g})",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=DEFAULT_WARMUP_S,
        metavar="S",
        help=f"untimed warm-up seconds per case (default {DEFAULT_WARMUP_S:g})",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=DEFAULT_REPEAT,
        help=f"timed repeats per case: min/median/max (default {DEFAULT_REPEAT})",
    )


def add_output_args(p) -> None:
    p.add_argument("--csv", metavar="PATH", help="write one row per case here")
    p.add_argument("--png", metavar="PATH", help="plot bandwidth and latency vs size here")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per line instead of text (for scripts)",
    )


# ----------------------------------------------------------------------------- timing
def calibrate(per_op_s: float, seconds: float, lo: int = 3, hi: int = 10_000_000) -> int:
    """Operations that take about ``seconds`` at ``per_op_s`` each, within [lo, hi]."""
    return int(min(hi, max(lo, seconds / max(per_op_s, 1e-9))))


def warm_up(fn, seconds: float, at_least: int = 2) -> float:
    """Call ``fn()`` for ``seconds`` (and ``at_least`` times); return seconds per call."""
    t0, k = time.perf_counter(), 0
    while k < at_least or time.perf_counter() - t0 < seconds:
        fn()
        k += 1
    return (time.perf_counter() - t0) / k


def summary(samples) -> dict:
    """min, p50, p90, p99, max, mean and count of a list of numbers (empty: all NaN)."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {k: math.nan for k in ("min", "p50", "p90", "p99", "max", "mean")} | {"count": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "min": float(a.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "count": int(a.size),
    }


def mmm(values) -> tuple[float, float, float]:
    """(min, median, max) of the repeats' figures."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.min()), float(np.median(a)), float(a.max())


# ----------------------------------------------------------------------------- machine header
def machine_facts(env_keys=ENV_KEYS, **extra) -> dict:
    """What a reader needs to trust a figure: CPU, cores, load, versions, build, and the
    environment variables ``env_keys``; ``extra`` items are added (``torch``/``psutil``
    versions appear in :func:`header_text`)."""
    import rudra_zmq

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
            )
    except OSError:
        pass
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "loadavg": list(os.getloadavg()),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "build_info": rudra_zmq.build_info(),
        "env": {k: os.environ.get(k, "(unset)") for k in env_keys},
        **extra,
    }


def kernels_line(bi: dict | None = None) -> str:
    """``# kernels: <variant> variant (this CPU runs ...) ...``: the kernels in use, from
    ``rudra_zmq.build_info()`` (or ``bi``), for every benchmark's header. Does not block."""
    if bi is None:
        import rudra_zmq

        bi = rudra_zmq.build_info()
    return (
        f"# kernels: {bi.get('variant')} variant (this CPU runs "
        f"{', '.join(bi.get('variants_available', ()))}) openmp={bi.get('openmp')} "
        f"threads={bi.get('num_threads')} compile_args='{bi.get('compile_args')}'"
    )


def header_text(title: str, facts: dict, notes=()) -> str:
    """The ``# ...`` header lines printed above a benchmark's cases."""
    bi = facts["build_info"]
    libs = "  ".join(
        f"{k} {facts[k]}"
        for k in ("python", "numpy", "pyzmq", "libzmq", "torch", "psutil")
        if k in facts
    )
    lines = [
        f"# rudra_zmq {title}  {facts['time']}  host {facts['host']}",
        f"# cpu: {facts['cpu_model']} x{facts['nproc']}  loadavg: "
        + " ".join(f"{x:.2f}" for x in facts["loadavg"]),
        f"# {libs}",
        kernels_line(bi),
        "# env: " + " ".join(f"{k}={v}" for k, v in facts["env"].items()),
    ]
    return "\n".join(lines + [f"# {n}" for n in notes])


# ----------------------------------------------------------------------------- output
class Report:
    """Prints a benchmark's header and cases and writes its CSV/PNG at ``close()``.

    ``plot`` = (x key, [(y key, axis label), ...], series key[, keep]): one log-log panel
    per y, one line per series, of the rows ``keep(row)`` accepts (see ``write_png``).
    Not thread-safe; prints to stdout (flushed per line).
    """

    def __init__(self, args, title: str, notes=(), plot=None, **facts):
        self.args, self.title, self.plot = args, title, plot
        self.rows: list[dict] = []
        self.facts = machine_facts(**facts)
        self.emit(
            {"type": "header", "title": title, **self.facts, "notes": list(notes)},
            header_text(title, self.facts, notes),
        )

    def emit(self, obj: dict, text: str) -> None:
        print(json.dumps(obj) if self.args.json else text, flush=True)

    def note(self, text: str, **obj) -> None:
        self.emit({"type": "note", "text": text, **obj}, f"# {text}")

    def case(self, record: dict, text: str, rows=None) -> None:
        """Print one case; ``rows`` (default: the record) go to the CSV and the plot."""
        self.rows.extend([record] if rows is None else rows)
        self.emit({"type": "case", **record}, text)

    def close(self) -> None:
        self.emit(
            {"type": "end", "loadavg": list(os.getloadavg())},
            "# loadavg at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        )
        if self.args.csv:
            write_csv(self.args.csv, self.rows)
        if self.args.png and self.plot:
            write_png(self.args.png, self.rows, *self.plot, title=f"rudra_zmq {self.title}")


def write_csv(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r)) or ["case"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)


def write_png(
    path: str, rows: list[dict], x: str, panels, series: str, keep=None, *, title: str
) -> None:
    """One log-log panel per (y key, label): y against ``x``, one line per ``series`` value,
    of the rows that ``keep(row)`` accepts (all by default)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0 * len(panels), 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    rows = [r for r in rows if keep is None or keep(r)]
    labels = list(dict.fromkeys(r[series] for r in rows))
    for ax, (ykey, ylabel) in zip(axes, panels):
        for label in labels:
            pts = sorted(
                (r[x], r[ykey])
                for r in rows
                if r[series] == label and r.get(ykey) is not None and r[ykey] > 0
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    if labels:
        axes[0].legend(fontsize=7)
    save_png(fig, title, path)


def save_png(fig, title: str, path: str) -> None:
    """Title ``fig`` and write it to ``path`` as PNG, making its folder if needed (every
    bench's plot ends so)."""
    fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")


def resolve_quick(args, defaults: dict, quick: dict) -> argparse.Namespace:
    """Fill the options named in ``defaults`` that the command line left at None: from
    ``quick`` with ``--quick`` (``args.quick``), else from ``defaults``; so ``--quick --epochs
    200`` runs 200 epochs. Declare those options with ``default=None``. Returns ``args``."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, quick.get(k, v) if args.quick else v)
    return args
