"""A learner's exchange with sharded parameter servers: K servers, each serving one range of
the flat vector (``span.split``), each with its own timestamp and sync engine.

Each step pushes every server its slice of the gradient, stamped with that server's
timestamp of the weights the gradient was computed on, and gathers the K replies: WEIGHTS
are decoded into that range of the model's buffer, UPTODATE leaves it. Staleness stays exact
per server: server k's σ is its own timestamp at arrival less the stamp this learner sent it
(docs/protocols.md). The K requests are all sent before any reply is awaited, so the servers
work at once; ``Shards.gather`` polls the K sockets, asking a slow one about its request
(CHECK) as ``Channel`` does.

A server that answers ``rejoin`` (it restarted, or evicted this learner) gets a HELLO alone;
the slice it refused is dropped, the others' replies are taken. A server that says STOP has
finished training; the learner goes on with the others (their ranges trained on the finished
ones' final weights) and ends once every server has said STOP, or once the others stay silent
for ``runtime.timeout_s`` after one said it (a server that died after training ended, its
STOP lost, with no restart to answer: the learner ends with a warning, not a failure; the
run's result is the servers' and the statistics server's to report). The servers finish at
the same count of gradients, but under softsync the gradient that ends server 0 may be another
learner's than the one that ends server 1 (one step more), and a server restarted from a
checkpoint counts again the gradients it lost (as many steps more).

Not thread-safe: one learner thread owns its exchange and channels.
"""

from __future__ import annotations

import logging
import time

import zmq

from .. import codec, transport, wire
from ..channel import Channel, ServerError
from ..config_architecture import most_parts, range_parts
from ..wire import Kind
from . import buckets
from .exchange import Frames

log = logging.getLogger("rudra_zmq.learner")


def _said_stop(replies: dict) -> list[int]:
    """The servers whose reply in ``replies`` is a STOP (training over there)."""
    return [k for k, m in replies.items() if isinstance(m, wire.Message) and m.kind == Kind.STOP]


class ServersSilent(TimeoutError):
    """No reply from the servers ``silent`` within the timeout; ``replies``: what the others
    answered meanwhile."""

    def __init__(self, text: str, silent: list[int], replies: dict):
        super().__init__(text)
        self.silent, self.replies = silent, replies


def server_channels(ctx, cfg, endpoints, sender: int, max_bytes: int = -1) -> list[Channel]:
    """A learner's channel to each parameter server at ``endpoints`` (one, or the servers of
    the ranges in order), with the run's timeouts and wire dtypes. Does not block."""
    return [
        Channel(
            ctx,
            ep,
            sender,
            name="parameter server" + (f" {k}" if len(endpoints) > 1 else ""),
            timeout_ms=int(cfg.runtime.timeout_s * 1000),
            hwm=4 + 2 * most_parts(cfg),  # a request's parts queue without blocking
            retry_ms=int(cfg.runtime.retry_s * 1000),
            max_bytes=max_bytes,
            dtypes=codec.dtypes(cfg),
            sndbuf=cfg.runtime.sndbuf_kib << 10,
        )
        for k, ep in enumerate(endpoints)
    ]


class Shards:
    """One ``Channel`` per server, and a poller over their sockets: send to all, then gather.
    Not thread-safe."""

    def __init__(self, channels: list[Channel], spans):
        if len(channels) != len(spans):
            raise ValueError(f"{len(channels)} server channels for {len(spans)} ranges")
        self.channels, self.spans = channels, list(spans)
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
                    msg = ch.poll_reply(kinds, self.spans[k].numel)
                except ServerError as exc:
                    msg = exc
                if msg is not None:
                    out[k] = msg
                    pending.discard(k)
            for k in pending:
                self.channels[k].tick()  # CHECK a slow request; resend one that was lost
            if pending and 0 <= timeout_ms <= (time.monotonic() - t0) * 1000:
                names = ", ".join(
                    f"{self.channels[k].name} at {self.channels[k].endpoint} "
                    f"[{self.channels[k].waiting()}]"
                    for k in sorted(pending)
                )
                raise ServersSilent(
                    f"no reply from {names} within {timeout_ms / 1000:g} s (is it running?)",
                    sorted(pending),
                    out,
                )
        return out

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


class ShardedPushPull:
    """PUSHPULL to K servers per step (Rudra-base with ``architecture.servers`` > 1)."""

    def __init__(self, cfg, learner_id: int, flat, shards: Shards):
        self.id, self.flat, self.shards = learner_id, flat, shards
        chunk = cfg.runtime.chunk_mib << 20
        # one carrier per range: a half codec's error-feedback residual is per range
        self.carriers = [
            Frames(s.numel, chunk, wire_codec=codec.for_gradients(cfg)) for s in shards.spans
        ]
        self.stamps = [-1] * len(shards.spans)  # each server's timestamp of our weights
        # wire.parts: each range's part offsets (one part: whole messages)
        self.bounds = [range_parts(cfg, s.numel) for s in shards.spans]
        # the parts leave as backward finishes them (learner/buckets.py), where it can
        self.stream = (
            buckets.StreamedPush(flat, shards.spans, self.bounds)
            if cfg.wire.push_during_backward and buckets.enabled(flat, self.carriers)
            else None
        )
        self.active = list(range(len(shards.spans)))  # the servers still training
        self.rejoins = 0
        self.on_welcome = lambda step: None  # the learner repositions its data here

    @property
    def ts(self) -> int:
        """The first server's timestamp of the weights held (for progress records)."""
        return self.stamps[0]

    def _hello(self, k: int) -> None:
        span = self.shards.spans[k]
        had = {"had": self.stamps[k]} if self.stamps[k] >= 0 else {}
        self.shards.channels[k].send(
            Kind.HELLO,
            model=self.flat.signature,
            numel=self.flat.numel,
            range=[span.lo, span.hi],
            **had,
        )

    def start(self, which=None) -> bool:
        """Say HELLO to the servers ``which`` (default all still training) and load their
        WELCOMEs' ranges. Blocks; False once every server has said STOP."""
        which = list(self.active if which is None else which)
        for k in which:
            self._hello(k)
        replies = self.shards.gather(which, {Kind.WELCOME})
        if self._stopped(replies):
            return False
        for k in sorted(replies):
            msg = replies[k]
            if isinstance(msg, ServerError):
                raise msg
            self._load(k, msg)
        self.flat.weights_to_device()
        if 0 in replies:  # the data order goes on where the first server says
            self.on_welcome(replies[0].fields.get("step"))
        return True

    def _load(self, k: int, msg: wire.Message) -> None:
        span = self.shards.spans[k]
        self.stamps[k] = self.carriers[k].load(msg, self.flat.weights[span.lo : span.hi])

    def step(self, backward) -> bool:
        """``backward()`` fills the gradient; push each server its slice and take the newer
        weights of each range. Blocks for all K replies; False once a server said STOP.
        With ``stream``, each part leaves as backward finishes it."""
        if self.stream is not None:
            self.stream.push(backward, self._requests())
        else:
            backward()
            self._send_all()
        return self._gather()

    def _requests(self) -> dict:
        """Each active server's request, as ``buckets.request_calls``."""
        grads, w = self.flat.grads, self.flat.weights
        return {
            k: buckets.request_calls(
                self.shards.channels[k],
                self.stamps[k],
                self.carriers[k],
                grads[self.shards.spans[k].lo : self.shards.spans[k].hi],
                self.bounds[k],
                w[self.shards.spans[k].lo : self.shards.spans[k].hi],
            )
            for k in self.active
        }

    def _send_all(self) -> None:
        """Send every active server its slice after backward, part-major across servers."""
        grads = self.flat.grads
        queued = []  # in parts: the reply's parts come ahead into the weights
        for k in self.active:
            span, ch, bounds = self.shards.spans[k], self.shards.channels[k], self.bounds[k]
            if len(bounds) > 2:
                parts = self.carriers[k].parts(grads[span.lo : span.hi], bounds)
                w = self.flat.weights[span.lo : span.hi]
                queued.append((ch, ch.parts(Kind.PUSHPULL, self.stamps[k], parts, w)))
                continue
            payloads, fields = self.carriers[k].gradient(grads[span.lo : span.hi])
            ch.send(Kind.PUSHPULL, self.stamps[k], payloads, **fields)
        for i in range(max((len(m) for _, m in queued), default=0)):  # part-major
            for ch, msgs in queued:
                if i < len(msgs):
                    ch.send_part(msgs[i])

    def _gather(self) -> bool:
        """The K replies: load the newer weights of each range. Blocks; False after STOP."""
        try:
            replies = self.shards.gather(list(self.active), {Kind.WEIGHTS, Kind.UPTODATE})
        except ServersSilent as exc:
            return self._silent_after_stop(exc)
        if self._stopped(replies):
            return False
        loaded, rejoin = False, []
        for k in sorted(replies):
            msg = replies[k]
            if isinstance(msg, ServerError):
                if msg.code != "rejoin":
                    raise msg
                rejoin.append(k)
            elif msg.kind == Kind.WEIGHTS:
                self._load(k, msg)
                loaded = True
        if loaded:
            self.flat.weights_to_device()
        if rejoin:
            for k in rejoin:  # each refused slice's error-feedback residual goes with it
                self.carriers[k].refused()
            self.rejoins += len(rejoin)
            log.warning("learner %d: rejoining servers %s", self.id, rejoin)
            return self.start(rejoin)
        return True

    def _stopped(self, replies: dict) -> bool:
        """Take the servers in ``replies`` that said STOP (training over there) out of
        ``active`` (their replies are removed); whether none is left."""
        stop = _said_stop(replies)
        for k in stop:
            del replies[k]
            self.active.remove(k)
        if stop and self.active:  # once per reply, not per server
            log.info(
                "learner %d: servers %s finished training; going on with %s",
                self.id,
                sorted(stop),
                self.active,
            )
        return not self.active

    def _silent_after_stop(self, exc: ServersSilent) -> bool:
        """Servers silent for the whole timeout: a failure while every server is training;
        once one has said STOP (before or among ``exc.replies``) training is over, and the
        learner ends (False) with a warning naming the silent ones. Raises ``exc`` otherwise."""
        said = _said_stop(exc.replies)
        if len(self.active) == len(self.shards.spans) and not said:
            raise exc
        log.warning(
            "learner %d: servers %s finished training and %s has said nothing since: %s; "
            "ending here without its STOP",
            self.id,
            [k for k in range(len(self.shards.spans)) if k not in self.active or k in said],
            exc.silent,
            exc,
        )
        self.active = []
        return False

    def close(self, finished: bool) -> None:
        """Release the carriers and the backward hooks (the learner closes the channels)."""
        if self.stream is not None:
            self.stream.close()
        for c in self.carriers:
            c.close()
