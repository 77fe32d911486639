"""The statistics server: records every role's metrics and measures test error off the
training path.

Everyone sends one-way to its PULL socket (``rudra_zmq.wire``):

- METRIC x{metric: record}: one record dict with a ``"type"`` (``update``, ``eval``,
  ``learner``, ``ps``, ``members``, ``restart``, ``done``; see ``rudra_zmq.results.plots``), or
  ``{"type": "batch", "items": [record, ...]}``, expanded here. Records carry an absolute
  ``"t"`` (``time.time()``); they are written to ``RUN/metrics.jsonl``, one JSON line each, with
  ``t`` made relative to the server's start ``t0``, and flushed at least every 0.5 s
  (``metrics_file``).
- EVAL (weights payload at ts) x{epoch}: the weights are evaluated on the whole test split
  (``evaluator``) and an ``eval`` record is written. When several EVALs queue up, only the
  newest is evaluated (the others are counted in ``evals_skipped``). Metrics keep flowing
  during a long evaluation: the socket is drained between test batches.
- ``{"type": "done", "ts", "epoch", "evals_sent": n}`` from the parameter server (or, when
  none came, ``RUN/ps_final.json`` saying training is done, recorded as a ``done`` with
  ``"source": "ps_final.json"``) ends the run once the final
  weights are evaluated -- from their EVAL, or from ``RUN/weights.npy`` -- or waited for
  long enough (``run_end``); then it writes ``summary.csv`` and the plots
  (``rudra_zmq.results.plots``), prints ``run directory: RUN`` and returns.

Each server restart and each λ change is written once: one whose ``restart`` or ``members``
record never came (sent while this server was down, say) is read from the server's
``restarts.json`` or ``members.json`` (``missed_records``), and a record that comes again is
not written twice.

It prints a line when training starts (the PS's first update, with the start-up time) and one
per evaluation, with ⟨σ⟩ and samples/s of the updates since the previous line, the seconds of
training so far and an ETA (``progress``). With ``logging.tensorboard`` every record
also goes to TensorBoard (``tensorboard_log``).

Senders must never be slowed by statistics: their :class:`~.client.StatsClient` sends with
NOBLOCK and small high-water marks and drops (and counts) what does not fit. The server
validates everything with ``wire.decode`` and the checks below (who may send what: the
parameter server, the only sender of EVALs, proves itself by its CURVE key or the run's token;
which records a METRIC may carry); a bad message is counted and logged once per sender and
reason, never fatal.
"""

from __future__ import annotations

import collections
import logging
import math
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from .. import transport, wire
from ..results import plots
from ..results.record_fields import DamagedRecord
from ..results.records import check_record, other_server
from ..run_files import SUMMARY_FILE, WEIGHTS_FILE, metrics_path
from ..security import auth
from ..server.end_files import final_weights
from ..server.throttled_log import ThrottledLog
from ..shape import ClusterShape
from ..wire import Kind
from .eval_join import EvalJoin
from .evaluator import Evaluator
from .metrics_file import MetricsFile, finite, json_line
from .missed_records import MissedRecords
from .progress import Progress, is_number
from .run_end import RunEnd, final_record
from .tensorboard_log import TensorBoardLog, check_tensorboard

log = logging.getLogger("rudra_zmq.stats")
RECENT_EVALS = 16  # evaluated timestamps remembered

POLL_MS = 100
DRAIN_MAX = 1000  # messages taken per wake-up before the loop looks at clocks again
RECV_HWM = 2  # per connection on the server; adds to the sender's queue
OWN_RECORDS = {"eval", "start", "resume"}  # written by this server only
PS_RECORDS = {"done", "update", "ps", "members", "restart"}  # by the parameter server only


# ------------------------------------------------------------------ what it takes in
def receiver(ctx: zmq.Context, cfg) -> zmq.Socket:
    """The statistics server's PULL socket (not bound). EVALs come in chunks of
    ``runtime.chunk_mib``. No keepalive probes: a server that only receives needs no news of
    dead senders (and no socket sends ZMTP heartbeats: docs/wire.md, "Liveness")."""
    sock = transport.make_socket(
        ctx, zmq.PULL, hwm=RECV_HWM, max_bytes=transport.frame_limit(cfg.runtime.chunk_mib << 20)
    )
    sock.setsockopt(zmq.TCP_KEEPALIVE, 0)
    return sock


def forged(frames, msg: wire.Message, curve, token) -> str | None:
    """Why ``msg`` (decoded from ``frames``) cannot be from the sender it names, or None. With
    CURVE (``curve``: ``transport.security()``) its key must be allowed to speak as that
    sender; without, what claims to be the PS (and every EVAL) must carry the run's ``token``
    when the server has one (``rudra-zmq run``)."""
    if curve is not None:
        if not curve.may_speak(frames[0], msg.sender):
            return f"its key may not speak as {wire.sender_name(msg.sender)}"
    elif token is not None and (msg.sender == wire.SENDER_PS or msg.kind == Kind.EVAL):
        if not auth.token_matches(msg.fields.get("token"), token):
            return "it claims to be the parameter server without the run's token"
    if msg.kind == Kind.EVAL and msg.sender != wire.SENDER_PS:
        return "only the parameter server sends weights to evaluate"
    return None


def batch_items(rec: dict) -> list | None:
    """The records one METRIC's ``rec`` carries: a ``batch``'s ``items``, else ``[rec]``; None
    when a batch holds no list."""
    items = rec.get("items") if rec.get("type") == "batch" else [rec]
    return items if isinstance(items, list) else None


def record_refusal(r, sender: int) -> tuple[str, str] | None:
    """(code, message) when the record ``r`` from ``sender`` is refused: not a map with a
    string ``type`` (``bad_metric``), or a kind only this server or the PS writes
    (``forged``); None when it may be written."""
    if not isinstance(r, dict) or not isinstance(r.get("type"), str) or r["type"] == "batch":
        return "bad_metric", f"a record that is not a map with a string 'type': {r!r:.80}"
    kind = r["type"]
    if kind in OWN_RECORDS or (kind in PS_RECORDS and sender != wire.SENDER_PS):
        writer = "this server" if kind in OWN_RECORDS else "the PS"
        return "forged", (
            f"a {kind!r} record from {wire.sender_name(sender)}: only {writer} writes those"
        )
    return None


class StatsServer:
    """The statistics server bound at ``bind`` (PULL; see ``.endpoint``), writing ``run_dir``.

    Args:
        cfg: the run's Config (data and model, to evaluate EVALs; ``train.epochs`` for the
            ETA; ``logging.tensorboard``).
        bind: endpoint to bind; ``tcp://HOST:0`` picks a free port.
        run_dir: where ``metrics.jsonl``, ``summary.csv`` and the PNGs go (created).
        ctx: ZeroMQ context; a private one (terminated at the end) if None.
        t0: the time the records' ``t`` is made relative to; default: the start of the run
            in ``run_dir`` (a restarted server), else now.
        dataset: an already loaded ``datasets.Dataset``; default ``data_order.load_data``.
        out: where progress lines go (default stdout).
        announce: say "statistics server listening on ..." there once bound.
    Construct in any thread, then use only from the thread that runs ``serve_forever``.
    Counters: ``records``, ``invalid``, ``evals_done``, ``evals_skipped``, ``repeated`` (a
    restart's or λ change's record that came after it was written: ``missed_records``).
    """

    def __init__(
        self,
        cfg,
        bind: str,
        run_dir,
        ctx: zmq.Context | None = None,
        *,
        t0: float | None = None,
        dataset=None,
        out=None,
        resume: bool = False,
        announce: bool = False,
    ):
        now = time.time()
        if cfg.logging.tensorboard:
            check_tensorboard()  # before anything: the run fails before training starts
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.out = out if out is not None else sys.stdout
        self.records = self.invalid = self.evals_done = self.evals_skipped = self.repeated = 0
        self._warned: set = set()  # what was said once: "diverged", "final_file"
        self.warn = ThrottledLog(log)
        self._pending: tuple[wire.Message, float] | None = None  # newest EVAL, arrival time
        shape = ClusterShape.of(cfg)
        self.end = RunEnd(self.run_dir, cfg.train.epochs, shape)  # the "done"s, EVALs seen
        self.join: EvalJoin | None = None  # the servers' EVAL slices (set once loaded)
        # the timestamps of the newest evaluations written (the final weights' is the last
        # asked for: a run's length of them is not needed)
        self._evaluated: collections.deque = collections.deque(maxlen=RECENT_EVALS)
        self._last_update: tuple = (None, None)  # (ts, t) of the newest update record
        self._tb: TensorBoardLog | None = None
        self._file: MetricsFile | None = None
        self.security, self._token = transport.security(), auth.run_token()
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        self.sock = receiver(self.ctx, cfg)
        self.metrics_path = metrics_path(self.run_dir)
        # A server restarted in a run (or resumed) loads first: senders may leave while the
        # socket goes unread, which can abort libzmq (see receiver). A new one binds first,
        # so that the PS and the learners start while it loads; none of them leaves then.
        restarted = self.metrics_path.is_file()
        try:
            if restarted:
                self._load(cfg, dataset)
            self.endpoint = transport.bind(self.sock, bind)
            self._file = MetricsFile(self.metrics_path, t0, now=now, resume=resume)
            self.t0 = self._file.t0  # a restart goes on with the run's clock
            f = self._file
            self.missed = MissedRecords(self.run_dir, shape, f.kept)
            self.progress = Progress(
                cfg.train.epochs,
                cfg.sync.batch_size,
                f.started,
                begun=f.begun,
                trained_s=f.trained_s,
            )
            if cfg.logging.tensorboard:
                self._tb = TensorBoardLog(
                    self.run_dir, self.t0, cfg.sync.learners, self._file.started
                )
            if announce:  # when it is so: before a new server's data and model load
                self._print(
                    f"statistics server listening on {self.endpoint} (waiting for the "
                    f"parameter server and {cfg.sync.learners} learners)"
                )
            if not restarted:  # what the PS and learners send meanwhile waits here
                self._load(cfg, dataset)
        except BaseException:
            if self._file is not None:
                self._file.close()
            self.sock.close(linger=0)
            if self._own_ctx:
                transport.term(self.ctx)
            raise

    def _load(self, cfg, dataset) -> None:
        """The test split and the model to evaluate (seconds: torch, the data). Blocks."""
        self.evaluator = Evaluator(cfg, dataset)
        self.flat = self.evaluator.flat
        t = cfg.train
        every = t.eval_every_epochs if not t.eval_every_updates else 0.0
        self.join = EvalJoin(ClusterShape.of(cfg, self.flat.numel), every)

    # ------------------------------------------------------------------ receiving
    def _drain(self) -> int:
        """Take every queued message (up to DRAIN_MAX): METRICs are written at once, EVALs
        become pending. Does not block. Returns how many messages it took."""
        taken = transport.drain(self.sock, self.handle, DRAIN_MAX)
        self._file.flush(force=False)
        return taken

    def handle(self, frames) -> None:
        """Process one message. Never raises for bad input (counts and logs it)."""
        now = time.time()
        try:
            # EVALs are the servers' slices: the join checks each one's size against its range
            msg = wire.decode(frames, kinds={Kind.METRIC, Kind.EVAL})
        except wire.WireError as exc:
            self._refuse("an unknown sender", exc.code, str(exc))
            return
        who = f"sender {msg.sender}"
        if why := forged(frames, msg, self.security, self._token):
            self._refuse(who, "forged", why)
            return
        if msg.kind == Kind.EVAL:
            self.end.eval_received(msg.sender)
            if why := self.join.refusal(msg):
                self._refuse(who, "bad_eval", why)
                return
            if (msg := self.join.add(msg)) is None:
                return  # waits for the other servers' slices
            if self._pending is not None:
                self.evals_skipped += 1  # a newer one arrived before we got to it
            self._pending = (msg, now)
            return
        items = batch_items(msg.fields["metric"])
        if items is None:
            self._refuse(who, "bad_metric", "a 'batch' record without a list of 'items'")
            return
        for r in items:
            if refused := record_refusal(r, msg.sender):
                self._refuse(who, *refused)
            else:
                self._record(r, now, msg.sender)

    def _record(self, r: dict, now: float, sender: int) -> None:
        kind = r["type"]
        t = r.get("t")
        rel = (t if is_number(t) else now) - self.t0
        r = {**r, "t": round(rel, 6)}
        try:  # as it will be written: what read_metrics would refuse is refused here
            check_record(finite(r), f"a record from {wire.sender_name(sender)}")
        except DamagedRecord as exc:
            self._refuse(f"sender {sender}", "bad_metric", str(exc))
            return
        try:
            line = json_line(r)
        except (TypeError, ValueError) as exc:  # e.g. a bytes key: msgpack allows, JSON not
            self._refuse(f"sender {sender}", "bad_metric", f"a record JSON cannot hold: {exc}")
            return
        if kind == "update" and not other_server(r):  # progress: server 0's clock
            self._last_update = (r.get("ts"), r["t"])
            self._print(*self.progress.update(r))
        elif not self.missed.first(r):  # a restart or λ change written already (from files)
            self.repeated += 1
            return
        elif kind == "members":
            self._print(*self.progress.members(r))
        elif kind == "restart":
            self._print(*self.progress.restart(r))
        elif kind == "done":
            self.end.done_received(r, now, sender)
        self._write(r, line)

    def _write(self, rec: dict, line: str) -> None:
        self._file.write(line)
        self.records += 1
        if self._tb is not None:
            self._tb.record(rec)

    def _refuse(self, who: str, code: str, message: str) -> None:
        self.invalid += 1
        # logged at a bounded rate per sender and reason (a bounded number of them), count all
        self.warn.warning(
            (who, code), "statistics server: ignored a message from %s: %s", who, message
        )

    # ------------------------------------------------------------------ evaluating
    def evaluate(self, weights_parts, stop_event=None) -> tuple[float, float] | None:
        """(test error 0..1, mean test loss) of the weights (one float32 array, or a list of
        the chunks of an EVAL) over the whole test split, or None if ``stop_event`` was set
        meanwhile (``Evaluator.evaluate``). Blocks; drains metrics between test batches."""
        return self.evaluator.evaluate(weights_parts, self._drain, stop_event)

    def _evaluate_pending(self, stop_event) -> None:
        msg, arrived = self._pending
        self._pending = None
        ts, epoch = msg.ts, float(msg.fields["epoch"])
        server_ts = msg.fields.get("server_ts")  # a sharded run: every server's timestamp
        result = self.evaluate(msg.payloads, stop_event)
        del msg  # frees the weights frames
        if result is None:
            self.evals_skipped += 1
            return
        # self._pending may hold a newer EVAL now: it arrived during the evaluation.
        rec = {"ts": ts, "t": round(arrived - self.t0, 6), "epoch": epoch}
        if server_ts is not None:
            rec["server_ts"] = server_ts
        self._record_eval(rec, result)

    def _record_eval(self, rec: dict, result: tuple[float, float]) -> None:
        """Write and print the evaluation ``result`` (error, loss) of the weights ``rec``
        names (ts, t, epoch)."""
        error, loss = result
        rec = {"type": "eval", **rec, "test_error": error, "test_loss": loss}
        self._write(rec, json_line(rec))
        self.evals_done += 1
        self._evaluated.append(rec["ts"])
        self._file.flush()
        self._print(*self.progress.evaluated(rec["t"], rec["ts"], rec["epoch"], error, loss))
        if not math.isfinite(loss) and "diverged" not in self._warned:  # say it once
            self._warned.add("diverged")
            self._print(
                f"warning: the test loss is {loss} at epoch {rec['epoch']:.2f}: training "
                "has diverged and will not recover; lower optimizer.lr (with a stale "
                "protocol, optimizer.lr_policy=staleness)"
            )

    def _evaluate_final_file(self, stop_event) -> bool:
        """Evaluate the final weights from ``weights.npy`` when they are there
        (``end_files.final_weights``); returns whether it did. Blocks for the evaluation."""
        try:
            w = final_weights(self.run_dir, self.end.done["ts"], self.flat.numel)
        except ValueError as exc:
            if "final_file" not in self._warned:
                self._warned.add("final_file")
                log.warning("statistics server: %s", exc)
            return False
        if w is None:
            return False
        result = self.evaluate(w, stop_event)
        if result is None:
            return False
        log.info(
            "statistics server: the final weights' EVAL (ts %d) did not arrive; "
            "evaluated %s instead",
            self.end.done["ts"],
            self.run_dir / WEIGHTS_FILE,
        )
        self._record_eval(final_record(self.end.done, *self._last_update), result)
        return True

    def _print(self, *lines: str) -> None:
        if self.out is None:
            return
        try:
            for line in lines:
                try:
                    print(line, file=self.out, flush=True)
                except UnicodeEncodeError:  # a terminal without UTF-8
                    print(
                        line.replace("σ", "sigma").replace("λ", "lambda"), file=self.out, flush=True
                    )
        except BrokenPipeError:
            # the reader (the launcher, which echoes these lines) is gone: everything is in
            # the run directory, so go on without progress lines rather than fail
            log.warning("statistics server: progress output closed; no more progress lines")
            self.out = None

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event: threading.Event | None = None) -> str:
        """Record and evaluate until a "done" record (and the EVALs it announced) or
        ``stop_event``; then write summary.csv and the plots and close. Blocks.
        Returns ``"done"`` or ``"stopped"``."""
        reason = "stopped"
        try:
            while stop_event is None or not stop_event.is_set():
                if self._pending is not None:
                    self._evaluate_pending(stop_event)
                    continue  # look for more messages before deciding anything else
                self._missed_records()
                if self._finished(stop_event):
                    reason = "done"
                    break
                if self.sock.poll(POLL_MS):
                    self._drain()
                else:
                    self._file.flush(force=False)
        finally:
            if self._pending is not None:
                self.evals_skipped += 1  # stopped before it was evaluated
                self._pending = None
            self._finish()
        return reason

    def _finished(self, stop_event=None) -> bool:
        """Training is over and its final weights are evaluated -- from their EVAL, or from
        ``weights.npy`` (blocks for that evaluation) -- or waited for long enough. A ``done``
        without ``ts`` waits for the EVALs it announced instead (``run_end``)."""
        now = time.time()
        if not self.end.look_for_file(now, self.t0):
            return False
        if (rec := self.end.file_record()) is not None:
            self._write(rec, json_line(rec))
        verdict = self.end.verdict(now, self._evaluated)
        if verdict != "final":
            return verdict == "finished"
        if self._evaluate_final_file(stop_event):
            return True
        if self.end.waited_out(now):
            log.warning(
                "statistics server: the final weights (ts %d) were not evaluated: "
                "their EVAL did not arrive and %s does not hold them",
                self.end.done["ts"],
                self.run_dir / WEIGHTS_FILE,
            )
            return True
        return False

    def _missed_records(self, force: bool = False) -> None:
        """Write the restarts and λ changes the servers' files keep and no record said
        (``missed_records``); ``force``: every one, now (the run is over). Reads a few small
        files, at most every ``missed_records.LOOK_EVERY_S`` unless ``force``."""
        now = time.time()
        for rec in self.missed.missed(now, force):
            self._record(rec, now, wire.SENDER_PS)

    def _finish(self) -> None:
        self._missed_records(force=True)  # the last look: every one the files keep is written
        self._print(*self.progress.flush())
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        try:
            metrics = plots.read_metrics(self.metrics_path)
            plots.write_summary_csv(metrics, self.run_dir / SUMMARY_FILE)
            plots.plot_run(self.run_dir)
        except Exception:  # the metrics are safe on disk; plots can be redrawn from them
            log.exception("statistics server: could not write summary.csv or the plots")
        unjoined = self.join.dropped + len(self.join.open) if self.join is not None else 0
        if self.invalid or self.evals_skipped or unjoined:
            log.info(
                "statistics server: %d invalid messages ignored, %d evaluations skipped, "
                "%d left without every server's slice",
                self.invalid,
                self.evals_skipped,
                unjoined,
            )
        self._print(f"run directory: {self.run_dir}")
        if not self.sock.closed:
            self.sock.close(linger=0)
        if self._own_ctx and not self.ctx.closed:
            transport.term(self.ctx)


def serve(cfg, bind: str, run_dir, resume: bool = False) -> int:
    """Entry point of ``rudra-zmq stats``: run until the PS reports "done" or SIGTERM/SIGINT;
    either way write summary.csv and the plots. Evaluates on one torch thread. Returns 0."""
    stop = threading.Event()
    server = StatsServer(cfg, bind, run_dir, resume=resume, announce=True)
    import torch  # loaded by the model already; not before it, which would delay the bind

    torch.set_num_threads(1)  # evaluation shares the machine with the learners
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        server.serve_forever(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


__all__ = ["StatsServer", "serve"]
