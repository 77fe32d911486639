"""What a user would run instead, on the same emulated hosts: PyTorch's ring allreduce (gloo).

``lan-table1``'s ``gloo-allreduce`` case: one process per learner (``torch.distributed``, gloo,
one torch thread, ``GLOO_SOCKET_IFNAME=eth0``: the host's link) on the learners' hosts. Each
step is what DDP does with the same synthetic compute: sleep COMPUTE_MS ±10 %, then average
a PARAMS-float32 gradient across the ranks (divide by λ, ``all_reduce`` sum). With
``float16`` it is what DDP's ``fp16_compress_hook`` does instead: cast to float16, divide,
all_reduce, cast back (without DDP's module wrapper: the traffic and the casts only). An
"epoch" is EPOCH_GRADIENTS / λ steps (λ gradients a step), timed on rank 0.

    ip netns exec HOST python -m rudra_zmq.benchmarks.lan_allreduce rank --rank R --world N \\
        --master ADDR:PORT --params 10M --steps 24 --compute-ms 100 --report OUT.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

from .. import timeline
from . import synthetic_cluster as sc

MODULE = "rudra_zmq.benchmarks.lan_allreduce"
PORT = 29517  # rank 0's rendezvous port on its host


def _rank(a) -> None:
    """One rank: rendezvous, then ``steps`` steps of compute + allreduce. Blocks; writes the
    report (rank 0: each step's end, seconds after the first step's start)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(seconds=a.timeout_s),
    )
    grad = torch.full((a.params,), 1e-3, dtype=torch.float32)
    rng = random.Random(a.rank)
    dist.barrier()
    tl = timeline.start_from_env(f"rank{a.rank}")
    t0, t0_unix = time.perf_counter(), time.time()
    ends = []
    for _ in range(a.steps):
        c0 = timeline.now_us()
        time.sleep(a.compute_ms / 1000 * rng.uniform(0.9, 1.1))
        c1 = timeline.now_us()
        if a.dtype == "float16":  # fp16_compress_hook: cast, divide, allreduce, cast back
            half = grad.to(torch.float16).div_(a.world)
            dist.all_reduce(half)
            grad.copy_(half)
        else:  # DDP's default: divide, allreduce
            grad.div_(a.world)
            dist.all_reduce(grad)
        ends.append(time.perf_counter() - t0)
        tl.complete("compute", c0, c1)
        tl.complete("allreduce", c1, timeline.now_us(), "wire")
    dist.barrier()
    dist.destroy_process_group()
    timeline.stop()
    with open(a.report, "w") as f:
        json.dump({"rank": a.rank, "step_ends": ends, "t0_unix": t0_unix}, f)


def run(hosts, per_host: int, params: int, steps: int, compute_ms: float, dtype, workdir,
        timeline: str | None = None):  # fmt: skip
    """Run λ = len(hosts) x ``per_host`` ranks, rank 0 on ``hosts[0]``; returns rank 0's
    report: ``step_ends`` (seconds from the first step's start) and ``t0_unix`` (that start).
    ``timeline``: each rank records its part of it. Blocks; stops every rank on error."""
    world = len(hosts) * per_host
    procs = sc.Processes(workdir, {sc.TIMELINE_ENV: timeline} if timeline else None)
    try:
        for r in range(world):
            host = hosts[r // per_host]
            args = [
                *("--rank", str(r), "--world", str(world)),
                *("--master", f"{hosts[0].addr}:{PORT}", "--params", str(params)),
                *("--steps", str(steps), "--compute-ms", str(compute_ms), "--dtype", dtype),
            ]
            env = {"GLOO_SOCKET_IFNAME": "eth0"} if host.ns else {}
            procs.start(f"rank{r}", "rank", args, host, module=MODULE, env=env)
        reports = procs.wait(timeout_s=600)
    finally:
        procs.close()
    return reports["rank0"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=MODULE)
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("rank")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--master", required=True, help="rank 0's ADDR:PORT")
    r.add_argument("--params", type=int, required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--compute-ms", type=float, default=100.0)
    r.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    r.add_argument("--timeout-s", type=float, default=120.0)
    r.add_argument("--report", required=True)
    _rank(p.parse_args(argv))


if __name__ == "__main__":
    main()
