"""A learner's links to the run's parameter servers: one ``Channel`` per server of the
cluster's shape (``shape.ClusterShape``; one server is a set of one), in range order, and a
poller over their sockets, so that a step sends to every server and then gathers their
replies (``ServerLinks.gather``), asking a slow one about its request (CHECK) as ``Channel``
does. What goes on them is the exchange's (``exchange.py``).

Not thread-safe: one learner thread owns its links and their channels.
"""

from __future__ import annotations

import time

import zmq

from .. import codec, transport, wire
from ..channel import Channel, ServerError
from ..config_architecture import most_parts
from ..wire import Kind


def said_stop(replies: dict) -> list[int]:
    """The servers whose reply in ``replies`` is a STOP (training over there)."""
    return [k for k, m in replies.items() if isinstance(m, wire.Message) and m.kind == Kind.STOP]


class ServersSilent(TimeoutError):
    """No reply from the servers ``silent`` within the timeout; ``replies``: what the others
    answered meanwhile."""

    def __init__(self, text: str, silent: list[int], replies: dict):
        super().__init__(text)
        self.silent, self.replies = silent, replies


def server_channels(ctx, cfg, shape, endpoints, sender: int, max_bytes: int = -1) -> list[Channel]:
    """A learner's channel to each server of ``shape`` (``shape.ClusterShape``) at
    ``endpoints`` (the servers', or its leaf in each range's tree, in range order), named
    as the shape names them, with the run's timeouts and wire dtypes. Raises ValueError
    unless there is one endpoint per server. Does not block."""
    if len(endpoints) != len(shape.servers):
        raise ValueError(
            f"learner {sender}: {len(endpoints)} parameter server endpoints for the "
            f"{len(shape.servers)} servers of architecture.servers={len(shape.servers)} "
            f"(architecture.kind={shape.kind}): give one per server, in range order"
        )
    return [
        Channel(
            ctx,
            ep,
            sender,
            name=server.name,
            timeout_ms=int(cfg.runtime.timeout_s * 1000),
            hwm=4 + 2 * most_parts(cfg),  # a request's parts queue without blocking
            retry_ms=int(cfg.runtime.retry_s * 1000),
            max_bytes=max_bytes,
            dtypes=codec.dtypes(cfg),
            sndbuf=cfg.runtime.sndbuf_kib << 10,  # each connection's kernel send buffer
        )
        for server, ep in zip(shape.servers, endpoints)
    ]


class ServerLinks:
    """One ``Channel`` per server, and a poller over their sockets: send to all, then gather.
    Not thread-safe."""

    def __init__(self, channels: list[Channel], servers):
        """``servers``: the shape's servers (``shape.Server``, their ranges known), one per
        channel, in order."""
        if len(channels) != len(servers):
            raise ValueError(f"{len(channels)} server channels for {len(servers)} servers")
        self.channels, self.servers = channels, tuple(servers)
        self.poller = zmq.Poller()
        for ch in channels:
            self.poller.register(ch.sock, zmq.POLLIN)
        self.timeout_ms = max(ch.timeout_ms for ch in channels)

    def gather(self, which, kinds, timeout_ms: int | None = None) -> dict:
        """The reply to the request outstanding at each server in ``which`` (indices): a
        ``wire.Message``, or the ``ServerError`` that server answered. Blocks at most
        ``timeout_ms`` (default: the channels' timeout), then raises ``ServersSilent`` naming
        the servers still silent."""
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        pending, out = set(which), {}
        t0 = time.monotonic()
        while pending:
            ready = dict(self.poller.poll(transport.WAKE_MS))
            for k in sorted(pending):
                ch = self.channels[k]
                if ch.sock not in ready:
                    continue
                try:
                    msg = ch.poll_reply(kinds, self.servers[k].share.numel)
                except ServerError as exc:
                    msg = exc
                if msg is not None:
                    out[k] = msg
                    pending.discard(k)
            for k in pending:
                self.channels[k].tick()  # CHECK a slow request; resend one that was lost
            if pending and 0 <= timeout_ms <= (time.monotonic() - t0) * 1000:
                raise ServersSilent(
                    "; ".join(self.channels[k].silence(timeout_ms) for k in sorted(pending)),
                    sorted(pending),
                    out,
                )
        return out

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
