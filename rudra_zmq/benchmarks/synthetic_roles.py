"""Torch-free roles for the Rudra-adv / adv* benchmarks (``bench root-ingress``, ``lan-table1``).

Three roles, each a process started as ``python -m rudra_zmq.benchmarks.synthetic_roles ROLE``
(by :mod:`.synthetic_cluster`, optionally inside a network namespace), all loading the same
config overrides (``--set``) so that they plan the same tree:

- ``ps``: the real :class:`~rudra_zmq.server.ps.ParameterServer` on a synthetic model of
  ``--params`` float32 parameters (``model=``, no torch), subclassed as :class:`CountingPS` to
  count what reaches the root's handler: every frame after the routing id, the gradient
  payloads of PUSH/PUSHPULL/RELAY, and the payloads it sends; one record per update.
- ``node``: the real :class:`~rudra_zmq.tree.node.TreeNode` (it never imports torch).
- ``learners``: :class:`~.synthetic_learner.SyntheticLearner` threads, one per ``--ids``
  entry: HELLO, then (after a start barrier, ``--go``) until STOP: "compute" (sleep
  ``--compute-ms``, ±10 % seeded jitter, standing in for forward and backward), PUSHPULL of a
  fixed gradient (zero-copy, as ``learner/learner.py``), and the copy of new weights into its
  own buffer (as its ``_load``). With ``architecture.kind: advstar`` it does what
  ``learner/learner.py`` does for Rudra-adv*: weights come by its
  :class:`~rudra_zmq.broadcast.member.BroadcastMember` (adopted between steps), gradients go to
  its leaf as PUSH without waiting for the reply (collected before the next push).

Servers print ``listening on ENDPOINT`` once bound (an advstar root first prints ``broadcast
on ENDPOINT``); every role writes a JSON report (its counters, ``ru_maxrss`` and CPU seconds)
to ``--report`` when it ends. Each role exits when its parent process is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

import numpy as np
import zmq

from .. import kernels, timeline, transport
from ..config import RuntimeConfig
from .synthetic_learner import SIGNATURE, SyntheticLearner

ARCHS = ("base", "adv", "advstar")


def overrides(
    arch: str,
    protocol: str,
    learners: int,
    epoch_gradients: int,
    *,
    epochs: int = 1,
    softsync_n: int = 1,
    fanout: int = 4,
    depth: int = 1,
    chunk_mib: int = 8,
    timeout_s: float = 120,
    relay: str = "eager",
    retry_s: float = RuntimeConfig.retry_s,
    wire_dtype: str = "float32",
    parts: int = 1,
    sndbuf_kib: int = 0,
    stripes: bool = True,
    priority: str | None = None,
) -> list[str]:
    """Config overrides shared by every role of one run: momentum SGD, µ = 1 and an epoch of
    ``epoch_gradients`` gradients (so the PS says STOP after ``epochs`` x that), no eval."""
    out = [
        f"sync.protocol={protocol}",
        f"sync.learners={learners}",
        "sync.batch_size=1",
        "optimizer.lr=1.0e-6",
        "optimizer.momentum=0.9",
        "optimizer.weight_decay=0.0005",
        f"train.epochs={epochs}",
        "train.eval_every_epochs=0",
        "train.eval_every_updates=0",
        "data.dataset=synthetic",
        f"data.synthetic_train={epoch_gradients}",
        "runtime.ps_threads=1",
        f"runtime.chunk_mib={chunk_mib}",
        f"runtime.timeout_s={timeout_s}",
        f"runtime.retry_s={retry_s}",
        f"architecture.kind={arch}",
        f"wire.gradient_dtype={wire_dtype}",  # gradients and weights alike
        f"wire.weights_dtype={wire_dtype}",
        f"wire.parts={parts}",
        f"runtime.sndbuf_kib={sndbuf_kib}",
        f"wire.stripes={str(stripes).lower()}",
    ]
    if priority is not None:  # "on" / "off"; None: the config's default
        out.append(f"wire.priority={str(priority == 'on').lower()}")
    if arch != "base":
        out += [
            f"architecture.fanout={fanout}",
            f"architecture.depth={depth}",
            f"architecture.relay={relay}",
        ]
    return [*out, f"sync.n={softsync_n}"]  # (read by softsync only)


def _usage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"maxrss_kib": ru.ru_maxrss, "cpu_s": ru.ru_utime + ru.ru_stime}


# ----------------------------------------------------------------------------- the root
def counting_ps_class():
    """:class:`CountingPS`, defined on first use so that importing this module stays light."""
    from ..server.ps import ParameterServer

    class CountingPS(ParameterServer):
        """A ParameterServer that counts the bytes reaching (and leaving) its handler.

        ``rx_bytes``: every frame of every message after the routing id (headers included);
        ``rx_grad_bytes``/``rx_grad_msgs``: gradient payloads of PUSH/PUSHPULL/RELAY and how
        many requests carried them (a gradient in parts, wire.parts, counts once); ``tx_bytes``: payloads it sends (WELCOME/WEIGHTS);
        ``bcast_bytes()``: what its Rudra-adv* broadcast root sent (advstar);
        ``log``: one row per update (see ``LOG_FIELDS``). Same threading rules as the base.
        """

        LOG_FIELDS = (
            "t",
            "grads",
            "rx_bytes",
            "rx_grad_bytes",
            "rx_grad_msgs",
            "tx_bytes",
            "n_grads",
            "mean_sigma",
            "bcast_bytes",
        )

        def __init__(self, *a, **kw):
            self.rx_bytes = self.rx_msgs = self.rx_grad_bytes = self.rx_grad_msgs = 0
            self.tx_bytes = 0
            self.log: list[tuple] = []
            self.t_first_grad = None
            super().__init__(*a, **kw)

        def handle(self, frames) -> None:
            self.rx_msgs += 1
            self.rx_bytes += sum(len(f) for f in frames[1:])
            super().handle(frames)

        def on_gradient(self, ident, msg) -> None:
            if timeline.current().enabled:
                nbytes = sum(p.nbytes for p in msg.payloads)
                at = msg.fields.get("at", 0)
                timeline.mark("recv", peer=f"learner {msg.sender}", kind=msg.kind.name,
                              bytes=nbytes, at=at, seq=msg.seq, ts=msg.ts)  # fmt: skip
            if self.t_first_grad is None:
                self.t_first_grad = time.time()
            self.rx_grad_msgs += not msg.fields.get("more")  # a gradient in parts: once
            self.rx_grad_bytes += sum(p.nbytes for p in msg.payloads)
            super().on_gradient(ident, msg)

        def send(self, ident, kind, payloads=(), **fields) -> None:
            self.tx_bytes += sum(p.nbytes for p in payloads)
            super().send(ident, kind, payloads, **fields)
            if timeline.current().enabled and payloads:
                peer = next((s for s, i in self.state.identities.items() if i == ident), "?")
                timeline.mark("send", peer=f"learner {peer}", kind=kind.name,
                              bytes=sum(p.nbytes for p in payloads), at=fields.get("at", 0),
                              ts=fields.get("ts", self.state.engine.timestamp))  # fmt: skip

        def _after_update(self, update) -> None:
            timeline.current().instant("update", "server", ts=update.timestamp)
            self.log.append(
                (
                    time.time(),
                    self.state.engine.gradients_received,
                    self.rx_bytes,
                    self.rx_grad_bytes,
                    self.rx_grad_msgs,
                    self.tx_bytes,
                    len(update.sigmas),
                    update.mean_sigma,
                    self.bcast_bytes(),
                )
            )
            super()._after_update(update)

        def bcast_bytes(self) -> int:
            """advstar: weight bytes the broadcast root sent so far (whole versions: chunks
            sent / chunks per version x model bytes; read from its I/O thread's counter)."""
            root = getattr(getattr(self, "weights_out", None), "root", None)
            fan = getattr(root, "_fan", None)
            if fan is None:
                return 0
            numel = self.state.numel
            per_version = -(-numel * 4 // self.state.chunk_bytes)
            return fan.sent_chunks * numel * 4 // per_version

        def report(self) -> dict:
            engine = self.state.engine
            return {
                "role": "ps",
                "numel": self.state.numel,
                "rx_bytes": self.rx_bytes,
                "rx_msgs": self.rx_msgs,
                "rx_grad_bytes": self.rx_grad_bytes,
                "rx_grad_msgs": self.rx_grad_msgs,
                "tx_bytes": self.tx_bytes,
                "updates": engine.updates,
                "grads": engine.gradients_received,
                "t_first_grad": self.t_first_grad,
                "invalid": self.state.counters.invalid,
                "undelivered": self.state.counters.undelivered,  # replies ZeroMQ refused
                "duplicates": self.state.counters.duplicates,  # gradients sent again
                "bcast_bytes": self.bcast_bytes(),
                "log_fields": list(self.LOG_FIELDS),
                "log": self.log,
                **_usage(),
            }

    return CountingPS


# ----------------------------------------------------------------------------- role mains
def _cfg(args):
    from ..config import load_config

    return load_config(None, args.set)


def main_ps(args) -> dict:
    transport.tune_malloc()
    kernels.set_num_threads(1)
    cfg = _cfg(args)
    if args.built_model:  # the configured model's own weights (the product learner's)
        model = None
    else:
        weights = np.random.default_rng(0).standard_normal(args.params, dtype=np.float32) * 0.01
        model = (weights, [(0, args.params, 1.0, 1.0)], SIGNATURE)
    extra = {"broadcast": args.bcast_bind} if args.bcast_bind else {}  # advstar only
    ps = counting_ps_class()(
        cfg,
        args.bind,
        model=model,
        server=args.shard,  # its range: the shape's (architecture.servers in --set)
        **extra,
    )
    if ps.weights_out.endpoint is not None:  # advstar: before "listening on"
        print(f"broadcast on {ps.weights_out.endpoint}", flush=True)
    if args.local_bind:  # for the learners of its own host (before "listening on")
        print(f"local on {transport.bind(ps.sock, args.local_bind)}", flush=True)
    print(f"listening on {ps.endpoint}", flush=True)
    ps.serve_forever()
    return ps.report()


def main_node(args) -> dict:
    from ..tree.node import TreeNode

    transport.tune_malloc()
    kernels.set_num_threads(1)  # as `rudra-zmq node` does
    node = TreeNode(_cfg(args), args.id, args.bind, args.parent, server=args.shard)
    print(f"listening on {node.endpoint}", flush=True)
    node.serve_forever()
    st = node.state
    return {
        "role": "node",
        "id": args.id,
        "relays": st.relays,
        "gradients": st.gradients,
        "invalid": st.invalid,
        **_usage(),
    }


def _wait_go(go: str, first: int, timeout_s: float, ids: str) -> None:
    """A start barrier across processes (and namespaces): the launcher's file."""
    open(go + f".ready{first}", "w").close()
    deadline = time.time() + timeout_s
    while not os.path.exists(go):
        if time.time() > deadline:
            raise TimeoutError(f"learners {ids}: no start signal {go} within {timeout_s:.0f} s")
        time.sleep(0.01)


def _run_threads(ids: list[int], work) -> list:
    """``work(k)`` for each learner ``ids[k]`` in a thread of its own; their results. Blocks;
    raises the first error."""
    results, errors = [None] * len(ids), []

    def one(k):
        try:
            results[k] = work(k)
        except BaseException as exc:  # re-raised by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=one, args=(k,), name=f"learner {i}", daemon=True)
        for k, i in enumerate(ids)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not errors:
        time.sleep(0.05)
    if errors:
        raise errors[0]
    return results


def product_learners(args, cfg, ids: list[int], eps: list[str]) -> dict:
    """The product's learner (``learner/learner.py``'s ``Learner``, its exchange and backward
    hooks) on the configured model (``model.name``: the synthetic model of sleeping layers,
    ``synthetic_model.write_module``), one thread each, its minibatches from a real
    ``DataServer`` in this process (inproc: no link traffic). ``Learner.run`` says HELLO
    after the start barrier and trains until STOP. Blocks; the report as ``main_learners``'."""
    import torch

    from ..data.server import DataServer
    from ..learner.learner import Learner
    from .synthetic_learner import channel_counts

    torch.set_num_threads(1)
    ctx, stop, bound = zmq.Context(), threading.Event(), threading.Event()
    data_ep = f"inproc://data-{ids[0]}"

    def serve_data():
        server = DataServer(cfg, data_ep, ctx)  # owned by this thread
        bound.set()
        server.serve_forever(stop)

    data = threading.Thread(target=serve_data, name="data server", daemon=True)
    data.start()
    if not bound.wait(60):
        raise RuntimeError(f"learners {args.ids}: the data server did not start")
    learners = [Learner(cfg, i, ep.split("+"), data_ep, None, ctx) for i, ep in zip(ids, eps)]
    if args.go:
        _wait_go(args.go, ids[0], cfg.runtime.timeout_s, args.ids)

    def work(k):
        learner, t0 = learners[k], time.time()
        learner.run()
        stream = learner.exchange.stream
        return {
            "learner": learner.id,
            "steps": learner.steps,
            "t_start": t0,
            "t_end": time.time(),
            "product": True,
            "sent_during_backward": stream.during if stream else 0,
            "sent_after_backward": stream.after if stream else None,
            # wire.priority: modules whose forward ran before the whole reply was in
            "layers_ahead": getattr(learner.exchange.early, "ran_ahead", None),
            **channel_counts(learner.ps.channels),
            "rejoins": learner.exchange.rejoins,
        }

    try:
        results = _run_threads(ids, work)
    finally:
        stop.set()
        data.join(5)
    ctx.destroy(linger=0)
    return {"role": "learners", "ids": ids, "learners": results, **_usage()}


def main_learners(args) -> dict:
    transport.tune_malloc()
    kernels.set_num_threads(1)
    cfg = _cfg(args)
    ids = [int(x) for x in args.ids.split(",")]
    eps = args.ps.split(",")
    if len(eps) not in (1, len(ids)):
        raise SystemExit(
            f"--ps names {len(eps)} endpoints for {len(ids)} learners: give one, or one per learner"
        )
    eps = eps * len(ids) if len(eps) == 1 else eps
    if args.product:
        return product_learners(args, cfg, ids, eps)
    ctx = zmq.Context()
    ups = args.bcast_up.split(",") if args.bcast_up else [None] * len(ids)
    binds = (
        [None if b == "none" else b for b in args.bcast_bind.split(",")]
        if args.bcast_bind
        else [None] * len(ids)
    )
    learners = [
        SyntheticLearner(
            ctx,
            cfg,
            i,
            ep,
            args.params,
            args.compute_ms / 1000,
            (up, bind),
            args.layers,
            args.push_after,
        )  # fmt: skip
        for i, ep, up, bind in zip(ids, eps, ups, binds)
    ]
    for learner in learners:
        learner.hello()
    if args.go:
        _wait_go(args.go, ids[0], cfg.runtime.timeout_s, args.ids)
    results = _run_threads(ids, lambda k: learners[k].run())
    ctx.destroy(linger=0)
    return {"role": "learners", "ids": ids, "learners": results, **_usage()}


def main(argv=None) -> int:
    from .sides import exit_with_parent

    p = argparse.ArgumentParser(prog="python -m rudra_zmq.benchmarks.synthetic_roles")
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("ps", "node", "learners"):
        q = sub.add_parser(role)
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        q.add_argument("--report", required=True, help="write the JSON report here at the end")
        q.add_argument("--params", type=int, required=role != "node")
    sub.choices["ps"].add_argument("--bind", required=True)
    sub.choices["ps"].add_argument("--bcast-bind", help="advstar: the broadcast root's endpoint")
    sub.choices["ps"].add_argument(
        "--shard", type=int, default=0, help="which of architecture.servers (its range)"
    )
    sub.choices["ps"].add_argument(
        "--built-model",
        action="store_true",
        help="serve the configured model's own weights (model.name), not --params of noise",
    )
    sub.choices["ps"].add_argument(
        "--local-bind", metavar="EP", help="also bind EP (ipc) for the learners of its host"
    )
    sub.choices["node"].add_argument("--id", type=int, required=True)
    sub.choices["node"].add_argument("--bind", required=True)
    sub.choices["node"].add_argument("--parent", required=True)
    sub.choices["node"].add_argument("--shard", type=int, default=0, help="its range's tree")
    sub.choices["learners"].add_argument("--ids", required=True, help="e.g. 0,1,2,3")
    sub.choices["learners"].add_argument(
        "--ps",
        required=True,
        help="endpoint, or one per learner (comma-separated); sharded servers: their "
        "endpoints in range order joined by +",
    )
    sub.choices["learners"].add_argument("--compute-ms", type=float, default=0.0)
    sub.choices["learners"].add_argument(
        "--layers",
        type=int,
        default=0,
        help="train the synthetic model of this many sleeping layers (the compute: "
        "--compute-ms) through the learner's exchange, pushing during backward; 0: sleep",
    )
    sub.choices["learners"].add_argument(
        "--product",
        action="store_true",
        help="run the product's learner (learner/learner.py) on the configured model "
        "(model.name), its minibatches from a data server in this process",
    )
    sub.choices["learners"].add_argument(
        "--push-after",
        action="store_true",
        help="--layers: push every part after backward (as the learner did before issue 42)",
    )
    sub.choices["learners"].add_argument(
        "--bcast-up",
        help="advstar: each learner's broadcast upstream endpoint (comma-separated, as --ids)",
    )
    sub.choices["learners"].add_argument(
        "--bcast-bind", help="advstar: each learner's endpoint for its broadcast children, or none"
    )
    sub.choices["learners"].add_argument(
        "--go",
        help="after HELLO, create GO.readyID (ID: the first learner id) and wait until GO exists",
    )
    args = p.parse_args(argv)
    exit_with_parent()
    timeline.start_from_env(os.path.splitext(os.path.basename(args.report))[0])
    try:
        report = {"ps": main_ps, "node": main_node, "learners": main_learners}[args.role](args)
    finally:
        timeline.stop()  # this role's part of the timeline (lan-table1 --timeline)
    with open(args.report, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
