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

    def gather(self, which, kinds, timeout_ms: int | None = None, between=None) -> dict:
        """The reply to the request outstanding at each server in ``which`` (indices): a
        ``wire.Message``, or the ``ServerError`` that server answered. Blocks at most
        ``timeout_ms`` (default: the channels' timeout), then raises ``ServersSilent`` naming
        the servers still silent. ``between()``, called between polls, says whether it has
        sends still to make (``priority.PriorityPush.pump``): the polls are short then."""
        g = self.gathering(which, kinds, timeout_ms)
        while not g.poll(transport.WAKE_MS if between is None or not between() else 1):
            pass
        return g.out

    def gathering(self, which, kinds, timeout_ms: int | None = None) -> Gathering:
        """A ``gather`` taken one poll at a time (``Gathering.poll``). Does not block."""
        return Gathering(self, which, kinds, self.timeout_ms if timeout_ms is None else timeout_ms)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


class Gathering:
    """The replies to the requests outstanding at the servers ``which``, taken as they come:
    ``out`` (server -> ``wire.Message`` or the ``ServerError`` it answered) grows with each
    ``poll``; ``pending`` are the servers still to answer. Not thread-safe (the links')."""

    def __init__(self, links: ServerLinks, which, kinds, timeout_ms: int):
        self.links, self.kinds, self.timeout_ms = links, kinds, timeout_ms
        self.pending, self.out = set(which), {}
        self.t0 = time.monotonic()

    def poll(self, wait_ms: int) -> bool:
        """Wait up to ``wait_ms`` for replies and take those that came (a part of a reply
        ahead is loaded as it comes: ``Channel.on_part``); whether every one is in. Raises
        ``ServersSilent`` once the timeout passed with some still silent."""
        links = self.links
        ready = dict(links.poller.poll(wait_ms)) if self.pending else {}
        for k in sorted(self.pending):
            ch = links.channels[k]
            if ch.sock not in ready:
                continue
            try:
                msg = ch.poll_reply(self.kinds, links.servers[k].share.numel)
            except ServerError as exc:
                msg = exc
            if msg is not None:
                self.out[k] = msg
                self.pending.discard(k)
        for k in self.pending:
            links.channels[k].tick()  # CHECK a slow request; resend one that was lost
        if self.pending and 0 <= self.timeout_ms <= (time.monotonic() - self.t0) * 1000:
            raise ServersSilent(
                "; ".join(links.channels[k].silence(self.timeout_ms) for k in sorted(self.pending)),
                sorted(self.pending),
                self.out,
            )
        return not self.pending
