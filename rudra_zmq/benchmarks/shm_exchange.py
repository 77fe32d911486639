"""One lock-step exchange round between a leaf and k learner processes, both sides, for
``bench shm-leaf``: the leaf (:class:`Leaf`) sends the weights and sums the gradients, each
learner (:func:`learner_main`, its own process) takes the weights and hands back its gradient,
over ipc:// (zero-copy frames) or shared memory (:mod:`.shm_segment`, notifications only)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import struct
import tempfile
import time

import numpy as np
import zmq

from .. import kernels, transport, wire
from .shm_segment import (
    PREFIX,
    TIMEOUT_S,
    VERSION_BYTES,
    Checker,
    Segment,
    Seqlock,
    grad_value,
    make_pattern,
    weight_value,
    write,
)

WAYS = ("ipc", "shm")
# A notification / round header, both directions: way, op, learner, slot, round, version.
HDR = struct.Struct("<BBHBxxxIQ")  # 20 bytes
OP_ROUND, OP_STOP, OP_HELLO = 0, 1, 2


# ----------------------------------------------------------------------------- learner
def learner_main(i, n, endpoint, wname, gname, chunk_bytes, pattern_kind, leaf_pid):
    """One learner: answer every round until STOP, then report checks and CPU per way."""
    transport.tune_malloc()
    kernels.set_num_threads(1)
    wseg = Segment(wname, VERSION_BYTES + 4 * n, create=False)
    gseg = Segment(gname, 2 * 4 * n, create=False)
    lock = Seqlock(wseg, n)
    slots = [gseg.array(np.float32, n, s * 4 * n) for s in (0, 1)]
    private = [np.zeros(n, np.float32) for _ in (0, 1)]
    params = np.zeros(n, np.float32)
    pattern = make_pattern(pattern_kind, n)
    check = Checker(n, pattern)
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.DEALER, hwm=4, rcvtimeo=1000)
    cpu, rounds, retries, version_errors = {w: 0.0 for w in WAYS}, dict.fromkeys(WAYS, 0), 0, 0
    try:
        sock.connect(endpoint)
        sock.send(HDR.pack(0, OP_HELLO, i, 0, 0, 0))
        timed_way, t_prev, silent_since = None, 0.0, time.monotonic()
        while True:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if os.getppid() != leaf_pid or time.monotonic() - silent_since > TIMEOUT_S:
                    return 1  # the leaf is gone
                continue
            silent_since, t = time.monotonic(), time.process_time()
            if timed_way is not None:  # CPU since the last round began, all threads
                cpu[timed_way] += t - t_prev
                rounds[timed_way] += 1
            t_prev = t
            way, op, timed, slot, rnd, version = HDR.unpack(frames[0].bytes)
            if op == OP_STOP:
                sock.send(
                    json.dumps(
                        {
                            "learner": i,
                            "check_errors": check.errors,
                            "version_errors": version_errors,
                            "retries": retries,
                            "cpu_s": cpu,
                            "rounds": rounds,
                        }
                    ).encode()
                )
                sock.poll(1000, zmq.POLLOUT)
                return 0
            if WAYS[way] == "ipc":
                off = 0
                for part in frames[1:]:
                    a = np.frombuffer(part.buffer, np.float32)
                    kernels.copy_into(params[off : off + a.shape[0]], a)
                    off += a.shape[0]
                if off != n:
                    raise RuntimeError(f"learner {i}: weights of {off:,} floats, expected {n:,}")
            else:
                got, r = lock.read_into(params)
                retries += r
                version_errors += got != version
            check(params, weight_value(rnd))
            g = private[slot] if WAYS[way] == "ipc" else slots[slot]
            write(g, grad_value(i, rnd), pattern)
            hdr = HDR.pack(way, OP_ROUND, i, slot, rnd, 0)
            if WAYS[way] == "ipc":
                sock.send_multipart([hdr, *wire.chunk(g, chunk_bytes)], copy=False)
            else:
                sock.send(hdr)
            timed_way = WAYS[way] if timed else None
    finally:
        sock.close(linger=0)
        ctx.term()
        wseg.close()
        gseg.close()


# ----------------------------------------------------------------------------- leaf
class Leaf:
    """The leaf side of one case (n parameters, k learners): segments, socket, processes.

    ``round(way, rnd, timed)`` runs one exchange round and returns its seconds. Use as a
    context manager: leaving it stops the learners and frees everything, on every path.
    """

    def __init__(self, n, k, args, ctx):
        self.n, self.k, self.args = n, k, args
        self.segs, self.procs, self.sock, self.tmp = [], [], None, None
        self.chunk_bytes = int(args.chunk_mib * 2**20)
        self.pattern = make_pattern(args.pattern, n)
        self.check = Checker(n, self.pattern)
        self.acc = np.zeros(n, np.float32)
        self.pool = [np.empty(n, np.float32) for _ in (0, 1)]  # weights "from the parent"
        for r, w in enumerate(self.pool):
            write(w, weight_value(r), self.pattern)
        self.pool_chunks = [wire.chunk(w, self.chunk_bytes) for w in self.pool]
        self.ctx = ctx

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self):
        n, k, base = self.n, self.k, f"{PREFIX}_{os.getpid()}_{self.n}_{self.k}"
        self.tmp = tempfile.mkdtemp(prefix="shm_leaf_")
        self.wseg = Segment(f"{base}_w", VERSION_BYTES + 4 * n, create=True)
        self.segs.append(self.wseg)
        for i in range(k):
            self.segs.append(Segment(f"{base}_g{i}", 2 * 4 * n, create=True))
        for s in self.segs:  # touch every page now, not in a round
            s.array(np.uint8, s.nbytes, 0).fill(0)
        self.lock = Seqlock(self.wseg, n)
        self.slots = [[s.array(np.float32, n, j * 4 * n) for j in (0, 1)] for s in self.segs[1:]]
        self.sock = transport.make_socket(self.ctx, zmq.ROUTER, hwm=4 * k)
        self.endpoint = transport.bind(self.sock, f"ipc://{self.tmp}/leaf.sock")
        spawn = mp.get_context("spawn")
        for i in range(k):
            p = spawn.Process(
                target=learner_main,
                daemon=True,
                name=f"learner {i}",
                args=(
                    i,
                    n,
                    self.endpoint,
                    self.wseg.path.rsplit("/", 1)[1],
                    self.segs[1 + i].path.rsplit("/", 1)[1],
                    self.chunk_bytes,
                    self.args.pattern,
                    os.getpid(),
                ),
            )
            p.start()
            self.procs.append(p)
        self.idents = [None] * k
        for _ in range(k):
            ident, hdr = self._recv()[:2]
            self.idents[HDR.unpack(hdr.bytes)[2]] = ident.bytes
        for s in self.segs:  # every learner has them mapped: no name left to leak
            s.unlink()

    def _recv(self):
        """The next message; raises naming a learner that died, or after TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while not self.sock.poll(500):
            dead = [f"{p.name} (exit code {p.exitcode})" for p in self.procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} stopped during the benchmark")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no learner answered for {TIMEOUT_S:.0f} s")
        return self.sock.recv_multipart(copy=False)

    def round(self, way: str, rnd: int, timed: bool) -> float:
        w, slot = WAYS.index(way), rnd % 2
        t0 = time.perf_counter()
        if way == "ipc":
            hdr = HDR.pack(w, OP_ROUND, timed, slot, rnd, 0)
            for ident in self.idents:
                self.sock.send_multipart([ident, hdr, *self.pool_chunks[slot]], copy=False)
        else:
            version = self.lock.publish(self.pool[slot])
            hdr = HDR.pack(w, OP_ROUND, timed, slot, rnd, version)
            for ident in self.idents:
                self.sock.send_multipart([ident, hdr])
        for got in range(self.k):
            frames = self._recv()
            _, _, i, gslot, grnd, _ = HDR.unpack(frames[1].bytes)
            if grnd != rnd or gslot != slot:
                raise RuntimeError(
                    f"learner {i} answered round {grnd} slot {gslot}, "
                    f"expected round {rnd} slot {slot}"
                )
            parts = (
                [np.frombuffer(f.buffer, np.float32) for f in frames[2:]]
                if way == "ipc"
                else [self.slots[i][gslot]]
            )
            off = 0
            for part in parts:
                m = part.shape[0]
                (kernels.accumulate if got else kernels.copy_into)(self.acc[off : off + m], part)
                off += m
            if off != self.n:
                raise RuntimeError(f"learner {i} sent {off:,} floats, expected {self.n:,}")
        dt = time.perf_counter() - t0
        self.check(self.acc, sum(grad_value(i, rnd) for i in range(self.k)), mult=self.k)
        return dt

    def stop(self) -> list[dict]:
        """STOP every learner; returns their reports."""
        for ident in self.idents:
            self.sock.send_multipart([ident, HDR.pack(0, OP_STOP, 0, 0, 0, 0)])
        reports = [json.loads(self._recv()[1].bytes) for _ in range(self.k)]
        for p in self.procs:
            p.join(10)
        return sorted(reports, key=lambda r: r["learner"])

    def __exit__(self, *exc):
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.sock is not None:
            self.sock.close(linger=0)
        for s in self.segs:
            s.close()
        if self.tmp is not None:
            try:
                os.unlink(os.path.join(self.tmp, "leaf.sock"))
            except OSError:
                pass
            os.rmdir(self.tmp)
        return False
