"""The statistics client every role uses to report to the statistics server
(``stats/server.py``), one-way and never blocking training.

Two PUSH sockets: small metric records, and model-sized EVAL snapshots of the weights, each
with a small high-water mark; what does not fit is dropped and counted, never waited for
(except the final weights' EVAL and the final ``"done"`` record, which wait up to
``done_wait_ms``, by default ``DONE_SEND_WAIT_MS``: a statistics server being restarted must
still get them).
"""

from __future__ import annotations

import logging

import numpy as np
import zmq

from .. import transport, wire
from ..security import auth
from ..wire import Kind

log = logging.getLogger("rudra_zmq.stats")

METRIC_HWM = 100  # metric messages a client queues before it drops new ones
EVAL_HWM = 2  # weight snapshots a client queues (model-sized: keep it tiny)
DONE_SEND_WAIT_MS = 15_000  # the final "done" record waits this long for room (a stats
#                            server being restarted), no longer
CLOSE_LINGER_MS = 1000  # time ZeroMQ gets at close to deliver what is queued


def _plain(obj):
    """``obj`` with NumPy scalars and arrays turned into Python numbers and lists."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    return obj


class StatsClient:
    """Sends METRIC and EVAL messages to the statistics server; never blocks the caller.

    Two PUSH sockets: metrics (HWM ``METRIC_HWM``) and weights (HWM ``EVAL_HWM``), so small
    records never wait behind model-sized messages. A message that does not fit the queue (the
    server is slow, busy or absent) is dropped and counted: ``dropped`` (metrics),
    ``evals_dropped``; ``evals_sent`` counts EVALs handed to ZeroMQ. Not thread-safe.
    """

    def __init__(
        self, ctx: zmq.Context, endpoint: str, sender: int, done_wait_ms: int = DONE_SEND_WAIT_MS
    ):
        self.endpoint = endpoint
        self.done_wait_ms = done_wait_ms  # shorter for a PS restarted after training ended
        self.sender = sender
        self.dropped = self.evals_sent = self.evals_dropped = 0
        self._done_sent = False
        self._seq = 0
        self._warned: set = set()
        # the PS proves its records are its own with the run's token (auth.run_token)
        token = auth.run_token() if sender == wire.SENDER_PS else None
        self._token = {} if token is None else {"token": token}
        self._metrics = transport.make_socket(ctx, zmq.PUSH, hwm=METRIC_HWM)
        self._evals = transport.make_socket(ctx, zmq.PUSH, hwm=EVAL_HWM)
        for sock in (self._metrics, self._evals):
            transport.connect(sock, endpoint, sender)

    def metric(self, record: dict) -> bool:
        """Queue one record (plain JSON-like values; NumPy scalars are converted). Returns
        False if it was dropped. Does not block, except that a ``{"type": "done"}`` record
        (which gets ``evals_sent`` added) waits up to ``done_wait_ms`` for room."""
        if not isinstance(record, dict):
            raise TypeError(f"a metric record is a dict, got {type(record).__name__}")
        if record.get("type") == "done":
            self._done_sent = True
            record = {**record, "evals_sent": self.evals_sent}
            if not self._metrics.poll(self.done_wait_ms, zmq.POLLOUT):
                return self._drop("done", "the final 'done' record: the queue stayed full")
        try:
            frames = self._encode(record)
        except TypeError:  # msgpack takes no NumPy types: convert (rare, so not up front)
            frames = self._encode(_plain(record))
        if len(frames[0]) > wire.MAX_HEADER_BYTES:
            items = record.get("items") if record.get("type") == "batch" else None
            if isinstance(items, list) and len(items) > 1:
                half = len(items) // 2  # too big for one header: send it in two halves
                first = self.metric({**record, "items": items[:half]})
                return self.metric({**record, "items": items[half:]}) and first
            return self._drop(
                "size",
                f"a {record.get('type')!r} record of {len(frames[0]):,} "
                f"bytes (the limit is {wire.MAX_HEADER_BYTES:,})",
            )
        try:
            self._metrics.send_multipart(frames, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return self._drop("full", None)

    def _encode(self, record):
        self._seq += 1
        return wire.encode(Kind.METRIC, self.sender, self._seq, metric=record, **self._token)

    def _drop(self, reason: str, text: str | None) -> bool:
        self.dropped += 1
        if text and reason not in self._warned:
            self._warned.add(reason)
            log.warning("statistics client %d: dropped %s", self.sender, text)
        return False

    def eval_weights(
        self,
        ts: int,
        epoch: float,
        weights: np.ndarray,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        final: bool = False,
        range: list[int] | None = None,  # noqa: A002 -- the wire field's name
    ) -> bool:
        """Queue ``weights`` (1-D float32) for evaluation, zero-copy, in frames of at most
        ``chunk_bytes``. Returns False if dropped (EVAL_HWM snapshots already queued).
        ``range``: [lo, hi], the part of the vector ``weights`` are (a sharded run's server);
        such an EVAL also says whether it is the ``final`` weights.

        Does not block, except for the ``final`` weights (the end of training): those wait up
        to ``done_wait_ms`` for room. ``weights`` is sent without a copy: do not modify it
        until ZeroMQ has sent it; pass a snapshot that is never written again (as the
        parameter server does).
        """
        wait = self.done_wait_ms if final else 0
        if not self._evals.poll(wait, zmq.POLLOUT):  # full: do not even encode
            self.evals_dropped += 1
            return False
        self._seq += 1
        frames = wire.encode(
            Kind.EVAL,
            self.sender,
            self._seq,
            ts=ts,
            payloads=wire.chunk(weights, chunk_bytes),
            epoch=float(epoch),
            **({} if range is None else {"range": list(range), "final": bool(final)}),
            **self._token,
        )
        try:
            self._evals.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.evals_dropped += 1
            return False
        self.evals_sent += 1
        return True

    def close(self, linger_ms: int = CLOSE_LINGER_MS) -> None:
        """Close both sockets, giving ZeroMQ up to ``linger_ms`` (in ``ctx.term()``) to deliver
        what is queued; after a "done" record, up to ``done_wait_ms`` (a statistics
        server being restarted must still get it and the final weights)."""
        linger_end = max(linger_ms, self.done_wait_ms) if self._done_sent else linger_ms
        for sock, linger in ((self._metrics, linger_end), (self._evals, linger_end)):
            if not sock.closed:
                sock.close(linger=linger)


__all__ = ["StatsClient"]
