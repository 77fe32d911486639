"""The learner: computes gradients with PyTorch and trades them for weights with the PS.

Loop (one learner)::

    minibatch of µ samples from the data server (prefetched, so it is usually already here)
    -> forward/backward on the flat model (p.grad are views into one float32 buffer)
    -> PUSHPULL: the gradient, stamped with the timestamp of the weights it was computed on,
       in one round trip with the pull of newer weights
       (hardsync: the PS answers after the update, so every learner starts the next step on
        the same new weights; softsync/async: it answers at once, with newer weights or
        UPTODATE, and the learner goes on with what it has)
    -> until the PS answers STOP.

How gradients and weights travel (push/pull with each server of the cluster's shape,
Rudra-adv* push + broadcast; payload frames or shared-memory slots with the leaf) is chosen
once at start: ``exchange.py``.

On a GPU (``runtime.device``, ``devices.py``) the model and its flat buffers live on the GPU:
each minibatch goes there after augmentation, the flat gradient comes back to a pinned host
buffer in one transfer after backward (that buffer is what is pushed), and received weights
go to the GPU in one transfer once the reply is complete.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time

import torch
import zmq

from .. import timeline, transport
from ..server.end_files import finished_ranges
from ..shape import ClusterShape
from .data_client import DataClient
from .exchange import make_exchange
from .links import ServerLinks, server_channels

log = logging.getLogger("rudra_zmq.learner")

_METRIC_EVERY_S = 1.0
_END_THREADS_S = 5.0  # the longest a stopping process waits for its learner threads' sockets


def augment(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop (zero padding ``pad``) and horizontal flip, per sample. Does not block."""
    b, c, h, w = x.shape
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    rows = (oy[:, None] + torch.arange(h))[:, :, None]  # (b, h, 1)
    cols = (ox[:, None] + torch.arange(w))[:, None, :]  # (b, 1, w)
    flip = torch.rand(b, generator=generator) < 0.5
    cols = torch.where(flip[:, None, None], cols.flip(-1), cols)
    out = xp[torch.arange(b)[:, None, None], :, rows, cols]  # (b, h, w, c)
    return out.permute(0, 3, 1, 2).contiguous()


class Learner:
    """One learner; ``run()`` trains in the calling thread until the PS says STOP.

    Owns its sockets (not thread-safe); several learners may share a process, each in its
    own thread, with a shared thread-safe ``zmq.Context``. Under advstar its exchange also
    owns a broadcast member, whose I/O thread runs from construction until ``close()``.
    """

    def __init__(
        self,
        cfg,
        learner_id: int,
        ps: str | list[str],
        data: str,
        stats: str | None = None,
        ctx: zmq.Context | None = None,
        bcast: tuple[str, str | None] | None = None,
        finished_in=None,
    ):
        """``ps``: the endpoint of each server of the cluster's shape (``shape.ClusterShape``;
        Rudra-adv: its leaf in each range's tree), in range order (one: a string will do).
        ``bcast`` (advstar only): (upstream endpoint, endpoint to bind for its broadcast
        children or None). ``finished_in``: the run directory of a learner restarted after
        some of several servers finished training: their ranges come from their final weights
        there (``end_files.finished_ranges``), and it trains the others'."""
        from ..data.datasets import dataset_shape
        from ..devices import learner_device
        from ..flat import FlatModel
        from ..models import build_model, input_transform

        self.cfg = cfg
        self.id = learner_id
        shape = dataset_shape(cfg.data)
        self.device = learner_device(cfg.runtime.device, learner_id)
        self.model = build_model(cfg.model.name, cfg.data.num_classes, shape, seed=cfg.model.seed)
        self.prep = input_transform(cfg.model.name)
        self.flat = FlatModel(self.model, device=self.device)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        endpoints = [ps] if isinstance(ps, str) else list(ps)
        # augmentation is seeded per (seed, learner, step): a learner that resumes at a step
        # draws what it would have drawn there
        self.generator = torch.Generator()
        self._aug_seed = (cfg.train.seed * 1_000_003 + learner_id) * 1_000_000_007
        self.steps = 0
        self.finished = False  # the PS said STOP
        self._loss_sum = 0.0
        times = cfg.runtime.compute_times
        self._slowdown = times[learner_id] - 1 if times else 0.0  # a straggler's extra share
        self.ps = self.data = self.stats = self.exchange = None
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        try:
            self._connect(endpoints, data, stats, bcast, shape, finished_in)
        except BaseException:  # a socket left open would keep the context's term() waiting
            self._close_built()
            raise

    def _connect(self, endpoints: list[str], data: str, stats, bcast, shape, finished_in) -> None:
        """Make the sockets: to each server of the cluster's shape, the data and statistics
        servers, and the exchange (adv*: its broadcast link), which leaves out the servers
        that finished in ``finished_in`` (a run directory, or None). Blocks for none (reads
        their small end files)."""
        cfg, learner_id = self.cfg, self.id
        cluster = ClusterShape.of(cfg, self.flat.numel)
        channels = server_channels(
            self.ctx,
            cfg,
            cluster,
            endpoints,
            learner_id,
            max_bytes=transport.frame_limit(cfg.runtime.chunk_mib << 20),
        )
        self.ps = ServerLinks(channels, cluster.servers)
        self._data_args = (self.ctx, data, learner_id)
        self._data_kw = dict(
            prefetch=cfg.data.prefetch,
            timeout_ms=int(cfg.runtime.timeout_s * 1000),
            retry_ms=int(cfg.runtime.retry_s * 1000),  # float32 at most
            max_bytes=transport.frame_limit(4 * cfg.sync.batch_size * math.prod(shape)),
        )
        self.data = DataClient(*self._data_args, **self._data_kw)
        if stats:
            from ..stats.client import StatsClient

            self.stats = StatsClient(self.ctx, stats, learner_id)
        self.exchange = make_exchange(cfg, cluster, learner_id, self.flat, self.ps, self.ctx, bcast)
        if self._slowdown and getattr(self.exchange, "stream", None) is not None:
            # a straggler's gradient leaves after its extra sleep, not during backward
            self.exchange.push_after_backward()
        self.exchange.on_welcome = self._start_data_at
        self.exchange.data_step = lambda: self.data.expected
        if finished_in is not None:
            self.exchange.take_finished(finished_ranges(finished_in, cluster, cfg.train.epochs))

    def _close_built(self) -> None:
        """The constructor failed: close what ``_connect`` made before it did (and the
        context, if this learner's own). Best effort; never raises."""
        closers = [lambda: self.exchange.close(False)] if self.exchange is not None else []
        closers += [x.close for x in (self.ps, self.data, self.stats) if x is not None]
        for close in closers:
            try:
                close()
            except Exception:  # already failing: the first error is the one to see
                log.debug("learner %d: closing a half-built learner", self.id, exc_info=True)
        if self._own_ctx:
            transport.destroy(self.ctx, 0)

    def _start_data_at(self, step: int | None) -> None:
        """The server says this learner's next minibatch is its ``step``-th: the data order
        continues where the run is (after a restart or a resume), not from 0."""
        if step is not None and step != self.data.expected:
            self.data.close()
            self.data = DataClient(*self._data_args, start_step=step, **self._data_kw)

    @property
    def ts(self) -> int:
        """The timestamp of the weights the model holds."""
        return self.exchange.ts

    def _backward(self) -> None:
        t0 = time.perf_counter()
        with timeline.current().span("compute", learner=self.id):
            self._compute()
        if self._slowdown:  # runtime.compute_times: a straggler sleeps the rest of its time
            time.sleep(self._slowdown * (time.perf_counter() - t0))

    def _compute(self) -> None:
        x, y, _epoch, step = self.data.next_batch()
        xf = self.prep(x, self.data.mean, self.data.std)
        if self.cfg.data.augment:
            self.generator.manual_seed((self._aug_seed + step) % 2**63)
            xf = augment(xf, self.generator)
        if self.flat.staged:
            xf, y = xf.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        out = self.model(xf)  # (wire.priority: the previous step's replies taken here)
        # zeroed after forward: with wire.priority the previous gradient's parts may be in
        # flight (zero-copy views of it) until that forward has taken every reply
        self.flat.zero_grad()
        loss = self.loss_fn(out, y)
        loss.backward()
        self.flat.grads_to_host()
        self._loss_sum += loss.item()

    def step(self) -> bool:
        """One minibatch: gradient, push, newer weights. Returns False once the PS said STOP."""
        with timeline.current().span("step", "wire", learner=self.id):
            alive = self.exchange.step(self._backward)
        if alive:
            self.steps += 1
        return alive

    def run(self, stop_event: threading.Event | None = None) -> int:
        """Say HELLO, then train until STOP (or ``stop_event``). Blocks; raises on failure."""
        try:
            if not self.exchange.start():
                self.finished = True
                return 0
            self._loss_sum, t_last, steps_last = 0.0, time.time(), 0
            mu = self.cfg.sync.batch_size
            while stop_event is None or not stop_event.is_set():
                if not self.step():
                    self.finished = True
                    break
                now = time.time()
                if self.stats and now - t_last >= _METRIC_EVERY_S:
                    n = self.steps - steps_last
                    self.stats.metric(
                        {
                            "type": "learner",
                            "learner": self.id,
                            "t": now,
                            "step": self.steps,
                            "ts": self.ts,
                            "samples_per_s": n * mu / (now - t_last),
                            "loss": self._loss_sum / max(n, 1),
                        }
                    )
                    self._loss_sum, t_last, steps_last = 0.0, now, self.steps
            return 0
        finally:
            self.close()

    def close(self) -> None:
        """Close the exchange and every socket (a learner that leaves after STOP passes it on
        down the broadcast). Idempotent enough for ``run``'s finally."""
        self.exchange.close(self.finished)
        self.ps.close()
        self.data.close()
        if self.stats:
            self.stats.close()
        if self._own_ctx:
            transport.term(self.ctx)


def serve(
    cfg,
    learner_ids: list[int],
    ps: str | list[str],
    data: str,
    stats: str | None = None,
    bcast_upstream: list[str] | None = None,
    bcast_bind: list | None = None,
    finished_in=None,
) -> int:
    """Entry point of ``rudra-zmq learner``: run these learners (one thread each) to the end.

    ``bcast_upstream``/``bcast_bind`` (advstar): per learner id, its broadcast upstream and
    the endpoint it binds for its broadcast children (None: it has none). ``finished_in``:
    see ``Learner``.

    If one learner fails, the error is logged and raised at once: waiting for the others
    could hang (hardsync waits for every learner), and the launcher stops the run.
    """
    import socket

    ids = ",".join(map(str, learner_ids))
    print(
        f"learner{'s' if len(learner_ids) > 1 else ''} {ids} on {socket.gethostname()}: "
        f"{torch.get_num_threads()} torch threads, device {cfg.runtime.device}; "
        f"parameter server {ps if isinstance(ps, str) else ', '.join(ps)}",
        flush=True,
    )
    ctx, threads, stopping = zmq.Context(), [], threading.Event()
    try:
        bcast = dict(zip(learner_ids, zip(bcast_upstream or [], bcast_bind or [])))

        def make(i):
            return Learner(cfg, i, ps, data, stats, ctx, bcast.get(i), finished_in)

        return _serve_in(learner_ids, make, threads, stopping)
    finally:
        if transport.security() is not None:
            transport.security().release(ctx)
        if any(t.is_alive() for t in threads):
            if not _end_threads(ctx, stopping, threads):
                _exit_unfinalized(sys.exc_info()[1])
        else:
            # destroy, not term: a SIGTERM (KeyboardInterrupt) can land while a Learner is
            # still being built, before run()'s finally closes its sockets; term() would then
            # wait for them forever and the process would outlive the run.
            transport.destroy(ctx, transport.LINGER_MS)


def _end_threads(ctx, stopping: threading.Event, threads) -> bool:
    """Stop learner threads still running (SIGTERM, or another learner failed) without
    closing their sockets from this thread: a libzmq socket closed while another thread waits
    on it aborts the process. ``ctx.term()`` makes their blocking calls raise; they close their
    sockets as they unwind and term returns. A socket left open (a learner stopped while being
    built) keeps term waiting: after ``_END_THREADS_S`` the process exits without it. Then
    the threads are joined (within the same ``_END_THREADS_S``). Returns whether every
    thread (and the term) ended; if not, the caller must not let the interpreter finalize
    (``_exit_unfinalized``). Blocks."""
    deadline = time.monotonic() + _END_THREADS_S
    stopping.set()  # what the threads raise now is this stop, not a failure
    ender = threading.Thread(target=ctx.term, name="ctx-term", daemon=True)
    ender.start()
    ender.join(_END_THREADS_S)
    if ender.is_alive():
        log.warning("the learners' sockets were not closed %.0f s after the stop", _END_THREADS_S)
    for t in threads:
        if t.ident is not None:  # a stop during start-up leaves some never started
            t.join(max(0.0, deadline - time.monotonic()))
    return not ender.is_alive() and not any(t.is_alive() for t in threads)


def _exit_unfinalized(exc: BaseException | None) -> None:
    """End the process now, without finalizing the interpreter, with the exit code
    ``rudra-zmq`` gives ``exc`` (128 + the signal for a SIGTERM or Ctrl-C, 1 for a failure, 0).

    A learner thread still in a step (inside torch, GIL released) when the interpreter
    finalizes is a daemon thread that CPython ends with ``pthread_exit`` once it comes back
    for the GIL; that unwinding through torch's C++ frames calls ``std::terminate``: the
    process aborts ("terminate called without an active exception", SIGABRT) instead of
    exiting (``tests/sigterm_stress.py`` SIGTERMs a learner process in 10-second steps).
    The logs and stdio are flushed first; the sockets and the model go with the process.
    Never returns."""
    if isinstance(exc, KeyboardInterrupt):
        code = 128 + (exc.args[0] if exc.args and isinstance(exc.args[0], int) else 2)
    else:
        code = 0 if exc is None else 1
    log.warning(
        "learner threads still in a step %.0f s after the stop: the process ends without "
        "finalizing the interpreter (exit %d), which would abort it inside torch",
        _END_THREADS_S,
        code,
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _serve_in(learner_ids, make, threads, stopping) -> int:
    """Run the learners ``make(i)`` builds: in this thread if one, else one thread each (added
    to ``threads``; ``stopping`` set: they are being stopped, an error is not a failure).
    Blocks until they end; raises the first learner's error."""
    if len(learner_ids) == 1:
        return make(learner_ids[0]).run()
    errors: list[BaseException] = []
    failed = threading.Event()

    def work(i):
        try:
            make(i).run(stop_event=failed)
        except BaseException as exc:  # reported by the main thread
            if stopping.is_set():
                return
            log.exception("learner %d failed", i)
            errors.append(exc)
            failed.set()

    threads += [
        threading.Thread(target=work, args=(i,), name=f"learner-{i}", daemon=True)
        for i in learner_ids
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if failed.wait(0.5):
            raise RuntimeError(f"learner thread failed: {errors[0]!r}") from errors[0]
    if errors:
        raise errors[0]
    return 0
