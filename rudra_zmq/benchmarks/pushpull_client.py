"""The processes of ``rudra-zmq bench pushpull``: λ clients and the raw ZeroMQ server.

A client speaks to the parameter server exactly as ``roles/learner.py`` does (a
``transport.Channel``: HELLO, then PUSHPULL / PUSH / PULL, the gradient sent zero-copy in
``chunk_bytes`` frames or in GPART parts of ``part_floats`` (``Channel.send_gradient``),
replies received ``copy=False`` and validated by ``wire.decode``, the reply's frames held
until the next operation), minus the model: the learner's copy of new
weights into its parameters is not timed. It also talks to the raw server, which answers a
request ``[header, payload...]`` with the number of bytes the 16-byte header asks for, in
frames of the requested size, from one preallocated buffer (never written after allocation,
so sending it zero-copy is safe). Both sides receive ``copy=False``.

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

from .. import transport, wire
from . import sides
from ..wire import Kind

SIGNATURE = "bench-synthetic"
PAYLOADS = {"push_then_pull": 2, "pushpull": 2, "push": 1, "pull": 1}   # N-byte transfers/op
RAW = {"push_then_pull": [(1, 0), (0, 1)], "pushpull": [(1, 1)], "push": [(1, 0)],
       "pull": [(0, 1)]}                      # raw round trips per operation: (up, down) x N
_HDR = struct.Struct("<QQ")                   # raw request: reply bytes, reply frame bytes
TIMEOUT_MS = 300_000


def raw_server(conn, stop, bind: str, io_threads: int = 1) -> None:
    """The raw baseline: a ROUTER answering each request with the bytes its header asks for."""
    sides.exit_with_parent()
    transport.tune_malloc()
    ctx = zmq.Context(io_threads=io_threads)
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64)
    conn.send(transport.bind(sock, bind))
    reply = np.ones(0, np.uint8)
    try:
        while not stop.is_set():
            if not sock.poll(100):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                nbytes, frame = _HDR.unpack(frames[1].bytes)
                if nbytes > reply.shape[0]:
                    reply = np.ones(nbytes, np.uint8)
                parts = wire.chunk(reply[:nbytes], frame) if nbytes else []
                sock.send_multipart([frames[0], frames[1], *parts], copy=False)
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


class _Client:
    """One client: a learner's channel to the PS (or its tree leaf) and a raw DEALER."""

    def __init__(self, ctx, learner: int, ps: list, raw: str, n: int, chunk_bytes: int,
                 mode: str, wait: bool, part_floats: int):
        self.n, self.nbytes, self.mode, self.wait = n, 4 * n, mode, wait
        self.part_floats = part_floats   # < n: gradients go in GPART parts, as a learner's
        self.ch = transport.Channel(ctx, ps[learner], learner, name="parameter server",
                                    timeout_ms=TIMEOUT_MS, hwm=4)
        self.grad = np.full(n, 1e-3, np.float32)
        self.ch.send(Kind.HELLO, model=SIGNATURE, numel=n)
        self.ts = self.ch.recv({Kind.WELCOME}, numel=n).ts
        self.raw = transport.make_socket(ctx, zmq.DEALER, hwm=4)
        self.raw.connect(raw)
        self.chunk_bytes = chunk_bytes
        self.raw_parts = wire.chunk(np.ones(self.nbytes, np.uint8), chunk_bytes)
        self.last = None

    def _ps_request(self, kind, ts, payloads=(), replies=(Kind.WEIGHTS, Kind.UPTODATE), **kw):
        if kind in (Kind.PUSH, Kind.PUSHPULL):   # the gradient, sent as the learner sends it
            self.ch.send_gradient(kind, ts, self.grad, self.part_floats, self.chunk_bytes, **kw)
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

    def op_raw(self) -> tuple[int, int]:
        up = down = 0
        for u, d in RAW[self.mode]:
            self.raw.send_multipart([_HDR.pack(d * self.nbytes, self.chunk_bytes),
                                     *(self.raw_parts if u else ())], copy=False)
            if not self.raw.poll(TIMEOUT_MS):
                raise TimeoutError("the raw server did not answer")
            self.last = self.raw.recv_multipart(copy=False)
            got = sum(len(f) for f in self.last[1:])
            if got != d * self.nbytes:
                raise RuntimeError(f"raw server sent {got:,} bytes, asked {d * self.nbytes:,}")
            up, down = up + u * self.nbytes, down + got
        return up, down

    def run(self, target: str, count: int) -> dict:
        op = self.op_ps if target == "ps" else self.op_raw
        lat, up, down = [], 0, 0
        perf = time.perf_counter
        t0 = time.monotonic()
        for _ in range(count):
            a = perf()
            u, d = op()
            lat.append(perf() - a)
            up, down = up + u, down + d
        return {"lat": lat, "t0": t0, "t1": time.monotonic(), "up": up, "down": down}

    def close(self) -> None:
        self.ch.close()
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
