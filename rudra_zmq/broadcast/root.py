"""The root of a Rudra-adv* broadcast, in the root parameter server: every new weight version,
published by the PS's thread, is sent by an I/O thread as BCAST chunks to the root's children
(learners), each only as far as the credit it granted allows (``link.Fanout``). The protocol:
``broadcast/__init__.py``."""

from __future__ import annotations

import itertools

import numpy as np
import zmq

from .. import codec, kernels, wire
from ..wire import Kind
from .link import POLL_MS, Fanout, IOThread, Version, default_window, drain, pipe, router


class BroadcastRoot(IOThread):
    """The root's end: binds ``bind``; ``publish`` hands each new version to the I/O thread.

    ``children``: the member ids allowed to connect (None: any). ``window`` caps the credit a
    child may grant. ``publish`` and ``close`` are for one owner thread (the PS's).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        bind: str,
        numel: int,
        *,
        children=None,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        window: int | None = None,
        wire_codec=codec.FLOAT32,
    ):
        self.numel, self.chunk_bytes, self.codec = numel, chunk_bytes, wire_codec
        self.window = window or default_window(numel, chunk_bytes)
        self._down, self.endpoint = router(ctx, bind, 2 * self.window + 8)
        self._fan = Fanout(self._down, children, "the broadcast root", 2 * self.window)
        self._ctl, self._ctl_io = pipe(ctx, "bcast-root")
        self._name = "bcast-root"
        self._slot: tuple[int, np.ndarray] | None = None  # newest published (ts, snapshot)
        self.current: Version | None = None  # newest the I/O thread sends
        self.published = 0
        self._seq = itertools.count(1)

    def _sockets(self):
        return (self._down, self._ctl_io)

    def publish(
        self,
        ts: int,
        weights: np.ndarray,
        done: bool = False,
        reason: str = "training finished",
        copy: bool = True,
    ) -> None:
        """Broadcast version ``ts`` of ``weights``: copied first (one pass, kernels.copy_into;
        the caller may then write ``weights``; narrowed instead on a half wire,
        ``wire.weights_dtype``), or with ``copy=False`` sent as it is, for a
        caller that never writes that array again while anyone refers to it (the parameter
        server's weight versions, ``versions.WeightVersions``). ``done``: then STOP the
        members. Never waits for the network; a version superseded before a link had room is
        skipped on that link."""
        if self.codec.copies:  # a half wire: the narrowed copy is the snapshot
            snap = self.codec.narrowed(weights)
        elif copy:
            snap = np.empty(self.numel, np.float32)
            kernels.copy_into(snap, weights)
        else:
            snap = weights
        self._slot = (ts, snap)  # one reference assignment: the I/O thread takes the newest
        self.published += 1
        try:
            self._ctl.send(b"new", zmq.NOBLOCK)
            if done:
                self._ctl.send_multipart([b"stop", reason.encode()], zmq.NOBLOCK)
        except zmq.Again:  # 1000 wake-ups queued: the I/O thread will see the newest anyway
            pass

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._down, zmq.POLLIN)
        poller.register(self._ctl_io, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll(POLL_MS))
            if self._ctl_io in events:
                drain(self._ctl_io, self._command)
            if self._down in events:
                drain(self._down, self._fan.on_message, copy=False)  # User-Id (CURVE)
                self._fan.catch_up(self.current)

    def _command(self, cmd) -> None:
        if cmd[0] == b"close":
            self._closing = True
        elif cmd[0] == b"stop":
            self._fan.stop(
                wire.encode(Kind.STOP, wire.SENDER_PS, next(self._seq), reason=cmd[1].decode())
            )
        else:
            self._take()

    def _take(self) -> None:
        slot = self._slot
        if self._closing or slot is None or (self.current and slot[0] <= self.current.ts):
            return
        ts, snap = slot
        chunks = tuple(wire.chunk(snap, self.chunk_bytes))
        offs = np.cumsum([0] + [c.shape[0] for c in chunks])
        frames = tuple(
            tuple(
                wire.encode(
                    Kind.BCAST,
                    wire.SENDER_PS,
                    next(self._seq),
                    ts,
                    payloads=[c],
                    chunk=i,
                    offset=int(offs[i]),
                    total=len(chunks),
                )
            )
            for i, c in enumerate(chunks)
        )
        self.current = Version(ts, len(chunks), chunks, frames)
        self._fan.catch_up(self.current)
