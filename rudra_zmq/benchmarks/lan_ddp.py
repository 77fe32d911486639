"""Real ``DistributedDataParallel`` on the emulated LAN: what a user would run instead of a
parameter server, on the same hosts and the same model.

``lan-table1``'s ``ddp`` case: one process per learner (gloo, one torch thread,
``GLOO_SOCKET_IFNAME=eth0``) on the learners' hosts, each training
:class:`~.synthetic_model.SleepModel` (PARAMS parameters in LAYERS layers whose forward and
backward sleep: the compute is COMPUTE_MS, a third forward and two thirds backward) wrapped in
``torch.nn.parallel.DistributedDataParallel`` with its defaults (buckets of 25 MiB, the first
1 MiB; the first step in one bucket, then rebuilt in the order backward produced the
gradients): its reducer allreduces each bucket as backward completes it, overlapping the
traffic with the rest of backward. (Passing ``bucket_cap_mb=25`` is not the same: in torch
2.14 an explicit cap also sets the first bucket's, and 20 layers of 2 MB then fill 2 buckets,
the first only when 14 layers are done.) A step is forward, backward, then momentum SGD
(``torch.optim.SGD``, foreach). With ``float16`` DDP runs its
``default_hooks.fp16_compress_hook`` (each bucket cast to float16, allreduced, cast back).
An "epoch" is EPOCH_GRADIENTS / λ steps, timed on rank 0.

The timeline (``RUDRA_TIMELINE``) gets each step's forward, backward and optimizer spans and
each bucket's allreduce, from the hook handing it to gloo to its result.

    ip netns exec HOST python -m rudra_zmq.benchmarks.lan_ddp rank --rank R --world N \\
        --master ADDR:PORT --params 10M --layers 20 --steps 24 --compute-ms 1000 --report OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

from .. import timeline
from . import synthetic_cluster as sc

MODULE = "rudra_zmq.benchmarks.lan_ddp"
PORT = 29519  # rank 0's rendezvous port on its host
LAYERS = 20
FORWARD_SHARE = 1 / 3  # of the compute: forward; the rest is backward


def _timed_hook(hook):
    """DDP comm hook ``hook`` (``state, bucket -> Future``), marking each bucket's allreduce
    in the timeline as a span from its start to its result."""

    def timed(state, bucket):
        t0 = timeline.now_us()
        index, nbytes = bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size()
        fut = hook(state, bucket)

        def done(f):
            timeline.current().complete(
                "allreduce", t0, timeline.now_us(), "wire", bucket=index, bytes=nbytes
            )
            return f.value()

        return fut.then(done)

    return timed


def _rank(a) -> None:
    """One rank: rendezvous, then ``steps`` DDP steps. Blocks; writes the report (rank 0:
    each step's end, seconds after the first step's start, and that start's wall time)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from .synthetic_model import SleepModel

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}",
        rank=a.rank,
        world_size=a.world,
        timeout=timedelta(seconds=a.timeout_s),
    )
    model = SleepModel(
        10,
        a.params,
        a.layers,
        a.compute_ms * FORWARD_SHARE,
        a.compute_ms * (1 - FORWARD_SHARE),
    )
    ddp = DistributedDataParallel(model)  # its default buckets (module docstring)
    base = (
        default_hooks.fp16_compress_hook if a.dtype == "float16" else default_hooks.allreduce_hook
    )
    ddp.register_comm_hook(dist.group.WORLD, _timed_hook(base))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6, momentum=0.9, foreach=True)
    x, y = torch.randn(1, 3, 8, 8), torch.zeros(1, dtype=torch.long)
    loss_fn = torch.nn.CrossEntropyLoss()
    tl = timeline.start_from_env(f"rank{a.rank}")
    dist.barrier()
    t0, t0_unix = time.perf_counter(), time.time()
    ends = []
    for _ in range(a.steps):
        c0 = timeline.now_us()
        loss = loss_fn(ddp(x), y)
        c1 = timeline.now_us()
        loss.backward()  # returns once every bucket's allreduce is in
        c2 = timeline.now_us()
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter() - t0)
        tl.complete("forward", c0, c1)
        tl.complete("backward", c1, c2)
        tl.complete("optimizer", c2, timeline.now_us())
    dist.barrier()
    dist.destroy_process_group()
    timeline.stop()
    with open(a.report, "w") as f:
        json.dump({"rank": a.rank, "step_ends": ends, "t0_unix": t0_unix}, f)


def run(hosts, per_host: int, params: int, steps: int, compute_ms: float, dtype, workdir,
        timeline: str | None = None, layers: int = LAYERS):  # fmt: skip
    """Run λ = len(hosts) x ``per_host`` ranks, rank 0 on ``hosts[0]``; returns rank 0's
    report (``step_ends``, ``t0_unix``, as ``lan_allreduce.run``). Blocks; stops every rank
    on error."""
    world = len(hosts) * per_host
    procs = sc.Processes(workdir, {sc.TIMELINE_ENV: timeline} if timeline else None)
    try:
        for r in range(world):
            host = hosts[r // per_host]
            args = [
                *("--rank", str(r), "--world", str(world)),
                *("--master", f"{hosts[0].addr}:{PORT}", "--params", str(params)),
                *("--layers", str(layers), "--steps", str(steps)),
                *("--compute-ms", str(compute_ms), "--dtype", dtype),
            ]
            env = {"GLOO_SOCKET_IFNAME": "eth0"} if host.ns else {}
            procs.start(f"ddp{r}", "rank", args, host, module=MODULE, env=env)
        reports = procs.wait(timeout_s=max(600.0, 10 * steps * compute_ms / 1000))
    finally:
        procs.close()
    return reports["ddp0"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=MODULE)
    sub = p.add_subparsers(dest="role", required=True)
    r = sub.add_parser("rank")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--master", required=True, help="rank 0's ADDR:PORT")
    r.add_argument("--params", type=int, required=True)
    r.add_argument("--layers", type=int, default=LAYERS)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--compute-ms", type=float, default=1000.0)
    r.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    r.add_argument("--timeout-s", type=float, default=300.0)
    r.add_argument("--report", required=True)
    _rank(p.parse_args(argv))


if __name__ == "__main__":
    main()
