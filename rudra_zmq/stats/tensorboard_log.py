"""TensorBoard scalars of a run (``logging.tensorboard: true``): the statistics server hands
every record it writes to ``metrics.jsonl`` to a ``TensorBoardLog`` too, which writes them with
``torch.utils.tensorboard.SummaryWriter`` into ``RUN_DIR/tensorboard/``:

    tag                        from record   value
    test/error                 eval          test error, 0..1 as in metrics.jsonl
    test/loss                  eval          mean test loss
    staleness/mean_sigma       update        ⟨σ⟩ of the update's gradients
    throughput/samples_per_s   learner       the learners' samples/s, each one's latest, summed
    throughput/updates_per_s   ps            the parameter server's updates/s
    sync/learners              members       λ (``sync.learners`` when training starts)

The step is the parameter server's timestamp (updates applied: the record's ``ts``). The wall
time is the record's, except that what came before training started (the evaluation of the
initial weights, the PS's rates of 0) is written when it starts, stamped with its time, the
newest value of each tag only, so TensorBoard's *Relative* axis counts from the start of
training (``plots.startup_s``).
``rudra-zmq compare`` stays the way to put runs side by side.

TensorBoard is an optional extra (``pip install 'rudra_zmq[tensorboard]'``): ``check_tensorboard``
says so before a run starts without it.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..results.records import other_server
from ..run_files import TB_DIR
from .progress import is_number

FLUSH_S = 5  # events reach the disk at least this often
MAX_QUEUE = 1000  # ... or when this many wait
MISSING = "logging.tensorboard needs the tensorboard package: pip install 'rudra_zmq[tensorboard]'"


def check_tensorboard() -> None:
    """Raise ConfigError saying how to install TensorBoard when ``torch.utils.tensorboard``
    cannot be imported. Blocks on the import (a second or two the first time)."""
    try:
        import tensorboard  # noqa: F401  (torch's message would not name our extra)
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{MISSING} ({exc})") from None


class TensorBoardLog:
    """Writes the scalars of records into ``run_dir/tensorboard/``.

    Args:
        run_dir: the run directory.
        t0: the run's start (Unix time); records' ``t`` are seconds since then.
        learners: λ at the start of training.
        started: the run-clock time training started, for a statistics server restarted in a
            run that had (else None).
    Raises ConfigError without TensorBoard. Not thread-safe: use from one thread (the
    SummaryWriter writes the file from a thread of its own). ``close()`` when done.
    """

    def __init__(self, run_dir, t0: float, learners: int, started: float | None = None):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter  # an optional dependency

        self.writer = SummaryWriter(
            str(Path(run_dir) / TB_DIR), max_queue=MAX_QUEUE, flush_secs=FLUSH_S
        )
        self.t0, self.started = t0, started
        self._early: dict = {}  # tag -> (value, step, t): the newest before
        #                                       training started (the PS reports every second)
        self._rates: dict = {}
        self._ts = 0  # the newest PS timestamp seen
        if started is None:  # λ from the start (a restart may not know it)
            self._scalar("sync/learners", learners, 0, 0.0)

    def record(self, r: dict) -> None:
        """Write the scalars of one record (as written to metrics.jsonl; others ignored). A
        sharded run's servers other than 0 write under ``server-I/`` tags (their own
        timestamps)."""
        kind, t = r.get("type"), r.get("t")
        if not is_number(t):
            return
        if other_server(r):
            step = r.get("ts")
            tag = "staleness/mean_sigma" if kind == "update" else "throughput/updates_per_s"
            value = r.get("mean_sigma" if kind == "update" else "updates_per_s")
            if is_number(step):
                self._scalar(f"server-{r['server']}/{tag}", value, step, t)
            return
        step = r["ts"] if is_number(r.get("ts")) else self._ts
        if kind == "update":
            if self.started is None:
                self._start(t)
            self._ts = max(self._ts, step)
            self._scalar("staleness/mean_sigma", r.get("mean_sigma"), step, t)
        elif kind == "eval":
            self._scalar("test/error", r.get("test_error"), step, t)
            self._scalar("test/loss", r.get("test_loss"), step, t)
        elif kind == "learner" and is_number(r.get("samples_per_s")):
            self._rates[r.get("learner")] = r["samples_per_s"]
            self._scalar("throughput/samples_per_s", sum(self._rates.values()), step, t)
        elif kind == "ps":
            self._scalar("throughput/updates_per_s", r.get("updates_per_s"), step, t)
        elif kind == "members":
            self._scalar("sync/learners", r.get("learners"), step, t)

    def _scalar(self, tag: str, value, step, t: float) -> None:
        if not is_number(value):
            return
        if self.started is None:
            self._early[tag] = (value, step, t)
            return
        self.writer.add_scalar(tag, value, int(step), walltime=self.t0 + max(t, self.started))

    def _start(self, t: float) -> None:
        """Training started at ``t``: write what came before, stamped with that time."""
        self.started = t
        early, self._early = self._early, {}
        for tag, (value, step, _) in early.items():
            self._scalar(tag, value, step, t)

    def close(self) -> None:
        """Write what is left (at its own times if training never started) and close.
        Blocks until the events are on disk."""
        if self._early:
            self.started = min(t for *_, t in self._early.values())  # so they are written
            early, self._early = self._early, {}
            for tag, (value, step, t) in early.items():
                self._scalar(tag, value, step, t)
        self.writer.close()
