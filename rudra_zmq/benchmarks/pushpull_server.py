"""The passive side of ``rudra-zmq bench pushpull``: the PS (and tree), echo and raw servers.

Per case the agent (:mod:`.sides`) starts, each in a spawned process on its host:

- **ps**: a real :class:`~rudra_zmq.server.ps.ParameterServer` with a synthetic model of n float32
  parameters (no torch), under a tree of :class:`~rudra_zmq.tree.node.TreeNode` processes
  with ``--arch adv``;
- **echo**: the PS's protocol without the PS: one ROUTER that decodes every request with
  ``wire.decode`` and answers it with ``wire.encode`` in the PS's messages (WELCOME, ACK,
  WEIGHTS from one preallocated array), with no update, no barrier and no copy. PS - echo is
  the PS's own work, echo - raw the protocol's cost;
- **raw**: a ROUTER answering each request with the bytes it asks for (the baseline; kept
  between cases of the same ``--io-threads``).

It also answers ``counters``: the PS's update count and the CPU seconds and minor page faults
of a target's server processes so far (from /proc, so the agent must share their host).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import threading

import numpy as np
import zmq

from .. import transport, wire
from ..wire import Kind
from . import sides

SIGNATURE = "bench-synthetic"
# raw request header: reply bytes, reply frame bytes, 0. 17 bytes: never the length of a
# float32 payload frame, so a request without one (the push+pull trip) is told apart.
RAW_HDR = struct.Struct("<QQB")


def ps_overrides(req: dict) -> list[str]:
    """Config overrides of the benchmark PS: the requested protocol, λ, threads and frames;
    momentum SGD; an epoch so long that training never ends; no evaluation."""
    out = [
        f"sync.protocol={req['protocol']}",
        f"sync.learners={req['learners']}",
        "sync.batch_size=1",
        "optimizer.lr=1.0e-6",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=0.0005",
        "train.epochs=1.0e+15",
        "train.eval_every_epochs=0",
        "train.eval_every_updates=0",
        "data.dataset=synthetic",
        "data.synthetic_train=1000000000",
        f"runtime.ps_threads={req['ps_threads']}",
        f"runtime.chunk_mib={req['chunk_mib']}",
        "runtime.timeout_s=3600",
        f"architecture.kind={req['arch']}",
        f"architecture.fanout={req['fanout']}",
        f"architecture.depth={req['depth']}",
        f"sync.n={req['softsync_n']}",
    ]  # (read by softsync only)
    return out


def initial_weights(n: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(n, dtype=np.float32) * 0.01


# ----------------------------------------------------------------------------- processes
def _ps_process(conn, stop, bind, n, overrides, ps_threads, io_threads):
    """The PS; a thread answers each message on ``conn`` with the engine's update count."""
    from .. import kernels
    from ..config import load_config
    from ..server.ps import ParameterServer

    sides.exit_with_parent()
    transport.tune_malloc()
    kernels.set_num_threads(ps_threads)
    ctx = zmq.Context(io_threads=io_threads)
    ps = ParameterServer(
        load_config(None, overrides),
        bind,
        ctx=ctx,
        model=(initial_weights(n), [(0, n, 1.0, 1.0)], SIGNATURE),
    )
    conn.send(ps.endpoint)
    engine = ps.state.engine

    def answer_updates():
        while True:
            conn.recv()
            conn.send(engine.updates)  # an int read: safe beside the serving thread

    threading.Thread(target=answer_updates, daemon=True, name="updates").start()
    ps.serve_forever(stop_event=stop)


def _node_process(conn, stop, node_id, bind, parent, overrides):
    from .. import kernels
    from ..config import load_config
    from ..tree.node import TreeNode

    sides.exit_with_parent()
    transport.tune_malloc()
    kernels.set_num_threads(1)  # as `rudra-zmq node` does
    node = TreeNode(load_config(None, overrides), node_id, bind, parent)
    conn.send(node.endpoint)
    node.serve_forever(stop_event=stop)


def _serve_router(conn, stop, bind: str, io_threads: int, answer) -> None:
    """Bind a ROUTER at ``bind``, send its endpoint on ``conn``, and reply to every request
    with ``answer(frames)`` (routing id first, as received) until ``stop``. Blocks; a helper
    process's whole life."""
    sides.exit_with_parent()
    transport.tune_malloc()
    ctx = zmq.Context(io_threads=io_threads)
    sock = transport.make_socket(ctx, zmq.ROUTER, hwm=64, rcvtimeo=100)  # 100 ms: see stop
    conn.send(transport.bind(sock, bind))
    try:
        while not stop.is_set():
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                continue
            sock.send_multipart([frames[0], *answer(frames)], copy=False)
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)


def raw_server(conn, stop, bind: str, io_threads: int = 1) -> None:
    """The raw baseline until ``stop``: a ROUTER answering a request ``[header, payload...]``
    with the bytes its header asks for and ``[payload...]`` with as many bytes, in frames of
    the requested size, zero-copy from buffers never written after allocation."""
    buffers, replies = [], {}

    def answer(frames):
        if len(frames[1]) == RAW_HDR.size:
            key = frames[1].bytes
            nbytes, frame, _ = RAW_HDR.unpack(key)
            head = [frames[1]]
        else:
            frame = len(frames[1])
            nbytes = frame if len(frames) == 2 else sum(len(f) for f in frames[1:])
            key, head = (nbytes, frame), []
        parts = replies.get(key)
        if parts is None:  # a new request shape: views of a fresh buffer
            buffers.append(np.ones(nbytes, np.uint8))
            parts = replies[key] = wire.chunk(buffers[-1], frame) if nbytes else []
        return [*head, *parts]

    _serve_router(conn, stop, bind, io_threads, answer)


def echo_server(
    conn,
    stop,
    bind: str,
    n: int,
    learners: int,
    protocol: str,
    chunk_bytes: int,
    io_threads: int = 1,
) -> None:
    """The PS's protocol with no PS, until ``stop``: decode, then WELCOME / ACK / WEIGHTS
    (every pull answered, never UPTODATE) from one preallocated array, chunked as the PS."""
    weights = wire.chunk(initial_weights(n), chunk_bytes)
    kinds = {Kind.HELLO, Kind.PUSH, Kind.PULL, Kind.PUSHPULL, Kind.BYE}
    state = {"ts": 0, "seq": 0}

    def answer(frames):
        msg = wire.decode(frames[1:], kinds=kinds, numel=n)
        state["seq"] += 1
        seq = state["seq"]
        if msg.kind == Kind.HELLO:
            return wire.encode(
                Kind.WELCOME,
                wire.SENDER_PS,
                seq,
                state["ts"],
                1,
                weights,
                learners=learners,
                protocol=protocol,
            )
        if msg.kind in (Kind.PUSH, Kind.BYE):
            state["ts"] += msg.kind == Kind.PUSH
            return wire.encode(Kind.ACK, wire.SENDER_PS, seq, state["ts"], 1, sigma=0)
        state["ts"] += msg.kind == Kind.PUSHPULL
        return wire.encode(Kind.WEIGHTS, wire.SENDER_PS, seq, state["ts"], 1, weights, sigma=0)

    _serve_router(conn, stop, bind, io_threads, answer)


def _start(target, *args, env=None):
    """Start ``target(conn, stop, *args)`` in a spawned process (``env`` added to its
    environment); blocks until it reports its endpoint. (process, stop, endpoint, conn)."""
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    stop = spawn.Event()
    proc = spawn.Process(target=target, args=(child, stop, *args), daemon=True)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # a spawned child inherits the environment at start()
    try:
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError(f"{target.__name__} did not start (exit code {proc.exitcode})")
    return proc, stop, parent.recv(), parent


def _stop(procs) -> None:
    """Ask every process to stop, then wait (killing any that stays over 10 s)."""
    for _proc, stop, *_ in procs:
        stop.set()
    for proc, *_ in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def proc_counters(pids) -> tuple[float, int]:
    """(CPU seconds, minor page faults) so far of the processes ``pids``, all threads, from
    /proc; processes that are gone count 0."""
    cpu, faults = 0.0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        faults += int(fields[7])
    return cpu, faults


# ----------------------------------------------------------------------------- agent handlers
def handlers(ctx: zmq.Context, agent: sides.Agent) -> dict:
    """ps: (re)start the PS (and tree) and the echo server for one case; counters; stop;
    _close (the agent exits)."""
    state = {"ps": [], "echo": [], "raw": None, "raw_io": None}

    def start_ps(req):
        _stop(state["ps"] + state["echo"])
        state["ps"], state["echo"] = [], []
        overrides = ps_overrides(req)
        ps = _start(
            _ps_process,
            agent.data_endpoint("tcp", slot=1),
            req["n"],
            overrides,
            req["ps_threads"],
            req["io_threads"],
            env=req.get("ps_env"),
        )
        state["ps"].append(ps)
        eps = [ps[2]] * req["learners"]
        if req["arch"] == "adv":
            from ..config import load_config
            from ..topology import plan

            tree = plan(load_config(None, overrides))
            where = {None: ps[2]}
            for node in sorted(tree.nodes, key=lambda nd: -nd.level):  # parents first
                p = _start(
                    _node_process,
                    node.id,
                    agent.data_endpoint("tcp", slot=4 + node.id),
                    where[node.parent],
                    overrides,
                )
                state["ps"].append(p)
                where[node.id] = p[2]
            eps = [where[tree.leaf_of(i).id] for i in range(req["learners"])]
        state["echo"] = [
            _start(
                echo_server,
                agent.data_endpoint("tcp", slot=3),
                req["n"],
                req["learners"],
                req["protocol"],
                req["chunk_mib"] << 20,
                req["io_threads"],
            )
        ]
        if state["raw"] is not None and state["raw_io"] != req["io_threads"]:
            _stop(state["raw"])
            state["raw"] = None
        if state["raw"] is None:
            state["raw"] = [
                _start(raw_server, agent.data_endpoint("tcp", slot=2), req["io_threads"])
            ]
            state["raw_io"] = req["io_threads"]
        return {"learners": eps, "echo": state["echo"][0][2], "raw": state["raw"][0][2]}

    def counters(req):
        target = req["target"]
        updates = 0
        if target == "ps":
            conn = state["ps"][0][3]
            conn.send(None)
            if not conn.poll(30):
                raise TimeoutError("the parameter server did not report its update count")
            updates = conn.recv()
        cpu, faults = proc_counters(p[0].pid for p in state[target] or ())
        return {"updates": updates, "cpu_s": cpu, "minflt": faults}

    def stop_ps(req):
        _stop(state["ps"] + state["echo"])
        state["ps"], state["echo"] = [], []
        return {}

    def close():
        _stop(state["ps"] + state["echo"] + (state["raw"] or []))

    return {"ps": start_ps, "counters": counters, "stop": stop_ps, "_close": close}
