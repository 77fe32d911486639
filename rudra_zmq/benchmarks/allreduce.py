"""``rudra-zmq bench allreduce``: what users would pick instead, beside the PS's hardsync step.

``torch.distributed`` with the gloo backend: P processes (one torch thread each) allreduce (sum)
a float32 tensor of n elements; figures as nccl-tests reports them: time per allreduce (the
slowest rank's average over a timed run; min / median / max over ``--repeat`` runs, and p50/p99
of single calls on rank 0), ``algbw`` = bytes / time and ``busbw`` = algbw x 2(P-1)/P (the
bytes each rank's link must carry in a ring allreduce: comparable across P). Beside it, the
same tensor through the parameter server (``bench pushpull``'s machinery): λ = P clients in
hardsync, each PUSHPULL one gradient of n floats and receiving the updated weights (the PS
holds each reply until its update), which is one synchronous data-parallel step (the PS also
applies momentum SGD; allreduce only sums). ``gloo/PS`` > 1 means the PS step is faster. Each
size runs gloo, then the PS, so both see the same load; every process calls
``transport.tune_malloc()``.

    rudra-zmq bench allreduce --nprocs 4 --sizes 1M 10M
    # two hosts, 2 ranks each; rank 0 and the printed figures on host-a; the PS comparison
    # against a `bench pushpull --bind` side (here on host-c) is optional:
    host-a$ rudra-zmq bench allreduce --bind tcp://0.0.0.0:29500 --nprocs 4 --local-procs 2 \\
                --ps tcp://host-c:5555
    host-b$ rudra-zmq bench allreduce --connect tcp://host-a:29500 --nprocs 4 --local-procs 2 \\
                --rank-base 2
    (gloo picks a network interface by hostname; set GLOO_SOCKET_IFNAME=eth0 if it picks lo)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import zmq

from .. import transport
from . import common, pushpull, pushpull_client, pushpull_server, sides


def _rank_process(conn, rank: int, world: int, init: str, args: dict) -> None:
    """One gloo rank: for each ("run", n) from the driver, time allreduces of n floats."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    sides.exit_with_parent()
    transport.tune_malloc()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=sides.CONTROL_TIMEOUT_S),
    )
    try:
        while True:
            cmd, n = conn.recv()
            if cmd == "quit":
                break
            t = torch.ones(n, dtype=torch.float32)
            dist.all_reduce(t)
            if t[0].item() != world or t[-1].item() != world:
                raise RuntimeError(f"allreduce of ones gave {t[0].item()}, expected {world}")
            t.zero_()  # keep the values finite while timing
            # Collectives must match call for call on every rank: rank 0 times, decides the
            # warm-up and the timed count, and broadcasts them.
            count = 3
            for seconds in (args["warmup"], args["seconds"]):
                t0 = time.perf_counter()
                for _ in range(count):
                    dist.all_reduce(t)
                per = (time.perf_counter() - t0) / count
                c = torch.tensor([common.calibrate(per, seconds, lo=3, hi=200_000)])
                dist.broadcast(c, 0)
                count = int(c.item())
            samples, averages = [], []
            perf = time.perf_counter
            for _ in range(args["repeat"]):
                dist.barrier()
                t0 = perf()
                for _ in range(count):
                    a = perf()
                    dist.all_reduce(t)
                    samples.append(perf() - a)
                el = torch.tensor([perf() - t0], dtype=torch.float64)
                dist.all_reduce(el, op=dist.ReduceOp.MAX)  # the slowest rank's time
                averages.append(el.item() / count)
            conn.send({"count": count, "averages": averages, "samples": samples})
    finally:
        dist.destroy_process_group()


class Ranks:
    """This host's gloo ranks [base, base + local) of ``world``; ``run(n)`` times one size."""

    def __init__(self, world: int, local: int, base: int, init: str, args):
        spawn = mp.get_context("spawn")
        opts = {"seconds": args.seconds, "warmup": args.warmup, "repeat": args.repeat}
        self.pipes, self.procs = [], []
        for rank in range(base, base + local):
            parent, child = spawn.Pipe()
            proc = spawn.Process(
                target=_rank_process,
                args=(child, rank, world, init, opts),
                daemon=True,
                name=f"gloo-rank-{rank}",
            )
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def run(self, n: int) -> dict:
        for p in self.pipes:
            p.send(("run", n))
        out = []
        for p, proc in zip(self.pipes, self.procs):
            while not p.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")
            out.append(p.recv())
        return out[0]

    def close(self) -> None:
        for p in self.pipes:
            try:
                p.send(("quit", 0))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _ps_args(args) -> argparse.Namespace:
    return argparse.Namespace(
        protocol="hardsync",
        learners=args.nprocs,
        softsync_n=1,
        ps_threads=args.ps_threads,
        io_threads=args.io_threads,
        chunk_mib=args.chunk_mib,
        arch="base",
        fanout=2,
        depth=1,
        connect=args.ps,
        seconds=args.seconds,
        warmup=args.warmup,
        repeat=args.repeat,
    )


def case(n: int, world: int, gloo: dict, ps: dict | None) -> dict:
    size = 4 * n
    lo, med, hi = common.mmm(gloo["averages"])
    single = common.summary([s * 1e6 for s in gloo["samples"]])
    algbw = size / med / 1e9
    r = {
        "bench": "allreduce",
        "label": f"gloo P={world}",
        "nprocs": world,
        "params": n,
        "size": size,
        "count": gloo["count"],
        "bytes": size * gloo["count"],
        "time_us": med * 1e6,
        "time_min_us": lo * 1e6,
        "time_max_us": hi * 1e6,
        "p50_us": single["p50"],
        "p99_us": single["p99"],
        "algbw_gbs": algbw,
        "busbw_gbs": algbw * 2 * (world - 1) / world,
    }
    if ps is not None:
        r.update(
            ps_step_us=ps["ps_mean_us"],
            ps_step_p50_us=ps["ps_p50_us"],
            ps_step_p99_us=ps["ps_p99_us"],
            ps_algbw_gbs=size / (ps["ps_mean_us"] * 1e-6) / 1e9,
            ps_goodput_gbps=ps["ps_gbps"],
            ps_steps=ps["ps_ops"] // world,
            raw_star_us=ps["raw_mean_us"],
            gloo_over_raw_star=med * 1e6 / ps["raw_mean_us"],
            gloo_over_ps=med * 1e6 / ps["ps_mean_us"],
        )
    return r


def line(r: dict) -> str:
    text = (
        f"allreduce P={r['nprocs']} n={common.fmt_count(r['params']):>7} "
        f"({common.fmt_bytes(r['size']):>10})  gloo {r['time_us']:9.1f} µs "
        f"[{r['time_min_us']:.1f}-{r['time_max_us']:.1f}] p50 {r['p50_us']:9.1f} p99 "
        f"{r['p99_us']:9.1f}  algbw {r['algbw_gbs']:6.3f} busbw {r['busbw_gbs']:6.3f} GB/s "
        f"count {r['count']}"
    )
    if "ps_step_us" in r:
        text += (
            f" | PS hardsync step {r['ps_step_us']:9.1f} µs p50 {r['ps_step_p50_us']:9.1f} "
            f"p99 {r['ps_step_p99_us']:9.1f} algbw {r['ps_algbw_gbs']:6.3f} GB/s | "
            f"gloo/PS {r['gloo_over_ps']:.2f}x | raw star {r['raw_star_us']:9.1f} µs "
            f"gloo/raw star {r['gloo_over_raw_star']:.2f}x"
        )
    return text


def add_arguments(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--bind",
        metavar="EP",
        help="host rank 0 and the rendezvous here (tcp://0.0.0.0:29500) and print the figures",
    )
    g.add_argument("--connect", metavar="EP", help="join the ranks of a `--bind` side at EP")
    p.add_argument("--nprocs", "-n", type=int, default=4, help="P: processes in all (= λ)")
    p.add_argument("--local-procs", type=int, help="ranks on this host (default: all P)")
    p.add_argument("--rank-base", type=int, default=0, help="--connect: first rank here")
    p.add_argument(
        "--ps",
        metavar="EP",
        help="the PS comparison against a `bench pushpull "
        "--bind` side at EP (default: one on this machine, unless --bind/--connect)",
    )
    p.add_argument("--no-ps", action="store_true", help="gloo only")
    p.add_argument("--ps-threads", type=int, default=1, help="PS kernel threads (default 1)")
    p.add_argument("--chunk-mib", type=int, default=8, help="PS runtime.chunk_mib")
    p.add_argument("--io-threads", type=int, default=1, help="ZeroMQ I/O threads of the PS")
    common.add_size_args(p, "1M", "10M", 10, "tensor size in float32 elements")
    common.add_timing_args(p)
    common.add_output_args(p)


def run(args) -> int:
    world = args.nprocs
    local = args.local_procs or world
    if world < 2 or not 1 <= local <= world:
        raise ValueError(
            f"need --nprocs >= 2 and 1 <= --local-procs <= --nprocs, got {world} and {local}"
        )
    sizes = common.sizes_from_args(args)
    if args.connect:
        host_port = args.connect.split("://", 1)[-1]
        ranks = Ranks(world, local, args.rank_base, f"tcp://{host_port}", args)
        try:
            for n in sizes:
                ranks.run(n)
        finally:
            ranks.close()
        return 0
    port = (args.bind or transport.free_tcp_endpoint()).rsplit(":", 1)[1]
    with_ps = not args.no_ps and (args.ps or not args.bind)
    transport.tune_malloc()
    report = common.Report(
        args,
        "bench allreduce (torch.distributed gloo vs PS hardsync step)",
        notes=[
            "time = slowest rank's mean per allreduce (min-max over repeats); p50/p99 of single "
            "calls on rank 0; algbw = bytes/time, busbw = algbw x 2(P-1)/P (nccl-tests); GB = 1e9 B",
            "PS hardsync step = wall time / steps (p50/p99 of single PUSHPULL calls), "
            "λ = P; gloo/PS = mean time ratio, > 1: the PS step is faster",
            "raw star = the same P clients each sending N bytes to one raw ZeroMQ server and "
            "receiving N bytes back (the PS's traffic with no PS work), mean per round trip",
        ],
        plot=(
            "size",
            [("busbw_gbs", "busbw (GB/s)"), ("time_us", "time per allreduce (µs)")],
            "label",
        ),
        torch=_torch_version(),
    )
    ranks = Ranks(world, local, 0, f"tcp://127.0.0.1:{port}", args)
    ctx = zmq.Context()
    peers = clients = None
    try:
        if with_ps:
            peers = sides.Sides(ctx, "pushpull", args.ps, pushpull_server.handlers)
            clients = pushpull_client.Clients(world)
        for n in sizes:
            gloo = ranks.run(n)
            ps = None
            if with_ps:
                ps = pushpull.run_case(peers.control("tcp"), clients, n, "pushpull", _ps_args(args))
            r = case(n, world, gloo, ps)
            report.case(r, line(r))
    finally:
        ranks.close()
        if clients is not None:
            clients.close()
        if peers is not None:
            peers.close()
        ctx.destroy(linger=0)  # closes what an error left open, never hangs
    report.close()
    return 0


def _torch_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"
