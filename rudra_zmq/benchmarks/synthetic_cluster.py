"""Start a whole synthetic cluster (root PS, tree nodes, learners) for one benchmark run.

Every process is ``python -m rudra_zmq.benchmarks.synthetic_roles ROLE ...`` (see there),
started in its own session, optionally prefixed by ``ip netns exec NAMESPACE`` to put it on an
emulated host (``bench/lan/netns.sh``). :func:`run` starts the root, then the tree nodes
(parents first), then the learners, waits until the PS ends the run (it says STOP after
``epochs`` x ``epoch_gradients`` gradients) and returns every process's JSON report.
:class:`Processes` stops whatever is still running on any error or Ctrl-C, so nothing outlives
a run.

Placement: ``hosts`` is a list of :class:`Host`; the root runs on ``root`` and the learners
are split into consecutive equal groups, one per learner host. A tree leaf runs on the host of
its learners (ipc socket, as ``rudra-zmq run`` does); an inner node on its first leaf's host
(tcp). Architectures: ``base`` (learners talk to the root), ``adv`` (a PS tree) and
``advstar`` (Rudra-adv*: the same tree carries the gradients, the weights go from the root
down a broadcast among the learners, see :func:`_advstar`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..config import load_config
from ..shape import ClusterShape
from ..timeline import ENV as TIMELINE_ENV

MODULE = "rudra_zmq.benchmarks.synthetic_roles"


@dataclass(frozen=True)
class Host:
    """An emulated host: a network namespace (None: this one) and the address to bind there."""

    ns: str | None = None
    addr: str = "127.0.0.1"


class Processes:
    """The processes of one run. ``start`` blocks until a server printed its endpoint;
    ``wait`` until all exited; ``close`` stops the rest (TERM, then KILL). Not thread-safe."""

    def __init__(self, workdir: str, env: dict | None = None):
        """``env``: variables added to every process's environment (``start`` adds more)."""
        self.workdir, self.env = workdir, dict(env or {})
        self.procs: list[tuple[str, subprocess.Popen, str, str]] = []

    def start(
        self,
        name: str,
        role: str,
        args: list[str],
        host: Host,
        server: bool = False,
        timeout_s: float = 60,
        module: str = MODULE,
        env: dict | None = None,
    ) -> str | None:
        """Start a role (``python -m module role args``); a ``server`` is waited for until it
        printed ``listening on EP``: returns its output so far (endpoints, see ``_field``).
        ``env``: variables added to the process's environment."""
        out = os.path.join(self.workdir, f"{name}.out")
        log = os.path.join(self.workdir, f"{name}.log")
        report = os.path.join(self.workdir, f"{name}.json")
        cmd = (["ip", "netns", "exec", host.ns] if host.ns else []) + [
            sys.executable,
            "-m",
            module,
            role,
            *args,
            "--report",
            report,
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            OMP_WAIT_POLICY="PASSIVE",
            PYTHONUNBUFFERED="1",
            **self.env,
            **(env or {}),
        )
        with open(out, "w") as fo, open(log, "w") as fe:
            proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=True)
        self.procs.append((name, proc, log, report))
        return self.listening(name, timeout_s) if server else None

    def listening(self, name: str, timeout_s: float = 60) -> str:
        """Wait until the server ``name`` (started) printed ``listening on EP``: its output
        so far. Raises RuntimeError if it ended or took over ``timeout_s``."""
        _, proc, log, _ = next(p for p in self.procs if p[0] == name)
        out = os.path.join(self.workdir, f"{name}.out")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(out) as f:
                text = f.read()
            if "listening on " in text and text.endswith("\n"):
                return text
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not start: {self._why(name, proc, log)}")

    @staticmethod
    def _why(name, proc, log) -> str:
        with open(log) as f:
            tail = f.read()[-2000:]
        return f"exit code {proc.poll()}; end of {log}:\n{tail}"

    def barrier(self, go: str, firsts: list[int], timeout_s: float) -> None:
        """Wait until every learner process said HELLO (``GO.readyI`` files), then create
        ``go``: all learners start computing at once. Raises like ``wait``."""
        deadline = time.monotonic() + timeout_s
        while not all(os.path.exists(f"{go}.ready{i}") for i in firsts):
            for name, proc, log, _ in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} ended before the start: {self._why(name, proc, log)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the learners did not all say HELLO within {timeout_s} s")
            time.sleep(0.02)
        open(go, "w").close()

    def wait(self, timeout_s: float) -> dict:
        """Wait for every process to exit 0; their reports by name. Raises RuntimeError
        naming the first one that failed, TimeoutError if the run took over ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc, log, _ in self.procs:
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"{name} failed: {self._why(name, proc, log)}")
            if all(p.poll() == 0 for _, p, _, _ in self.procs):
                break
            if time.monotonic() > deadline:
                alive = [n for n, p, _, _ in self.procs if p.poll() is None]
                raise TimeoutError(
                    f"the run did not end within {timeout_s:.0f} s; still "
                    f"running: {', '.join(alive)}"
                )
            time.sleep(0.1)
        reports = {}
        for name, _, _, path in self.procs:
            with open(path) as f:
                reports[name] = json.load(f)
        return reports

    def close(self) -> None:
        alive = [(n, p) for n, p, _, _ in self.procs if p.poll() is None]
        for _, p in alive:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, p in alive:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(p, signal.SIGKILL)
                p.wait(5)


def _signal(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the process and anything it started
    except ProcessLookupError:
        pass


def _learner_hosts(n: int, hosts: list[Host]) -> list[Host]:
    """Host of each learner: consecutive equal groups, one per host."""
    if n % len(hosts):
        raise ValueError(f"{n} learners do not split evenly over {len(hosts)} hosts")
    per = n // len(hosts)
    return [hosts[i // per] for i in range(n)]


def _field(text: str, key: str) -> str:
    """The endpoint after ``key`` in a server's output."""
    return text.split(key, 1)[1].split()[0]


def _tree(shape, server, procs, where, root_ep, workdir, common) -> dict[int, str]:
    """Start the tree nodes of ``server``'s range (``shape.ClusterShape``: one tree per
    range), parents first; return each learner's endpoint (its leaf)."""
    tree = shape.tree
    ep = {None: root_ep}
    for node in sorted(tree.nodes, key=lambda nd: -nd.level):
        first = min(node.subtree)
        host = where[first]
        label = shape.node_label(node.id, server.index)
        bind = f"ipc://{workdir}/{label}.sock" if node.is_leaf else f"tcp://{host.addr}:0"
        if node.is_leaf and any(where[i] != host for i in node.learners):
            raise ValueError(
                f"leaf {node.id} has learners on several hosts; choose a fanout "
                "that divides the learners per host"
            )
        out = procs.start(
            label,
            "node",
            ["--id", str(node.id), "--bind", bind, "--parent", ep[node.parent], *server.args]
            + common,
            host,
            server=True,
        )
        ep[node.id] = _field(out, "listening on ")
    return {i: ep[tree.leaf_of(i).id] for i in range(len(where))}


def _advstar(overrides, where, bcast_root, first_port=21000):
    """Rudra-adv*: the broadcast endpoints of every learner, ``{id: (upstream, bind|None)}``.
    The gradients take the same tree as adv (started by :func:`_tree`); the weights go from
    the root's broadcast endpoint down the learners' broadcast tree
    (``architecture.broadcast_fanout``; 1 = a chain, in learner order), each member binding
    tcp on its own host (a fixed port in a namespace of its own, else a free one here)."""
    from .. import transport
    from ..config import load_config
    from ..topology import broadcast_children, broadcast_upstream

    cfg = load_config(None, overrides)
    binds = {
        i: (
            None
            if not broadcast_children(cfg, i)
            else f"tcp://{h.addr}:{first_port + i}"
            if h.ns
            else transport.free_tcp_endpoint(h.addr)
        )
        for i, h in enumerate(where)
    }
    ups = {
        i: bcast_root if broadcast_upstream(cfg, i) is None else binds[broadcast_upstream(cfg, i)]
        for i in range(len(where))
    }
    return {i: (ups[i], binds[i]) for i in range(len(where))}


def advstar_available() -> bool:
    """Whether Rudra-adv* can run here: its module and the PS's broadcast exist."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("rudra_zmq.broadcast.root") is None:
        return False
    from ..server.ps import ParameterServer

    return "broadcast" in inspect.signature(ParameterServer.__init__).parameters


def run(
    arch: str,
    overrides: list[str],
    *,
    params: int,
    learners: int,
    root: Host,
    hosts: list[Host],
    workdir: str,
    compute_ms: float = 0.0,
    per_process: int = 1,
    timeout_s: float = 600,
    servers: list[Host] | None = None,
    timeline: str | None = None,
    local_ipc: bool = False,
    layers: int = 0,
    push_after: bool = False,
    model: tuple[str, str] | None = None,
) -> dict:
    """Run one cluster to the end; ``{"ps": report, "servers": [reports], "nodes": [...],
    "learners": [...], "wall_s": s, "workdir": its own directory under workdir}``. With
    ``servers`` (base, or adv with one tree per range), one server per host listed there
    (``architecture.servers`` = their number; each serves its range of the run's
    ``shape.ClusterShape``; ``ps`` is then the first's report), instead of one on ``root``;
    with ``local_ipc`` (base) a learner reaches a server on its own host over ipc instead of
    tcp; with ``layers`` the learners train the synthetic model of that many sleeping layers
    (``synthetic_roles learners --layers``; ``push_after``: every part after backward);
    with ``model`` ((model.name, the folder to import it from)) the learners are the
    product's own (``synthetic_roles learners --product``) on that model, and the servers
    serve its weights.
    ``timeline``: every role records its part of that timeline (``timeline.start_from_env``;
    the caller merges them). Blocks; stops every process it started before returning or
    raising."""
    workdir = tempfile.mkdtemp(prefix=f"{arch}-", dir=workdir)  # fresh: logs, reports, go
    env = {TIMELINE_ENV: timeline} if timeline else {}
    if model is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [model[1], os.environ.get("PYTHONPATH")]))
    procs = Processes(workdir, env)
    t0 = time.time()
    try:
        if arch not in ("base", "adv", "advstar"):
            raise ValueError(f"unknown architecture {arch!r}: base, adv or advstar")
        homes = servers or [root]  # each server's host, in range order
        overrides = [*overrides, f"architecture.servers={len(homes)}"]
        if model is not None:
            overrides.append(f"model.name={model[0]}")
            if model[1] not in sys.path:  # the config builds the model once to check it
                sys.path.insert(0, model[1])
        shape = ClusterShape.of(load_config(None, overrides))  # (advstar refuses K > 1)
        common = [f"--set={o}" for o in overrides]
        where = _learner_hosts(learners, hosts)
        local = set(where) if servers and local_ipc and arch == "base" else set()
        server_eps, local_eps = [], []
        for srv, host in zip(shape.servers, homes):  # all started, then each waited for
            bcast = ["--bcast-bind", f"tcp://{host.addr}:0"] if arch == "advstar" else []
            args = ["--bind", f"tcp://{host.addr}:0", *bcast, *srv.args]
            args += ["--built-model"] if model is not None else []
            if host in local:  # also an ipc endpoint for the learners of its own host
                args += ["--local-bind", f"ipc://{workdir}/{srv.label}.sock"]
            procs.start(srv.label, "ps", [*args, "--params", str(params), *common], host)
        for srv, host in zip(shape.servers, homes):
            out = procs.listening(srv.label, 60 if model is None else 180)
            server_eps.append(_field(out, "listening on "))
            local_eps.append(_field(out, "local on ") if host in local else None)
        members = {}
        if shape.tree is None:  # Rudra-base: every learner to every server
            eps = {
                i: "+".join(ipc if ipc and h == where[i] else tcp
                            for tcp, ipc, h in zip(server_eps, local_eps, homes))
                for i in range(learners)
            }  # fmt: skip
        else:  # adv and advstar: one tree per range carries the gradients, to its server
            per = [
                _tree(shape, srv, procs, where, ep, workdir, common)
                for srv, ep in zip(shape.servers, server_eps)
            ]
            eps = {i: "+".join(leaves[i] for leaves in per) for i in range(learners)}
        if arch == "advstar":  # ... and the weights go down the learners' broadcast
            members = _advstar(overrides, where, _field(out, "broadcast on "))
        go, firsts = os.path.join(workdir, "go"), []
        for h in dict.fromkeys(where):  # learner processes per host, per_process each
            ids = [i for i in range(learners) if where[i] == h]
            for k in range(0, len(ids), per_process):
                group = ids[k : k + per_process]
                firsts.append(group[0])
                bc = (
                    [
                        "--bcast-up",
                        ",".join(members[i][0] for i in group),
                        "--bcast-bind",
                        ",".join(members[i][1] or "none" for i in group),
                    ]
                    if members
                    else []
                )
                procs.start(
                    f"learners{group[0]}",
                    "learners",
                    [
                        "--ids",
                        ",".join(map(str, group)),
                        *bc,
                        "--ps",
                        ",".join(eps[i] for i in group),
                        "--go",
                        go,
                        "--params",
                        str(params),
                        "--compute-ms",
                        str(compute_ms),
                        "--layers",
                        str(layers),
                        *(["--push-after"] if push_after else []),
                        *(["--product"] if model is not None else []),
                        *common,
                    ],
                    h,
                )
        procs.barrier(go, firsts, timeout_s=120)
        reports = procs.wait(timeout_s)
    finally:
        procs.close()
    ps_names = shape.labels
    return {
        "ps": reports[ps_names[0]],
        "servers": [reports[n] for n in ps_names],
        "nodes": [r for n, r in reports.items() if n.startswith("node")],
        "learners": [r for n, r in reports.items() if n.startswith("learners")],
        "wall_s": time.time() - t0,
        "workdir": workdir,
    }
