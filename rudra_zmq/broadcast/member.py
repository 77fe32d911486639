"""A learner's place in a Rudra-adv* broadcast: receives each version's BCAST chunks from its
upstream (the root or another member), checks every chunk before anything is kept or
forwarded, passes each on to its own children the moment it arrives (``link.Fanout``), and
keeps the newest complete version for the learner to copy between steps. The protocol:
``broadcast/__init__.py``."""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import zmq

from .. import codec, transport, wire
from ..wire import Kind
from .link import POLL_MS, Fanout, IOThread, Version, default_window, drain, pipe, router

log = logging.getLogger("rudra_zmq.broadcast")

MAX_CHUNKS = 1 << 16  # chunks in one version
# a member closed once STOP went down waits this long for planned children that have not
# connected yet (a learner that started after training ended), to tell them STOP too
STOP_LINGER_S = 3.0


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
            events = dict(poller.poll(POLL_MS))
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
