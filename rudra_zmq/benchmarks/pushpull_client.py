"""The processes of ``rudra-zmq bench pushpull``: λ clients and the raw ZeroMQ server.

A client speaks to the parameter server exactly as ``roles/learner.py`` does (a
``transport.Channel``: HELLO, then PUSHPULL / PUSH / PULL, the gradient sent zero-copy in
``chunk_bytes`` frames or in GPART parts of ``part_floats`` (``Channel.send_gradient``),
replies received ``copy=False`` and validated by ``wire.decode``, the reply's frames held
until the next operation), minus the model: the learner's copy of new
weights into its parameters is not timed. It also talks to two raw servers (pyzmq, the
goal's baseline, and the same loop through ``rudra_zmq.fastio``), which answer a request
``[payload...]`` with as many bytes (the push+pull trip: payload frames only, nothing else
on the wire) and a request ``[header, payload...]`` with the number of bytes its 17-byte
header asks for (the other modes), in frames of the requested size, from preallocated
buffers (never written after allocation, so sending them zero-copy is safe). Both sides
receive ``copy=False``.

The measuring process drives the clients over multiprocessing pipes (:class:`Clients`), one
command at a time for all of them; clients time each operation with ``time.perf_counter`` and
each block with ``time.monotonic`` (CLOCK_MONOTONIC: comparable between processes of a host).
"""
from __future__ import annotations

import multiprocessing as mp
import struct
import time
import traceback

import numpy as np
import zmq

from .. import fastio, transport, wire
from . import sides
from ..wire import Kind

SIGNATURE = "bench-synthetic"
PAYLOADS = {"push_then_pull": 2, "pushpull": 2, "push": 1, "pull": 1}   # N-byte transfers/op
RAW = {"push_then_pull": [(1, 0), (0, 1)], "pushpull": [(1, 1)], "push": [(1, 0)],
       "pull": [(0, 1)]}                      # raw round trips per operation: (up, down) x N
# raw request header: reply bytes, reply frame bytes, 0. 17 bytes: never the length of a
# float32 payload frame, so a request without one (the push+pull trip) is told apart.
_HDR = struct.Struct("<QQB")
TIMEOUT_MS = 300_000


def raw_server(conn, stop, bind: str, io_threads: int = 1, fast: bool = False) -> None:
    """The raw baseline: a ROUTER answering each request with the bytes its header asks for,
    in as little Python as pyzmq allows (a blocking receive, replies cached per request
    header). ``fast``: the same through rudra_zmq's compiled framing (``fastio``) instead of
    pyzmq's calls: the transport the PS itself uses, with no protocol."""
    sides.exit_with_parent()
    transport.tune_malloc()
    ctx = zmq.Context(io_threads=io_threads)
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64)
    conn.send(transport.bind(sock, bind))
    io = fastio.FastSocket(sock) if fast else sock
    buffers, replies = [], {}
    # A blocking receive (at most 100 ms, to see ``stop``): no Poller or zmq.Again per message.
    sock.setsockopt(zmq.RCVTIMEO, 100)
    try:
        while not stop.is_set():
            try:
                frames = io.recv_multipart(copy=False)
            except zmq.Again:
                continue
            if len(frames[1]) == _HDR.size:   # [header, payload...]: as the header says
                key = frames[1].bytes
                nbytes, frame, _ = _HDR.unpack(key)
                head = [frames[1]]
            else:                             # [payload...]: as many bytes, in those frames
                frame = len(frames[1])
                nbytes = frame if len(frames) == 2 else sum(len(f) for f in frames[1:])
                key, head = (nbytes, frame), []
            parts = replies.get(key)
            if parts is None:   # a new request shape: its reply views, from a buffer never
                buffers.append(np.ones(nbytes, np.uint8))     # written after allocation
                parts = replies[key] = wire.chunk(buffers[-1], frame) if nbytes else []
            io.send_multipart([frames[0], *head, *parts], copy=False)
    finally:
        io.close(linger=0)    # (a FastSocket closes its socket as pyzmq's would)
        ctx.destroy(linger=0)


class _Client:
    """One client: a learner's channel to the PS (or its tree leaf) and a raw DEALER."""

    def __init__(self, ctx, learner: int, ps: list, raw: str, rawc: str, n: int,
                 chunk_bytes: int, mode: str, wait: bool, part_floats: int):
        self.n, self.nbytes, self.mode, self.wait = n, 4 * n, mode, wait
        self.part_floats = part_floats   # < n: gradients go in GPART parts, as a learner's
        self.ch = transport.Channel(ctx, ps[learner], learner, name="parameter server",
                                    timeout_ms=TIMEOUT_MS, hwm=4)
        self.grad = np.full(n, 1e-3, np.float32)
        self.ch.send(Kind.HELLO, model=SIGNATURE, numel=n)
        self.ts = self.ch.recv({Kind.WELCOME}, numel=n).ts
        # raw: pyzmq (the goal's baseline); rawc: rudra_zmq's compiled framing (a reference).
        # Blocking receives with a timeout, as the learner's Channel waits: no Poller per trip.
        self.raw = transport.make_socket(ctx, zmq.DEALER, hwm=4, rcvtimeo=TIMEOUT_MS)
        self.raw.connect(raw)
        rawc_sock = transport.make_socket(ctx, zmq.DEALER, hwm=4, rcvtimeo=TIMEOUT_MS)
        rawc_sock.connect(rawc)
        self.rawc = fastio.FastSocket(rawc_sock)
        self.chunk_bytes = chunk_bytes
        parts = wire.chunk(np.ones(self.nbytes, np.uint8), chunk_bytes)
        # each raw round trip of the mode: (request frames, reply frames, reply bytes, header
        # frames in the reply); the push+pull trip carries nothing but the payload, as a bare
        # pyzmq round trip would
        self.raw_trips = []
        for u, d in RAW[mode]:
            reply = len(wire.chunk(np.empty(d * self.nbytes, np.uint8), chunk_bytes)) if d else 0
            if u and d:
                self.raw_trips.append((parts, reply, d * self.nbytes, 0))
            else:
                self.raw_trips.append(([_HDR.pack(d * self.nbytes, chunk_bytes, 0),
                                        *(parts if u else ())], 1 + reply, d * self.nbytes, 1))
        self.raw_up = sum(u for u, _ in RAW[mode]) * self.nbytes
        self.raw_down = sum(d for _, d in RAW[mode]) * self.nbytes
        self.last = None

    def _ps_request(self, kind, ts, payloads=(), replies=(Kind.WEIGHTS, Kind.UPTODATE), **kw):
        if kind == Kind.PUSHPULL:   # the gradient, sent as the learner sends it
            msg = self.ch.pushpull(ts, self.grad, self.part_floats, self.chunk_bytes,
                                   kinds=set(replies), numel=self.n, **kw)
        else:
            if kind == Kind.PUSH:
                self.ch.send_gradient(kind, ts, self.grad, self.part_floats, self.chunk_bytes,
                                      **kw)
            else:
                self.ch.send(kind, ts, payloads, **kw)
            msg = self.ch.recv(set(replies), self.n)
        if msg.kind == Kind.STOP:
            raise RuntimeError(f"the PS said STOP: {msg.fields['reason']}")
        self.last = msg            # hold the frames until the next operation, as a learner
        return msg, sum(p.nbytes for p in msg.payloads)

    def op_ps(self) -> tuple[int, int]:
        """One operation of the mode against the PS; (bytes up, bytes down) of payload."""
        m = self.mode
        up = down = 0
        if m in ("push", "push_then_pull"):
            ack, _ = self._ps_request(Kind.PUSH, self.ts, replies=(Kind.ACK,))
            up += self.nbytes
            if m == "push":
                self.ts = ack.ts   # a pushing-only learner claims the newest weights
        if m in ("pull", "push_then_pull"):
            ts = -1 if m == "pull" else self.ts      # -1: "I have nothing", always answered
            msg, down = self._ps_request(Kind.PULL, ts, wait=self.wait and m != "pull")
            if msg.kind == Kind.WEIGHTS and m != "pull":
                self.ts = msg.ts
        if m == "pushpull":
            msg, down = self._ps_request(Kind.PUSHPULL, self.ts, wait=self.wait)
            up += self.nbytes
            if msg.kind == Kind.WEIGHTS:
                self.ts = msg.ts
        return up, down

    def _raw_op(self, sock) -> tuple[int, int]:
        """One operation of the mode against a raw server: send, receive (checked: the frame
        count here, the bytes at the end of the block in ``run``)."""
        for request, frames, _, _ in self.raw_trips:
            sock.send_multipart(request, copy=False)
            try:
                self.last = sock.recv_multipart(copy=False)
            except zmq.Again:
                raise TimeoutError("the raw server did not answer") from None
            if len(self.last) != frames:
                raise RuntimeError(f"raw server sent {len(self.last)} frames, expected {frames}")
        return self.raw_up, self.raw_down

    def op_raw(self) -> tuple[int, int]:
        return self._raw_op(self.raw)

    def op_rawc(self) -> tuple[int, int]:
        return self._raw_op(self.rawc)

    def run(self, target: str, count: int) -> dict:
        op = {"ps": self.op_ps, "raw": self.op_raw, "rawc": self.op_rawc}[target]
        lat, up, down = [], 0, 0
        perf = time.perf_counter
        t0 = time.monotonic()
        for _ in range(count):
            a = perf()
            u, d = op()
            lat.append(perf() - a)
            up, down = up + u, down + d
        if target != "ps":   # the last reply's size, checked outside the timed operations
            got = sum(len(f) for f in self.last[self.raw_trips[-1][3]:])
            if got != self.raw_trips[-1][2]:
                raise RuntimeError(f"raw server sent {got:,} bytes, asked "
                                   f"{self.raw_trips[-1][2]:,}")
        return {"lat": lat, "t0": t0, "t1": time.monotonic(), "up": up, "down": down}

    def close(self) -> None:
        self.ch.close()
        self.raw.close(linger=0)
        self.rawc.close(linger=0)


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
                else:   # close
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
            proc = spawn.Process(target=_client_process, args=(child, i), daemon=True,
                                 name=f"bench-client-{i}")
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def call(self, cmd: str, **kw) -> list:
        for p in self.pipes:
            p.send((cmd, kw))
        out, errors = [], []
        for i, p in enumerate(self.pipes):
            if not p.poll(TIMEOUT_MS / 1000):
                raise TimeoutError(f"bench client {i} did not answer {cmd!r} within "
                                   f"{TIMEOUT_MS / 1000:.0f} s")
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
