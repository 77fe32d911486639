"""The data server: every learner's minibatches, disjoint and deterministic, over ZeroMQ.

The training set is loaded once, as uint8, and served from memory, in the order
``rudra_zmq.data.data_order`` defines: a request of learner ``i`` for its step ``k`` gets that
learner's k-th minibatch of the strided sample stream. The answer depends only on (learner,
step): a learner that restarts or asks again gets the same batch, and nothing per learner is
stored.

Wire traffic (see ``rudra_zmq.wire``): a DEALER sends BATCH_REQ x{step} with its learner id as
the header's sender; the ROUTER answers BATCH with payloads [images u1 (µ·C·H·W), labels i8 (µ)]
and fields shape=[µ, C, H, W], epoch (stream position of the batch start / N), step, and the
per-channel mean/std the learner normalises with; or ERROR x{code, error} for a bad request.
With CURVE (``transport.set_security``) a connection's key gets only the minibatches of the
learners it may speak as (``security.Curve.may_speak``, the PS's rule); others get
ERROR forbidden.

Copies, and why: the server gathers each batch into a fresh array (one ``np.take``) and sends
it zero-copy; a fresh array, not a reused one, because ZeroMQ may still be sending the previous
reply. The learner's side, ``data_client.DataClient``, copies each batch once out of ZeroMQ's
read-only receive buffer.
"""

from __future__ import annotations

import logging
import signal
import threading

import numpy as np
import zmq

from .. import transport, wire
from ..wire import Kind
from .data_order import SampleStream, load_data

log = logging.getLogger("rudra_zmq.data")

POLL_MS = 100  # how often serve_forever looks at its stop event
DRAIN_MAX = 256  # requests handled per wake-up before looking at the stop event again


class DataServer:
    """Serves BATCH_REQ -> BATCH from a ROUTER bound at ``bind`` (see ``.endpoint``).

    Args:
        cfg: the run's Config (data, sync.learners, sync.batch_size, train.seed).
        bind: endpoint to bind; ``tcp://HOST:0`` picks a free port.
        ctx: ZeroMQ context; a private one (terminated by ``close``) if None.
        dataset: an already loaded ``datasets.Dataset`` (tests, in-process launchers); by
            default ``load_data(cfg)``.
    Construct in any thread, then use only from the thread that runs ``serve_forever``.
    Counters: ``samples_served``, ``batches_served``, ``epochs_served``, ``invalid`` (refused
    requests), ``undelivered`` (replies ZeroMQ could not hand to their peer).
    """

    def __init__(self, cfg, bind: str, ctx: zmq.Context | None = None, *, dataset=None):
        self.cfg = cfg
        ds = dataset if dataset is not None else load_data(cfg)
        self.dataset_name = ds.name
        self.x = np.ascontiguousarray(ds.x_train)
        self.y = np.ascontiguousarray(ds.y_train, dtype=np.int64)
        self.n = int(self.y.shape[0])
        self.image_shape = tuple(int(d) for d in self.x.shape[1:])
        self.mean = [float(m) for m in ds.mean]
        self.std = [float(s) for s in ds.std]
        self.learners = cfg.sync.learners
        self.batch_size = cfg.sync.batch_size
        self.stream = SampleStream(self.n, cfg.train.seed)
        self.samples_served = self.batches_served = self.invalid = self.undelivered = 0
        self._warned: set = set()
        self._seq = 0
        self._seen: dict[bytes, int] = {}  # connection -> the seq of its newest request
        self._lost: set[bytes] = set()  # connections a minibatch could not be queued to
        self.security = transport.security()  # CURVE: who may ask for whose minibatches
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else zmq.Context()
        # Each learner keeps data.prefetch requests in flight; the HWM only bounds misbehaviour.
        self.sock = transport.make_socket(
            self.ctx,
            zmq.ROUTER,  # requests are headers only
            hwm=max(16, 4 * cfg.data.prefetch),
            max_bytes=transport.frame_limit(0),
        )
        try:
            self.endpoint = transport.bind(self.sock, bind)
        except BaseException:  # e.g. address in use: leave no socket or context behind
            self.close()
            raise

    @property
    def epochs_served(self) -> float:
        """Samples served divided by the training-set size."""
        return self.samples_served / self.n

    def batch_indices(self, learner: int, step: int) -> np.ndarray:
        """The sample indices of learner ``learner``'s batch at ``step`` (no checks)."""
        return self.stream.batch(learner, step, self.learners, self.batch_size)

    # ------------------------------------------------------------------ handling
    def handle(self, frames) -> None:
        """Answer one ROUTER message (routing id first). Never raises for bad input."""
        if len(frames) < 2:
            self._count_invalid(("empty",), "a message without a header frame")
            return
        ident = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
        try:
            msg = wire.decode(frames[1:], kinds={Kind.BATCH_REQ, Kind.CHECK})
        except wire.WireError as exc:
            self._refuse(ident, f"peer {ident.hex()}", exc.code, str(exc))
            return
        learner, step = msg.sender, msg.fields.get("step")
        # With CURVE a key gets only its own learners' minibatches (the PS's rule, security/auth.py)
        if self.security is not None and not self.security.may_speak(frames[1], learner):
            self._refuse(
                ident,
                f"learner {learner}",
                "forbidden",
                f"this connection's key may not ask for {wire.sender_name(learner)}'s "
                "minibatches (is the learner using another learner's key?)",
            )
            return
        if msg.kind == Kind.CHECK:  # did request q of this connection arrive?
            self._seq += 1
            # a minibatch dropped here counts as never got: the client asks again for every
            # step it awaits (and drops the answers to steps it has); else it would wait for it
            got = ident not in self._lost and self._seen.get(ident, -1) >= msg.seq
            receipt = wire.encode(Kind.RECEIPT, wire.SENDER_DATA, self._seq, re=msg.seq, got=got)
            if self._send(ident, receipt, f"learner {learner}") and not got:
                self._lost.discard(ident)
            return
        self._seen[ident] = msg.seq  # per connection: a client numbers its requests from 1
        if not 0 <= learner < self.learners:
            self._refuse(
                ident,
                f"learner {learner}",
                "bad_learner",
                f"learner id {learner} is out of range 0..{self.learners - 1} "
                f"(sync.learners = {self.learners}); is that learner running another "
                "config?",
            )
            return
        if step < 0:
            self._refuse(
                ident,
                f"learner {learner}",
                "bad_step",
                f"learner {learner} asked for step {step}; steps count from 0",
            )
            return
        self._reply_batch(ident, learner, step)

    def _reply_batch(self, ident: bytes, learner: int, step: int) -> None:
        start = (step * self.learners + learner) * self.batch_size
        idx = self.batch_indices(learner, step)
        # Fresh arrays (np.take copies): the reply owns them until ZeroMQ has sent them.
        images = np.take(self.x, idx, axis=0)
        labels = np.take(self.y, idx)
        self._seq += 1
        frames = wire.encode(
            Kind.BATCH,
            wire.SENDER_DATA,
            self._seq,
            payloads=[images.reshape(-1), labels],
            shape=[self.batch_size, *self.image_shape],
            epoch=start / self.n,
            step=step,
            mean=self.mean,
            std=self.std,
        )
        # Count before sending, so a peer that has its reply never sees a stale count.
        self.samples_served += self.batch_size
        self.batches_served += 1
        if not self._send(ident, frames, f"learner {learner}"):
            self.samples_served -= self.batch_size
            self.batches_served -= 1
            self._lost.add(ident)  # its next CHECK hears "not got"

    def _send(self, ident: bytes, frames, who: str) -> bool:
        try:
            # NOBLOCK: a learner that stopped reading must not stall the others.
            self.sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:  # EAGAIN: its queue is full; EHOSTUNREACH: it is gone
            self.undelivered += 1
            if ("undelivered", ident) not in self._warned:
                self._warned.add(("undelivered", ident))
                # A learner that left with prefetched requests outstanding is the normal end
                # of a run; one that does not read its replies is not.
                level = logging.DEBUG if exc.errno == zmq.EHOSTUNREACH else logging.WARNING
                log.log(level, "data server: could not deliver a reply to %s: %s", who, exc)
            return False

    def _refuse(self, ident: bytes, who: str, code: str, message: str) -> None:
        self._count_invalid((who, code), f"refused a request from {who}: {message}")
        self._seq += 1
        self._send(
            ident,
            wire.encode(Kind.ERROR, wire.SENDER_DATA, self._seq, code=code, error=message),
            who,
        )

    def _count_invalid(self, key, text: str) -> None:
        self.invalid += 1
        if key not in self._warned:  # log once per sender and reason, count all
            self._warned.add(key)
            log.warning("data server: %s", text)

    # ------------------------------------------------------------------ loop
    def serve_forever(self, stop_event: threading.Event | None = None) -> None:
        """Serve until ``stop_event`` is set, then close. Blocks; checks the event every
        ``POLL_MS`` ms. Call from the thread that will own the socket."""
        try:
            while stop_event is None or not stop_event.is_set():
                if not self.sock.poll(POLL_MS):
                    continue
                transport.drain(self.sock, self.handle, DRAIN_MAX)
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket (queued replies get ``transport.LINGER_MS``, then are dropped; not 0:
        docs/wire.md, "Half-sent messages") and a private ctx."""
        if not self.sock.closed:
            self.sock.close(linger=transport.LINGER_MS)
        if self._own_ctx and not self.ctx.closed:
            transport.term(self.ctx)


def serve(cfg, bind: str) -> int:
    """Entry point of ``rudra-zmq data``: serve until SIGTERM or SIGINT. Returns 0."""
    transport.tune_malloc()
    stop = threading.Event()
    server = DataServer(cfg, bind)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        print(f"data server listening on {server.endpoint}", flush=True)
        c, h, w = server.image_shape
        print(
            f"data server: {server.dataset_name}, {server.n:,} training images {c}x{h}x{w}; "
            f"{server.learners} learners x {server.batch_size} samples per batch",
            flush=True,
        )
        server.serve_forever(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(
        f"data server: served {server.samples_served:,} samples ({server.epochs_served:.2f} "
        f"epochs) in {server.batches_served:,} batches; {server.invalid} invalid requests",
        flush=True,
    )
    return 0


__all__ = ["DataServer", "serve"]
