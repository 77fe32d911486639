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
reply. The client copies each batch once out of ZeroMQ's read-only receive buffer (see
``DataClient.next_batch``).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import numpy as np
import zmq

from .. import transport, wire
from ..channel import ServerError
from ..data.data_order import SampleStream, load_data
from ..wire import Kind

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
            msg = wire.decode(frames[1:], kinds={Kind.BATCH_REQ})
        except wire.WireError as exc:
            self._refuse(ident, f"peer {ident.hex()}", exc.code, str(exc))
            return
        learner, step = msg.sender, msg.fields["step"]
        # With CURVE a key gets only its own learners' minibatches (the PS's rule, security.py)
        if self.security is not None and not self.security.may_speak(frames[1], learner):
            self._refuse(
                ident,
                f"learner {learner}",
                "forbidden",
                f"this connection's key may not ask for {wire.sender_name(learner)}'s "
                "minibatches (is the learner using another learner's key?)",
            )
            return
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


class DataClient:
    """A learner's connection to the data server, keeping ``prefetch`` requests in flight.

    Replies queue in ZeroMQ's I/O thread while the learner computes, so no thread is needed.
    ``next_batch`` blocks until the next batch arrives (at most ``timeout_ms``). After
    ``next_batch`` returns, ``mean``/``std`` hold the per-channel normalisation the data server
    sent (for ``datasets.to_float``). Not thread-safe (owns one socket).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        learner_id: int,
        prefetch: int = 2,
        timeout_ms: int = 60_000,
        *,
        start_step: int = 0,
        retry_ms: int = 5_000,
        max_bytes: int = -1,
    ):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.endpoint = endpoint
        self.learner_id = learner_id
        self.prefetch = prefetch
        self.timeout_ms = timeout_ms
        self.mean: tuple[float, ...] | None = None
        self.std: tuple[float, ...] | None = None
        # No routing id of our own: ZeroMQ picks a unique one, so a restarted learner is never
        # refused as a duplicate. The server answers by routing id; our id is in the header.
        self.sock = transport.make_socket(
            ctx, zmq.DEALER, hwm=max(16, prefetch + 1), max_bytes=max_bytes
        )
        transport.connect(self.sock, endpoint, learner_id)
        self._seq = 0
        self._next_request = self._expected = start_step
        self.retry_ms = retry_ms
        self.resent = 0
        self._fill()

    @property
    def expected(self) -> int:
        """The step of the next minibatch ``next_batch`` returns."""
        return self._expected

    def _resend(self) -> None:
        """Ask again for every outstanding step (a restarted data server lost them)."""
        for step in range(self._expected, self._next_request):
            self._seq += 1
            try:
                self.sock.send_multipart(
                    wire.encode(Kind.BATCH_REQ, self.learner_id, self._seq, step=step),
                    flags=zmq.NOBLOCK,
                )
            except zmq.Again:  # not connected (yet): the next resend tries again
                return
        self.resent += 1

    def _fill(self) -> None:
        while self._next_request - self._expected < self.prefetch:
            self._seq += 1
            frames = wire.encode(
                Kind.BATCH_REQ, self.learner_id, self._seq, step=self._next_request
            )
            # Cannot block: at most `prefetch` requests are outstanding and the HWM is larger.
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
            self._next_request += 1

    def next_batch(self):
        """The next minibatch: ``(x, y, epoch, step)``.

        ``x`` is a writable torch.uint8 tensor (µ, C, H, W), ``y`` torch.int64 (µ,), ``epoch``
        the stream position of the batch start in epochs, ``step`` this learner's step. Blocks.
        Raises TimeoutError naming the endpoint if nothing arrives within ``timeout_ms``,
        channel.ServerError if the data server refused the request (fatal for this client),
        wire.WireError for a malformed or out-of-order reply.
        """
        import torch  # here, not at module level: the data server process never needs torch

        self._fill()
        msg = self._receive_expected()
        step, shape = msg.fields["step"], msg.fields["shape"]
        images, labels = msg.payloads
        if (
            len(shape) != 4
            or not all(type(d) is int and d > 0 for d in shape)
            or math.prod(shape) != images.shape[0]
            or labels.shape[0] != shape[0]
        ):
            raise wire.WireError(
                "bad_shape",
                f"BATCH shape {shape} does not match its payloads "
                f"({images.shape[0]:,} pixels, "
                f"{labels.shape[0]:,} labels)",
            )
        norm = [msg.fields.get(k) for k in ("mean", "std")]
        if norm != [None, None]:
            if not all(
                isinstance(v, list)
                and len(v) == shape[1]
                and all(type(f) in (int, float) for f in v)
                for v in norm
            ):
                raise wire.WireError(
                    "bad_field",
                    f"BATCH mean/std must be {shape[1]} numbers each (one per channel), got {norm}",
                )
            self.mean, self.std = tuple(norm[0]), tuple(norm[1])
        self._expected += 1
        self._fill()  # keep `prefetch` requests in flight while the learner computes
        # The one copy on the learner's side: the payloads are read-only views of ZeroMQ's
        # receive buffers, and torch.from_numpy over them would give a tensor that claims to be
        # writable (torch warns; an in-place augmentation would write into ZeroMQ's memory).
        # One memcpy of the uint8 batch, a quarter of the float32 conversion that follows,
        # buys a tensor the learner owns and releases the frame at once.
        x = torch.from_numpy(images.reshape(shape).copy())
        y = torch.from_numpy(labels.copy())
        return x, y, float(msg.fields["epoch"]), step

    def _receive_expected(self) -> wire.Message:
        """The BATCH of step ``expected``: requests unanswered for ``retry_ms`` are sent again,
        and answers to steps already taken (a resend answered twice) are dropped."""
        t0 = time.monotonic()
        while True:
            left = self.timeout_ms / 1000 - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(
                    f"learner {self.learner_id}: no minibatch from the data server at "
                    f"{self.endpoint} within {self.timeout_ms / 1000:g} s (is `rudra-zmq data` "
                    "running and reachable there?)"
                )
            if not transport.wait_readable(self.sock, int(1000 * min(left, self.retry_ms / 1000))):
                self._resend()
                continue
            msg = wire.decode(self.sock.recv_multipart(copy=False), kinds={Kind.BATCH, Kind.ERROR})
            if msg.kind == Kind.ERROR:
                raise ServerError(
                    msg.fields["code"],
                    f"the data server at {self.endpoint} refused learner "
                    f"{self.learner_id}'s request: {msg.fields['error']}",
                )
            step = msg.fields["step"]
            if step == self._expected:
                return msg
            if step >= self._next_request:
                raise wire.WireError(
                    "out_of_order",
                    f"the data server at {self.endpoint} "
                    f"answered step {step}, never asked for; learner "
                    f"{self.learner_id} expected step {self._expected}",
                )
            # a late duplicate of a step already taken, or one after a lost step: the
            # resend brings them again, in order

    def close(self) -> None:
        """Close the socket at once (outstanding requests are abandoned)."""
        if not self.sock.closed:
            self.sock.close(linger=0)


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


__all__ = ["DataServer", "DataClient", "serve"]
