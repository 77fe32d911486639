"""A raw-ZeroMQ probe of issue 24 item 2 on emulated LAN hosts: would a server answering each
part of its range as soon as it is complete pay? Outside rudra_zmq's protocol.

K servers on hosts of their own each own one slice of an M-float32 vector, cut into P parts.
Each learner (one per host), after a sleep ("compute"), sends every server its slice as P
messages, part-major (part 0 to every server, then part 1, ...), one DEALER per server. A
server sums each part as it comes and, once all L learners' part p is in, sends part p of its
weights to every learner at once, while later parts still arrive. A round ends when a
learner has every server's every part. P = 1 is today's hardsync round (every push, then every
reply); P > 1 overlaps the replies with the pushes. Ideal with servers on hosts of their own:
2·M/B (P = 1, all slices arriving together; one server's slices draining before another's
can beat it) and M/B·(1 + 1/P), plus the compute. Prints one
line per (K, P): the median round time at learner 0 over rounds 2 and later. Needs root
(``bench/lan/netns.sh``); results: bench/RESULTS.md.
"""

import json
import statistics
import struct
import subprocess
import sys
import time

import zmq

from .lan_link import parse_rate

HDR = struct.Struct("<iii")  # round, part, learner
PORT = 23000
ROLE = [sys.executable, "-m", "rudra_zmq.benchmarks.lan_overlap"]  # a server or learner


def _buffers(sock, a, sndbuf: int) -> None:
    """The kernel socket buffers asked for (``sndbuf``, ``--rcvbuf`` bytes; 0: the
    kernel's autotuning, ZeroMQ's default)."""
    if sndbuf:
        sock.setsockopt(zmq.SNDBUF, sndbuf)
    if a.rcvbuf:
        sock.setsockopt(zmq.RCVBUF, a.rcvbuf)


def server(a) -> None:
    """One server: sum each part, answer it once every learner's is in. Blocks."""
    import numpy as np

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    _buffers(sock, a, a.server_sndbuf)
    sock.bind(f"tcp://{a.addr}:{PORT}")
    n = a.numel // a.parts
    acc = np.zeros(n * a.parts, np.float32)
    weights = np.zeros(n * a.parts, np.float32)
    idents: dict[int, bytes] = {}
    counts: dict[tuple[int, int], int] = {}
    done = 0
    while done < a.rounds * a.parts:
        ident, hdr, payload = sock.recv_multipart(copy=False)
        rnd, part, learner = HDR.unpack(hdr.bytes)
        idents[learner] = ident.bytes
        g = np.frombuffer(payload.buffer, np.float32)
        acc[part * n : (part + 1) * n] += g
        key = (rnd, part)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] == a.learners:  # part complete: update it and answer it now
            weights[part * n : (part + 1) * n] -= 0.001 * acc[part * n : (part + 1) * n]
            acc[part * n : (part + 1) * n] = 0
            view = memoryview(weights[part * n : (part + 1) * n])
            for ident_b in idents.values():
                sock.send_multipart([ident_b, HDR.pack(rnd, part, -1), view], copy=False)
            del counts[key]
            done += 1
    time.sleep(1)  # let the last replies leave
    sock.close(linger=2000)
    ctx.term()


def learner(a) -> None:
    """One learner: ``rounds`` rounds of compute, P parts to every server, every reply; learner
    0 prints its round times. Blocks."""
    import numpy as np

    ctx = zmq.Context()
    socks = []
    for ep in a.connect.split(","):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        _buffers(s, a, a.sndbuf)
        s.connect(ep)
        socks.append(s)
    k = len(socks)
    n = a.numel // a.parts
    grads = np.ones(n * a.parts, np.float32)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    time.sleep(2.0)  # every connection up
    times = []
    while time.time() < a.start_at:
        time.sleep(0.01)
    for rnd in range(a.rounds):
        t0 = time.time()
        time.sleep(a.compute_ms / 1000)
        for part in range(a.parts):
            view = memoryview(grads[part * n : (part + 1) * n])
            for s in socks:
                s.send_multipart([HDR.pack(rnd, part, a.id), view], copy=False)
        got = 0
        while got < k * a.parts:
            for s, _ in poller.poll(60_000):
                while True:
                    try:
                        s.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    got += 1
        times.append(time.time() - t0)
    if a.id == 0:
        print(json.dumps({"round_s": times}), flush=True)
    for s in socks:
        s.close(linger=0)
    ctx.term()


def run(a) -> int:
    """Build the LAN, run every (K, P), remove the LAN (also on error or Ctrl-C); blocks.
    Exit code 2 where the LAN cannot be built."""
    from .lan_hosts import NETNS_SH, Lan, find_netns_sh, lan_available

    parse_rate(a.rate)
    netns_sh = a.netns_sh or find_netns_sh()
    why = lan_available() or (None if netns_sh else f"{NETNS_SH} not found (--netns-sh)")
    if why:
        print(f"lan-overlap: cannot build the emulated LAN: {why}", file=sys.stderr)
        return 2
    learners = a.learners
    with Lan(learners + max(a.servers), a.rate, netns_sh) as lan:
        hosts = [(h.ns, h.addr) for h in lan.hosts]
        for k in a.servers:
            for parts in a.parts:
                srv = hosts[learners : learners + k]
                numel = a.numel // (k * parts) * parts  # each slice splits into whole parts
                procs = []
                for ns, addr in srv:
                    procs.append(subprocess.Popen(
                        ["ip", "netns", "exec", ns, *ROLE, "server",
                         "--addr", addr, "--numel", str(numel), "--parts", str(parts),
                         "--learners", str(learners), "--rounds", str(a.rounds),
                         *_buffer_args(a)]))  # fmt: skip
                time.sleep(1.5)
                eps = ",".join(f"tcp://{addr}:{PORT}" for _, addr in srv)
                start_at = time.time() + 4
                outs = []
                for i, (ns, _addr) in enumerate(hosts[:learners]):
                    outs.append(subprocess.Popen(
                        ["ip", "netns", "exec", ns, *ROLE, "learner",
                         "--id", str(i), "--connect", eps, "--numel", str(numel), "--parts",
                         str(parts), "--rounds", str(a.rounds), "--compute-ms",
                         str(a.compute_ms), "--start-at", str(start_at), *_buffer_args(a)],
                        stdout=subprocess.PIPE, text=True))  # fmt: skip
                rec = json.loads(outs[0].communicate(timeout=600)[0])
                for p in outs + procs:
                    p.wait(timeout=60)
                timed = rec["round_s"][1:] or rec["round_s"]
                m = k * numel * 4 / parse_rate(a.rate)  # seconds of the whole vector
                ideal = (2 * m if parts == 1 else m * (1 + 1 / parts)) + a.compute_ms / 1000
                print(json.dumps({"servers": k, "parts": parts, "numel": k * numel,
                                  "median_round_s": statistics.median(timed),
                                  "rounds_s": [round(t, 3) for t in rec["round_s"]],
                                  "ideal_s": round(ideal, 3)}), flush=True)  # fmt: skip
    return 0


def _buffer_args(a) -> list[str]:
    server = a.sndbuf if a.server_sndbuf is None else a.server_sndbuf
    return ["--sndbuf", str(a.sndbuf), "--server-sndbuf", str(server), "--rcvbuf", str(a.rcvbuf)]


def add_arguments(p) -> None:
    """``rudra-zmq bench lan-overlap``'s options."""
    p.add_argument("--learners", type=int, default=8, help="learner hosts (default 8)")
    p.add_argument("--servers", type=int, nargs="+", default=[8], help="K (default 8)")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 4, 16], help="P (1 4 16)")
    p.add_argument("--numel", type=int, default=10_000_000, help="M (default 10,000,000)")
    p.add_argument("--rounds", type=int, default=6, help="the first is a warm-up (6)")
    p.add_argument("--compute-ms", type=float, default=100, help="default 100")
    p.add_argument("--rate", default="1gbit", help="each host link's rate, both ways")
    p.add_argument("--netns-sh", metavar="PATH", help="the LAN script (bench/lan/netns.sh)")
    _buffer_options(p)


def _buffer_options(p) -> None:
    for opt in ("sndbuf", "rcvbuf"):
        p.add_argument(f"--{opt}", type=int, default=0, help=f"ZeroMQ's {opt.upper()} in bytes "
                       "on every socket (default 0: the kernel's autotuning)")  # fmt: skip
    p.add_argument("--server-sndbuf", type=int, help="the servers' SNDBUF (default: --sndbuf)")


def main() -> None:
    """A server or a learner of one (K, P), started inside its host by :func:`run`."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server")
    s.add_argument("--addr", required=True)
    for q in (s, sub.add_parser("learner")):
        _buffer_options(q)
        q.add_argument("--numel", type=int, required=True)
        q.add_argument("--parts", type=int, required=True)
        q.add_argument("--rounds", type=int, required=True)
    s.add_argument("--learners", type=int, required=True)
    le = sub.choices["learner"]
    le.add_argument("--id", type=int, required=True)
    le.add_argument("--connect", required=True)
    le.add_argument("--compute-ms", type=float, required=True)
    le.add_argument("--start-at", type=float, required=True)
    a = p.parse_args()
    {"server": server, "learner": learner}[a.mode](a)


if __name__ == "__main__":
    main()
