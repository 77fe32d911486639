"""Rudra-adv*: each weight version travels once from the root PS through the learners.

With ``architecture.kind: advstar`` the root publishes every new version into a broadcast tree
of the learners (``architecture.broadcast_fanout`` = k, k = 1 a chain; learner i's children are
k(i+1) .. k(i+1)+k-1, ``topology.broadcast_children``). A version is sent as ``total`` BCAST
chunks; a member forwards each chunk the moment it arrives (the received frames, zero-copy),
so the chain pipelines.

- Flow control is credit-based per link, in chunks: a sender starts a version on a link only if
  the link has credit for all of it; otherwise the link later gets the newest complete version,
  whole. A slow member only misses superseded versions, and nobody waits for it.
- Every chunk is validated before anything is forwarded or kept; a refused chunk changes nothing.
- A complete version is an immutable :class:`Version` of the received frames (never written, no
  copy) that becomes the newest by one reference assignment, so no reader sees half of one. The
  learner copies the newest into its model between steps (``copy_latest_into``).

The sending side of each hop is ``broadcast_link.Fanout``. Threads: :class:`BroadcastRoot` and
:class:`BroadcastMember` each run one I/O thread that owns their sockets after ``start()``; the
owner talks to it over an inproc PAIR pipe (``publish``, ``close``). No torch here. Windows and
validation: ``docs/architecture.md``; the messages: ``docs/wire.md``.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import zmq

from .. import codec, kernels, transport, wire
from ..wire import Kind
from .broadcast_link import Fanout, IOThread, Version, default_window, drain, pipe, router

log = logging.getLogger("rudra_zmq.broadcast")

MAX_CHUNKS = 1 << 16  # chunks in one version
_POLL_MS = 100
# a member closed once STOP went down waits this long for planned children that have not
# connected yet (a learner that started after training ended), to tell them STOP too
STOP_LINGER_S = 3.0


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
            events = dict(poller.poll(_POLL_MS))
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


class BroadcastMember(IOThread):
    """A learner's place in the broadcast: receives from ``upstream``, forwards to the
    children that connect to ``bind`` (None: no children), keeps the newest complete version.

    Args:
        ctx: a ZeroMQ context (thread-safe; shared with the learner).
        bind: endpoint its children connect to (``tcp://HOST:0`` picks a port: ``.endpoint``).
        upstream: the endpoint of its upstream (the root, or another member).
        numel: the model size every version must have.
        member: its learner id (the sender of its CREDIT messages).
        children: member ids allowed to connect (None: any).
        window: credit granted upstream, in chunks (default two versions).
        timeout_s: no message from upstream for this long, before STOP, is an error.
        upstream_name: for messages ("learner 2", "the root").
        on_version: called as ``on_version(ts, chunks)`` in the I/O thread for each complete
            version, before ``latest()`` shows it (tests, benchmarks); keep it quick.

    Sockets are made and bound here; after ``start()`` only the I/O thread uses them.
    ``latest``, ``copy_latest_into``, ``check``, ``stopped`` are thread-safe; ``close`` is
    for the owner.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        bind: str | None,
        upstream: str,
        numel: int,
        *,
        member: int = 0,
        children=None,
        window: int | None = None,
        chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES,
        timeout_s: float = 120.0,
        upstream_name: str = "its upstream",
        on_version=None,
        dtypes: wire.ModelDtypes = wire.FLOAT32,
    ):
        self.dtypes = dtypes  # BCAST chunks travel in dtypes.weights
        self.numel, self.id, self.timeout_s = numel, member, timeout_s
        self.upstream, self.upstream_name, self.on_version = upstream, upstream_name, on_version
        self.window = window or default_window(numel, chunk_bytes)
        self._up = transport.make_socket(
            ctx,
            zmq.DEALER,
            hwm=self.window + 8,
            identity=transport.new_routing_id(),
            max_bytes=transport.frame_limit(chunk_bytes),
        )
        transport.connect(self._up, upstream, member)
        self._down, self._fan, self.endpoint = None, None, None
        if bind:
            self._down, self.endpoint = router(ctx, bind, 2 * self.window + 8)
            self._fan = Fanout(self._down, children, f"learner {member}", 2 * self.window)
        self._ctl, self._ctl_io = pipe(ctx, f"bcast-member{member}")
        self._name = f"bcast-member-{member}"
        self._ready: Version | None = None  # newest complete version (swapped whole)
        self._partial: list | None = None  # [ts, total, chunks, frames, next offset]
        self.stop_reason: str | None = None
        self._linger_until: float | None = None  # closed after STOP: serving late children
        self.received = self.versions = self.refused = self.aborted = 0
        self._seq = itertools.count(1)
        self._warned: set = set()

    def _sockets(self):
        return tuple(s for s in (self._up, self._down, self._ctl_io) if s is not None)

    # ------------------------------------------------------------------ reader side
    def latest_version(self) -> Version | None:
        """The newest complete version (immutable), or None. Never blocks."""
        return self._ready

    def latest(self) -> tuple[int, np.ndarray | None]:
        """(ts, weights) of the newest complete version; (-1, None) before the first. The
        array is read-only: a view of the frame for a one-chunk model, else a copy."""
        v = self._ready
        return (-1, None) if v is None else (v.ts, v.concatenated())

    def copy_latest_into(self, dst: np.ndarray, newer_than: int = -1) -> int:
        """Copy the newest complete version into ``dst`` if it is newer than ``newer_than``;
        return its ts (else ``newer_than``). Blocks for the copy only (kernels release the GIL)."""
        v = self._ready
        if v is None or v.ts <= newer_than:
            return newer_than
        codec.load(dst, v.chunks)  # widened if the wire is half
        return v.ts

    @property
    def stopped(self) -> bool:
        """Whether a STOP came down the broadcast (training finished)."""
        return self.stop_reason is not None

    def close(self, stop_reason: str | None = None) -> None:
        """Stop the I/O thread; with ``stop_reason``, tell the children STOP first (a learner
        that leaves after training ended). Blocks up to ~5 s. Idempotent."""
        super().close(*(() if stop_reason is None else (stop_reason.encode(),)))

    # ------------------------------------------------------------------ I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in self._sockets():
            poller.register(s, zmq.POLLIN)
        self._credit(self.window, reset=True)
        last = time.monotonic()
        while not self._closing:
            events = dict(poller.poll(_POLL_MS))
            if self._ctl_io in events:
                drain(self._ctl_io, self._command)
            if self._down is not None and self._down in events:
                drain(self._down, self._fan.on_message, copy=False)  # User-Id (CURVE)
                self._fan.catch_up(self._ready)
            if self._up in events:
                self._owed = 0  # credit to return upstream
                drain(self._up, self._from_upstream, copy=False)
                if self._owed:
                    self._credit(self._owed)
                last = time.monotonic()
            elif (
                self.stop_reason is None
                and self._linger_until is None
                and time.monotonic() - last > self.timeout_s
            ):
                raise TimeoutError(
                    f"broadcast member learner {self.id}: no weights from {self.upstream_name} "
                    f"at {self.upstream} for {self.timeout_s:g} s (runtime.timeout_s) while "
                    f"training is not finished; is {self.upstream_name} running?"
                )
            if self._linger_until is not None and (
                time.monotonic() > self._linger_until or self._fan.all_told()
            ):
                self._closing = True

    def _command(self, cmd) -> None:
        """``close`` [reason]: with a reason, tell the children STOP first. Once STOP went
        down, close when every planned child was told, or after STOP_LINGER_S."""
        if len(cmd) > 1 and self._fan is not None and self.stop_reason is None:
            self._fan.stop(
                wire.encode(Kind.STOP, wire.SENDER_PS, 0, reason=cmd[1].decode(errors="replace"))
            )
        if self._fan is not None and self._fan.stop_frames is not None and not self._fan.all_told():
            self._linger_until = time.monotonic() + STOP_LINGER_S
        else:
            self._closing = True

    def _credit(self, k: int, reset: bool = False) -> None:
        self._up.send_multipart(
            wire.encode(Kind.CREDIT, self.id, next(self._seq), credit=k, reset=reset), zmq.NOBLOCK
        )

    def _refuse(self, code: str, message: str) -> None:
        self.refused += 1
        if code not in self._warned:
            self._warned.add(code)
            log.warning(
                "broadcast member learner %d refused a message from %s: %s",
                self.id,
                self.upstream_name,
                message,
            )

    def _from_upstream(self, frames) -> None:
        """Handle one message from upstream; every message but a STOP used one credit."""
        try:
            msg = wire.decode(frames, kinds={Kind.BCAST, Kind.STOP}, dtypes=self.dtypes)
            if msg.kind == Kind.STOP:
                if self.stop_reason is None:
                    self.stop_reason = msg.fields["reason"]
                    if self._fan is not None:
                        self._fan.stop(frames)
                return
            self._check(msg)
        except wire.WireError as exc:
            self._owed += 1
            self._refuse(exc.code, str(exc))
            return
        self._owed += 1
        self.received += 1
        f, part = msg.fields, msg.payloads[0]
        if f["chunk"] == 0:
            if self._partial is not None:
                self.aborted += 1
            self._partial = [msg.ts, f["total"], [], [], 0]
            if self._fan is not None:
                self._fan.admit(msg.ts, f["total"])
        if self._fan is not None:
            self._fan.pass_on(msg.ts, frames)
        p = self._partial
        p[2].append(part)
        p[3].append(tuple(frames))
        p[4] = f["offset"] + part.shape[0]
        if len(p[2]) == p[1]:
            self._partial = None
            v = Version(p[0], p[1], tuple(p[2]), tuple(p[3]))
            if self.on_version is not None:  # before the swap: latest() never runs ahead
                self.on_version(v.ts, v.chunks)
            self.versions += 1
            self._ready = v  # the swap: readers see the old or the new, never a part
            if self._fan is not None:
                self._fan.passed(v.ts)
                self._fan.catch_up(v)

    def _check(self, msg: wire.Message) -> None:
        """Raise WireError unless ``msg`` is the next chunk of a version we can complete."""
        f, n = msg.fields, msg.payloads[0].shape[0]
        i, off, total = f["chunk"], f["offset"], f["total"]
        newest = -1 if self._ready is None else self._ready.ts
        if msg.sender != wire.SENDER_PS:
            raise wire.WireError(
                "bad_sender",
                f"BCAST from {wire.sender_name(msg.sender)}; "
                "versions originate at the parameter server",
            )
        if not (1 <= total <= MAX_CHUNKS and 0 <= i < total):
            raise wire.WireError("bad_chunk", f"BCAST chunk {i} of {total} (1..{MAX_CHUNKS})")
        if n < 1 or off < 0 or off + n > self.numel or (i == total - 1) != (off + n == self.numel):
            raise wire.WireError(
                "bad_length",
                f"BCAST chunk {i}/{total} covers [{off}, "
                f"{off + n}) of a model of {self.numel:,} floats (is the "
                "root running another model config?)",
            )
        if msg.ts <= newest:
            raise wire.WireError(
                "stale",
                f"BCAST version {msg.ts} is not newer than the newest complete version {newest}",
            )
        p = self._partial
        if i == 0:
            if off != 0:
                raise wire.WireError("bad_chunk", f"BCAST chunk 0 at offset {off}, not 0")
        elif p is None or (p[0], p[1], len(p[2]), p[4]) != (msg.ts, total, i, off):
            have = "none" if p is None else f"version {p[0]} chunk {len(p[2])}/{p[1]} at {p[4]}"
            raise wire.WireError(
                "out_of_order",
                f"BCAST version {msg.ts} chunk {i}/{total} "
                f"at offset {off} does not continue the version in progress "
                f"(expected: {have})",
            )
