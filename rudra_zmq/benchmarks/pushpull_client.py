"""The measuring processes of ``rudra-zmq bench pushpull``: λ clients, driven over pipes.

A client speaks to the parameter server exactly as ``learner/learner.py`` does (a
``channel.Channel``: HELLO, then PUSHPULL / PUSH / PULL, the gradient sent zero-copy in
``chunk_bytes`` frames (``wire.chunk``, ``Channel.send``), replies received ``copy=False`` and
validated by ``wire.decode``, the reply's frames held until the next operation), minus the
model: the learner's copy of new weights into its parameters is not timed. It does the same
against the echo server (the protocol without the PS), and talks to the raw server (see
:mod:`.pushpull_server`) with a bare DEALER: ``[payload...]`` for the push+pull trip (nothing
else on the wire), ``[header, payload...]`` for the other modes.

The measuring process drives the clients over multiprocessing pipes (:class:`Clients`), one
command at a time for all of them; clients time each operation with ``time.perf_counter``,
each block with ``time.monotonic`` (CLOCK_MONOTONIC: comparable between processes of a host),
and count their own CPU time and minor page faults per block.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import time
import traceback

import numpy as np
import zmq

from .. import transport, wire
from ..channel import Channel
from ..wire import Kind
from . import sides
from .pushpull_server import RAW_HDR, SIGNATURE

PAYLOADS = {"push_then_pull": 2, "pushpull": 2, "push": 1, "pull": 1}  # N-byte transfers/op
RAW = {
    "push_then_pull": [(1, 0), (0, 1)],
    "pushpull": [(1, 1)],
    "push": [(1, 0)],
    "pull": [(0, 1)],
}  # raw round trips per operation: (up, down) x N
TIMEOUT_MS = 300_000


class _Client:
    """One client: a learner's channels to the PS (or its tree leaf) and to the echo server,
    and a raw DEALER. Not thread-safe."""

    def __init__(
        self, ctx, learner: int, ps: list, echo: str, raw: str, n: int, chunk_bytes: int, mode: str
    ):
        self.n, self.nbytes, self.mode = n, 4 * n, mode
        self.chunk_bytes = chunk_bytes
        self.grad = np.full(n, 1e-3, np.float32)
        self.chans, self.ts = {}, {}
        for target, ep in (("ps", ps[learner]), ("echo", echo)):
            ch = Channel(ctx, ep, learner, name=f"{target} server", timeout_ms=TIMEOUT_MS, hwm=4)
            ch.send(Kind.HELLO, model=SIGNATURE, numel=n)
            self.ts[target] = ch.recv({Kind.WELCOME}, numel=n).ts
            self.chans[target] = ch
        # a blocking receive with a timeout, as the learner's Channel waits: no Poller per trip
        self.raw = transport.make_socket(ctx, zmq.DEALER, hwm=4, rcvtimeo=TIMEOUT_MS)
        self.raw.connect(raw)
        parts = wire.chunk(np.ones(self.nbytes, np.uint8), chunk_bytes)
        # each raw round trip of the mode: (request frames, reply frames, reply bytes, header
        # frames in the reply); the push+pull trip carries nothing but the payload
        self.raw_trips = []
        for u, d in RAW[mode]:
            reply = len(wire.chunk(np.empty(d * self.nbytes, np.uint8), chunk_bytes)) if d else 0
            if u and d:
                self.raw_trips.append((parts, reply, d * self.nbytes, 0))
            else:
                self.raw_trips.append(
                    (
                        [RAW_HDR.pack(d * self.nbytes, chunk_bytes, 0), *(parts if u else ())],
                        1 + reply,
                        d * self.nbytes,
                        1,
                    )
                )
        self.raw_up = sum(u for u, _ in RAW[mode]) * self.nbytes
        self.raw_down = sum(d for _, d in RAW[mode]) * self.nbytes
        self.last = None

    def _request(self, target, kind, ts, replies=(Kind.WEIGHTS, Kind.UPTODATE), **kw):
        """One request and its reply, as a learner makes it (blocks up to TIMEOUT_MS)."""
        ch = self.chans[target]
        if kind in (Kind.PUSHPULL, Kind.PUSH):  # the gradient, sent as the learner sends it
            ch.send(kind, ts, wire.chunk(self.grad, self.chunk_bytes), **kw)
        else:
            ch.send(kind, ts, **kw)
        msg = ch.recv(set(replies), self.n)
        if msg.kind == Kind.STOP:
            raise RuntimeError(f"the {target} server said STOP: {msg.fields['reason']}")
        self.last = msg  # hold the frames until the next operation, as a learner
        return msg, sum(p.nbytes for p in msg.payloads)

    def _op_protocol(self, target: str) -> tuple[int, int]:
        """One operation of the mode against the PS or the echo server; (bytes up, bytes
        down) of payload."""
        m, ts = self.mode, self.ts[target]
        up = down = 0
        if m in ("push", "push_then_pull"):
            ack, _ = self._request(target, Kind.PUSH, ts, replies=(Kind.ACK,))
            up += self.nbytes
            if m == "push":
                ts = ack.ts  # a pushing-only learner claims the newest weights
        if m in ("pull", "push_then_pull"):
            pull_ts = -1 if m == "pull" else ts  # -1: "I have nothing", always answered
            msg, down = self._request(target, Kind.PULL, pull_ts)  # (hardsync: held until
            #                                                           the update, by the PS)
            if msg.kind == Kind.WEIGHTS and m != "pull":
                ts = msg.ts
        if m == "pushpull":
            msg, down = self._request(target, Kind.PUSHPULL, ts)
            up += self.nbytes
            if msg.kind == Kind.WEIGHTS:
                ts = msg.ts
        self.ts[target] = ts
        return up, down

    def op_ps(self) -> tuple[int, int]:
        return self._op_protocol("ps")

    def op_echo(self) -> tuple[int, int]:
        return self._op_protocol("echo")

    def op_raw(self) -> tuple[int, int]:
        """One operation of the mode against the raw server: send, receive (checked: the
        frame count here, the bytes at the end of the block in ``run``)."""
        for request, frames, _, _ in self.raw_trips:
            self.raw.send_multipart(request, copy=False)
            try:
                self.last = self.raw.recv_multipart(copy=False)
            except zmq.Again:
                raise TimeoutError("the raw server did not answer") from None
            if len(self.last) != frames:
                raise RuntimeError(f"raw server sent {len(self.last)} frames, expected {frames}")
        return self.raw_up, self.raw_down

    def run(self, target: str, count: int) -> dict:
        """``count`` operations against ``target`` (blocks); latencies, block times, bytes,
        and this process's CPU seconds and minor page faults over the block."""
        op = {"ps": self.op_ps, "echo": self.op_echo, "raw": self.op_raw}[target]
        lat, up, down = [], 0, 0
        perf = time.perf_counter
        cpu0, faults0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.monotonic()
        for _ in range(count):
            a = perf()
            u, d = op()
            lat.append(perf() - a)
            up, down = up + u, down + d
        t1 = time.monotonic()
        cpu = time.process_time() - cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        if target == "raw":  # the last reply's size, checked outside the timed operations
            got = sum(len(f) for f in self.last[self.raw_trips[-1][3] :])
            if got != self.raw_trips[-1][2]:
                raise RuntimeError(
                    f"raw server sent {got:,} bytes, asked {self.raw_trips[-1][2]:,}"
                )
        return {
            "lat": lat,
            "t0": t0,
            "t1": t1,
            "up": up,
            "down": down,
            "cpu_s": cpu,
            "minflt": faults,
        }

    def close(self) -> None:
        for ch in self.chans.values():
            ch.close()
        self.raw.close(linger=0)


def _client_process(conn, learner: int) -> None:
    sides.exit_with_parent()
    transport.tune_malloc()
    ctx = zmq.Context()
    client = None
    try:
        while True:
            cmd, kw = conn.recv()
            if cmd == "quit":
                break
            try:
                if cmd == "connect":
                    client, out = _Client(ctx, learner, **kw), None
                elif cmd == "run":
                    out = client.run(**kw)
                else:  # close
                    client, out = client.close() if client else None, None
                conn.send(("ok", out))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        if client is not None:
            client.close()
        ctx.destroy(linger=0)


class Clients:
    """λ client processes (learner ids 0..λ-1), each told the same command at once.

    ``call`` blocks until every client answered; a client's exception is re-raised here with
    its traceback. Not thread-safe.
    """

    def __init__(self, n: int):
        spawn = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for i in range(n):
            parent, child = spawn.Pipe()
            proc = spawn.Process(
                target=_client_process, args=(child, i), daemon=True, name=f"bench-client-{i}"
            )
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def call(self, cmd: str, **kw) -> list:
        for p in self.pipes:
            p.send((cmd, kw))
        out, errors = [], []
        for i, p in enumerate(self.pipes):
            if not p.poll(TIMEOUT_MS / 1000):
                raise TimeoutError(
                    f"bench client {i} did not answer {cmd!r} within {TIMEOUT_MS / 1000:.0f} s"
                )
            status, value = p.recv()
            (out if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError(f"a bench client failed in {cmd!r}:\n{errors[0]}")
        return out

    def close(self) -> None:
        for p in self.pipes:
            try:
                p.send(("quit", {}))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
