#!/usr/bin/env python3
"""Would push/pull overlap within a server pay on the emulated LAN? A raw-ZeroMQ probe of
issue 24 item 2, outside rudra_zmq's protocol: is the transport able to deliver it?

K servers each own one slice of an M-float32 vector, cut into P parts. Each learner, after a
sleep ("compute"), sends every server its slice as P messages, part-major (part 0 to every
server, then part 1, ...), each on one DEALER per server. A server sums each part as it comes
and, once all L learners' part p is in, sends part p of its weights to every learner at
once, while later parts still arrive. A round ends when a learner has every server's every
part. P = 1 is today's hardsync round (every push, then every reply); P > 1 overlaps the
replies with the pushes. Link bound with servers on hosts of their own: 2·M/B (P = 1) and
M/B·(1 + 1/P) (P > 1), plus the compute.

    python bench/lan/overlap_probe.py run --servers 8 --parts 1 4 16   (as root: builds the LAN)

Prints one JSON line per (servers, parts): the median round time over the timed rounds at
learner 0. Needs root and bench/lan/netns.sh.
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time

import numpy as np
import zmq

from rudra_zmq.benchmarks.lan_link import parse_rate

HERE = os.path.dirname(os.path.abspath(__file__))
HDR = struct.Struct("<iii")  # round, part, learner
PORT = 23000


def server(a) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
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
    ctx = zmq.Context()
    socks = []
    for ep in a.connect.split(","):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
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


def netns(*args) -> str:
    return subprocess.run(
        [os.path.join(HERE, "netns.sh"), *args], capture_output=True, text=True, check=True
    ).stdout


def run(a) -> None:
    learners, prefix = a.learners, "rzprobe"
    hosts = [ln.split()[2:4] for ln in netns("up", str(learners + max(a.servers)), a.rate,
                                             "--prefix", prefix).splitlines()]  # fmt: skip
    try:
        for k in a.servers:
            for parts in a.parts:
                srv = hosts[learners : learners + k]
                numel = a.numel // (k * parts) * parts  # each slice splits into whole parts
                procs = []
                for ns, addr in srv:
                    procs.append(subprocess.Popen(
                        ["ip", "netns", "exec", ns, sys.executable, __file__, "server",
                         "--addr", addr, "--numel", str(numel), "--parts", str(parts),
                         "--learners", str(learners), "--rounds", str(a.rounds)]))  # fmt: skip
                time.sleep(1.5)
                eps = ",".join(f"tcp://{addr}:{PORT}" for _, addr in srv)
                start_at = time.time() + 4
                outs = []
                for i, (ns, _addr) in enumerate(hosts[:learners]):
                    outs.append(subprocess.Popen(
                        ["ip", "netns", "exec", ns, sys.executable, __file__, "learner",
                         "--id", str(i), "--connect", eps, "--numel", str(numel), "--parts",
                         str(parts), "--rounds", str(a.rounds), "--compute-ms",
                         str(a.compute_ms), "--start-at", str(start_at)],
                        stdout=subprocess.PIPE, text=True))  # fmt: skip
                rec = json.loads(outs[0].communicate(timeout=600)[0])
                for p in outs + procs:
                    p.wait(timeout=60)
                timed = rec["round_s"][1:]
                m = k * numel * 4 / parse_rate(a.rate)  # seconds of the whole vector
                bound = (2 * m if parts == 1 else m * (1 + 1 / parts)) + a.compute_ms / 1000
                print(json.dumps({"servers": k, "parts": parts, "numel": k * numel,
                                  "median_round_s": statistics.median(timed),
                                  "rounds_s": [round(t, 3) for t in rec["round_s"]],
                                  "bound_s": round(bound, 3)}), flush=True)  # fmt: skip
    finally:
        netns("down", "--prefix", prefix)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--learners", type=int, default=8)
    r.add_argument("--servers", type=int, nargs="+", default=[8])
    r.add_argument("--parts", type=int, nargs="+", default=[1, 4, 16])
    r.add_argument("--numel", type=int, default=10_000_000)
    r.add_argument("--rounds", type=int, default=6)
    r.add_argument("--compute-ms", type=float, default=100)
    r.add_argument("--rate", default="1gbit")
    s = sub.add_parser("server")
    s.add_argument("--addr", required=True)
    for q in (s, sub.add_parser("learner")):
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
    {"run": run, "server": server, "learner": learner}[a.mode](a)


if __name__ == "__main__":
    main()
