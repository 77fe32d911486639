"""A learner's side of the data server: its minibatches asked for ahead, over one DEALER.

``DataClient`` keeps ``prefetch`` BATCH_REQ in flight, asks the data server whether it got
them when no batch came for ``retry_ms`` (CHECK, a header) and sends them again only when it
did not (a restarted server) or the connection dropped and came back, drops late duplicates
and checks each BATCH (the wire traffic is described in
``data/server.py``). Copies, and why: each batch is copied once out of ZeroMQ's read-only
receive buffer (see ``DataClient.next_batch``).
"""

from __future__ import annotations

import math
import time

import torch
import zmq

from .. import transport, wire
from ..channel import LinkWatch, ServerError, send_check
from ..wire import Kind


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
        self.link = LinkWatch(self.sock)
        transport.connect(self.sock, endpoint, learner_id)
        self._seq = 0
        self._next_request = self._expected = start_step
        self.retry_ms = retry_ms
        self.resent = 0
        self.checks = 0  # CHECKs sent (a header each)
        self._fill()

    @property
    def expected(self) -> int:
        """The step of the next minibatch ``next_batch`` returns."""
        return self._expected

    def _check(self) -> None:
        """Ask whether the newest request arrived (it did iff every earlier one did: one
        connection keeps order). Skipped when the queue is full."""
        if send_check(self.sock, self.learner_id, self._seq):
            self.checks += 1

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
        """The BATCH of step ``expected``: after ``retry_ms`` without a batch the server is
        asked whether it got the requests (they are sent again if not, or after a reconnect),
        and answers to steps already taken (a resend answered twice) are dropped."""
        t0 = asked = time.monotonic()
        while True:
            left = self.timeout_ms / 1000 - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(
                    f"learner {self.learner_id}: no minibatch from the data server at "
                    f"{self.endpoint} within {self.timeout_ms / 1000:g} s (is `rudra-zmq data` "
                    "running and reachable there?)"
                )
            if not transport.wait_readable(
                self.sock, int(1000 * min(left, transport.WAKE_MS / 1000))
            ):
                now = time.monotonic()
                if self.link.reconnected():
                    self._resend()
                    asked = now
                elif now - asked >= self.retry_ms / 1000:
                    self._check()
                    asked = now
                continue
            msg = wire.decode(
                self.sock.recv_multipart(copy=False), kinds={Kind.BATCH, Kind.ERROR, Kind.RECEIPT}
            )
            if msg.kind == Kind.RECEIPT:
                if msg.fields["re"] == self._seq and not msg.fields["got"]:
                    self._resend()  # the server never got them (it restarted)
                continue
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
            self.link.close()
            self.sock.close(linger=0)


__all__ = ["DataClient"]
