"""A whole run with every role as a thread of the test process: the plan, run directory and
role classes of ``rudra-zmq run``, without a process per role.

For tests whose subject is what the roles compute together (weights, staleness, accuracy),
not the process boundary: a run of 4 learners then imports torch once instead of seven times
(~3 s of CPU each on 2 cores). Tests about processes (a role that dies, a killed launcher)
keep using ``rudra-zmq run``.
"""

import threading

import zmq

from rudra_zmq import kernels, transport
from rudra_zmq.config import load_config
from rudra_zmq.devices import learner_threads
from rudra_zmq.launch.run_plan import learner_endpoints, make_plan, summary

JOIN_S = 300  # the longest a role may take to end after training did (a hang guard only)


def run_in_threads(config, overrides, run_dir):
    """Run ``config`` with ``overrides`` into ``run_dir``; returns (``run_dir``, the plan's
    summary as ``rudra-zmq run`` prints it) once every role ended. Raises the first role's exception (the others are stopped), or RuntimeError if a
    role does not end. Blocks."""
    import torch

    from rudra_zmq.data.server import DataServer
    from rudra_zmq.learner.learner import Learner
    from rudra_zmq.server.ps import ParameterServer
    from rudra_zmq.stats.server import StatsServer
    from rudra_zmq.tree.node import TreeNode

    cfg = load_config(config, list(overrides))
    plan = make_plan(cfg, run_dir)
    ep = plan.endpoints
    torch.set_num_threads(learner_threads(cfg))
    kernels.set_num_threads(1)
    ctx = zmq.Context()
    stop, failed, errors = threading.Event(), threading.Event(), []

    def role(name, make, serve_event):
        """Start a thread that builds a role (binding its socket) and serves it."""
        ready = threading.Event()

        def body():
            try:
                server = make()
                ready.set()
                if serve_event is not None:
                    server.serve_forever(serve_event)
                else:  # a learner
                    server.run(stop_event=failed)
            except BaseException as exc:  # surfaced below
                errors.append((name, exc))
                failed.set()
            finally:
                ready.set()

        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        ready.wait(JOIN_S)
        return t

    servers = [
        role("stats", lambda: StatsServer(cfg, ep["stats"], plan.run_dir, ctx), stop),
        role("data", lambda: DataServer(cfg, ep["data"], ctx), stop),
        role(
            "ps",
            lambda: ParameterServer(
                cfg, ep["ps"], ep["stats"], plan.run_dir, ctx, broadcast=ep.get("bcast")
            ),
            failed,
        ),
    ]
    if plan.tree is not None:  # the top level first: a node's parent must be bound
        for node in sorted(plan.tree.nodes, key=lambda n: -n.level):
            parent = ep["ps"] if node.parent is None else ep[f"node{node.parent}"]
            servers.append(
                role(
                    f"node{node.id}",
                    lambda n=node, p=parent: TreeNode(cfg, n.id, ep[f"node{n.id}"], p, ctx),
                    failed,
                )
            )
    learners = []
    for i in range(cfg.sync.learners):
        le = learner_endpoints(plan, i)
        learners.append(
            role(
                f"learner{i}",
                lambda i=i, le=le: Learner(
                    cfg, i, le["ps"], le["data"], le["stats"], ctx, le["bcast"]
                ),
                None,
            )
        )
    try:
        for t in learners + servers[2:] + servers[:1]:  # learners, PS and nodes, stats
            t.join(JOIN_S)
            if t.is_alive():
                failed.set()
                raise RuntimeError(f"{t.name} did not end within {JOIN_S} s")
            if errors:
                name, exc = errors[0]
                raise RuntimeError(f"{name} failed: {exc!r}") from exc
    finally:
        failed.set()
        stop.set()
        for t in learners + servers:
            t.join(10)
        # A role still inside a request (a test cut short by its timeout) must not have its
        # sockets closed under it (libzmq aborts the process): leave them to their timeouts.
        if not any(t.is_alive() for t in learners + servers):
            if transport.security() is not None:  # its ZAP handler, before the context
                transport.security().release(ctx)
            ctx.destroy(linger=0)
    return plan.run_dir, summary(plan)
