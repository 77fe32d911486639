"""Where each role of one run goes on a cluster: the plan of ``rudra-zmq launch``.

Given a config and the hosts of a hostfile (:mod:`rudra_zmq.launch.hostfile`; one slot = one
learner), :func:`place` puts

- the statistics server, the data server and the PS on the server host (the first host, or
  ``server_host``), with the inner tree nodes and the advstar broadcast root; the K
  parameter servers of ``architecture.servers`` there too, or on ``ps_hosts`` (server I on
  its I-th entry, cycling; ``["learners"]``: beside the learners, on their hosts in order);
- learner processes (``runtime.learners_per_process`` learners each) on the hosts in order,
  filling each host's slots before the next;
- each Rudra-adv leaf on the host of its learners, and each advstar learner's broadcast
  socket on its own host.

Every server listens on ``tcp`` at ports counted up from ``port`` on its host; others reach
it by the host's name as the hostfile writes it. A server binds what the user gave
(:func:`bind_address`): an IP address exactly, ``localhost`` as 127.0.0.1, and every interface
for any other name (a host name may resolve to 127.0.1.1 on the host itself, as on Debian).
``security.curve`` unset (null) becomes on when any role runs on another host or listens
beyond loopback, off otherwise (:func:`exposed`). Pure planning: :func:`place` starts nothing;
with ``create`` it makes the run directory here and saves the resolved config, as
``rudra-zmq run`` does. Thread-safe.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from .. import config as config_mod
from .. import topology
from ..config import ConfigError
from ..run_files import KEYS_DIR, config_path
from ..shape import ClusterShape
from . import hostfile
from .run_plan import (
    Plan,
    learner_groups,
    learner_label,
    make_run_dir,
    role_steps,
)

DEFAULT_PORT = 29500  # the first port on each host (torch.distributed's default)


@dataclass
class ClusterPlan:
    """A :class:`run_plan.Plan` (endpoints as others reach them, binds as servers bind) and
    the host of every process label."""

    plan: Plan
    hosts: list[hostfile.Host]
    server_host: str
    placement: dict[str, str]  # label (ps, data, node3, learner0-1, ...) -> host
    curve_given: bool | None = None  # security.curve as the config said it (None: unset)

    def learners_on(self, host: str) -> int:
        """How many learners the plan puts on ``host``."""
        return sum(
            len(ids)
            for ids in self.plan.learner_groups
            if self.placement[learner_label(ids)] == host
        )

    def host_names(self) -> list[str]:
        """Every host that runs something, the server host first."""
        names = [self.server_host]
        for host in self.placement.values():
            if host not in names:
                names.append(host)
        return names


def _address(host: str) -> str:
    """``host`` as it goes into a tcp endpoint (an IPv6 address in brackets)."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host


def bind_address(host: str) -> str:
    """Where a server reached as ``host`` binds, as a tcp endpoint's host: that IP address
    (IPv6 in brackets), 127.0.0.1 for ``localhost``, every interface for any other name."""
    if host.rstrip(".").lower() == "localhost":
        return "127.0.0.1"  # libzmq resolves a connect to localhost over IPv4 by default
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "0.0.0.0"
    return _address(host)


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is a loopback address (127/8, ::1; IPv6 bare or in brackets) or
    ``localhost``. No DNS lookups."""
    host = host.strip("[]")
    if host.rstrip(".").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint's HOST is loopback (ipc: True)."""
    if not endpoint.startswith("tcp://"):
        return True
    return is_loopback_host(endpoint[len("tcp://") :].rsplit(":", 1)[0])


def exposed(binds: dict[str, str], hosts) -> bool:
    """Whether others could reach servers that bind ``binds`` with roles on ``hosts``: a host
    that is not this machine, or a server listening beyond loopback."""
    return not all(hostfile.is_local(h) for h in hosts) or not all(
        is_loopback(ep) for ep in binds.values()
    )


def _place_groups(groups: list[list[int]], hosts: list[hostfile.Host]) -> list[str]:
    """The host of each learner group: hosts in order, each filled up to its slots."""
    out, i, free = [], 0, hosts[0].count
    for ids in groups:
        while i < len(hosts) and free < len(ids):
            i += 1
            free = hosts[i].count if i < len(hosts) else 0
        if i == len(hosts):
            raise ConfigError(
                f"learners {','.join(map(str, ids))} (one process of "
                f"runtime.learners_per_process learners) fit on no host that has slots left "
                f"({hostfile.describe(hosts)}); give hosts more slots or lower "
                "runtime.learners_per_process"
            )
        out.append(hosts[i].name)
        free -= len(ids)
    return out


def place(
    cfg,
    hosts: list[hostfile.Host],
    *,
    server_host: str | None = None,
    ps_hosts: list[str] | None = None,
    port: int = DEFAULT_PORT,
    run_dir=None,
    create: bool = True,
) -> ClusterPlan:
    """Plan the run of ``cfg`` on ``hosts``. ``create``: make the run directory (``run_dir``,
    else ``runtime.run_dir/NAME-STAMP``) and save ``config.yaml`` there; without it nothing
    is written (a dry run). Raises ConfigError: too few slots, a bad port."""
    lam = cfg.sync.learners
    slots = sum(h.count for h in hosts)
    if slots < lam:
        raise ConfigError(
            f"sync.learners={lam} learners need {lam} slots, and the hosts give "
            f"{slots} ({hostfile.describe(hosts)}); add slots or hosts, or set "
            f"sync.learners={slots}"
        )
    if not 1 <= port <= 65535 - 200:
        raise ConfigError(f"--port {port}: give the first port of a free range, 1-65335")
    server = server_host or hosts[0].name
    tree = topology.tree_of(cfg)
    groups = (
        topology.learner_groups(tree, cfg.runtime.learners_per_process)
        if tree
        else learner_groups(cfg)
    )
    placement = {"stats": server, "data": server}
    learner_hosts = _place_groups(groups, hosts)
    shape = ClusterShape.of(cfg).placed(ps_hosts, server, learner_hosts)
    for s in shape.servers:
        placement[s.label] = s.host
    for ids, host in zip(groups, learner_hosts):
        placement[learner_label(ids)] = host
    host_of_learner = {i: placement[learner_label(ids)] for ids in groups for i in ids}

    servers = [*shape.labels, "data", "stats"]
    if cfg.architecture.kind == "advstar":
        placement["bcast"] = server
        servers.append("bcast")
        for i in range(lam):
            if topology.broadcast_children(cfg, i):
                placement[f"bcast{i}"] = host_of_learner[i]
                servers.append(f"bcast{i}")
    if tree is not None:
        for label, n, k in shape.tree_processes():  # inner: beside its server
            placement[label] = host_of_learner[n.learners[0]] if n.is_leaf else shape.server(k).host
            servers.append(label)

    endpoints, binds, next_port = {}, {}, {}
    for label in servers:
        host = placement[label]
        p = next_port.get(host, port)
        next_port[host] = p + 1
        endpoints[label] = f"tcp://{_address(host)}:{p}"
        binds[label] = f"tcp://{bind_address(host)}:{p}"
    given = cfg.security.curve
    if given is None:  # unset: encrypt whenever someone else could reach the roles
        on = exposed(binds, placement.values())
        cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, curve=on))
    if create:
        path = make_run_dir(cfg, run_dir)
        config_mod.save(cfg, config_path(path))
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path(run_dir or Path(cfg.runtime.run_dir) / f"{cfg.name}-{stamp}").absolute()
    plan = Plan(cfg, path, endpoints, groups, tree, binds)
    return ClusterPlan(plan, hosts, server, placement, given)


LOCAL_RULE = (
    "localhost, 127.x.x.x, ::1 and this machine's own names run here without ssh "
    "(as under Horovod); every other entry goes over ssh, this machine's network "
    "addresses included (name one of them to reach it over ssh)"
)


def describe(cp: ClusterPlan) -> str:
    """The placement, one line per host (``host-a (2 slots, 2 learners; over ssh): stats,
    data, ps, learner0-1``), then how the roles talk (``security: ...``)."""
    slots = {h.name: h.count for h in cp.hosts}
    lines = []
    for host in cp.host_names():
        labels = [label for label, h in cp.placement.items() if h == host]
        n = slots.get(host)
        what = f"{n} slot{'s' if n != 1 else ''}" if n is not None else "servers only"
        how = "this machine, no ssh" if hostfile.is_local(host) else "over ssh"
        lines.append(
            f"  {host} ({what}, {cp.learners_on(host)} learners; {how}): " + ", ".join(labels)
        )
    return "\n".join([*lines, f"  security: {security_line(cp)}"])


def security_line(cp: ClusterPlan) -> str:
    """How the roles of ``cp`` talk, and why: one line for the plan."""
    given = {
        None: "security.curve unset",
        True: "security.curve: true",
        False: "security.curve: false",
    }[cp.curve_given]
    if cp.plan.cfg.security.curve:
        return (
            f"CurveZMQ on every socket ({given}); the run's keys are made in "
            f"{cp.plan.run_dir / KEYS_DIR} and copied to each host"
        )
    if exposed(cp.plan.binds, cp.host_names()):
        return f"PLAINTEXT across hosts ({given}): anyone who can reach the roles can join"
    return f"plaintext on loopback, every role on this machine ({given})"


def commands(cp: ClusterPlan, resume: bool = False) -> list[tuple[str, str, str, list[str]]]:
    """Every process in start order: ``(host, label, role, args)`` with ``--config`` first."""
    conf = ["--config", str(config_path(cp.plan.run_dir))]
    return [
        (cp.placement[label], label, role, conf + args)
        for label, role, args, _ in role_steps(cp.plan, resume)
    ]
