"""Sharded parameter servers on the emulated LAN (``bench lan-table1 --servers K``): Rudra-base
with K servers, each over one range of ``shape.split(params, K)``, placed beside the learners
(server k on learner host k mod HOSTS, ``colocated``) or on K hosts of their own (``extra``),
the synthetic learners pushing each server its slice (``learner/exchange.py``).

An epoch ends when its last gradient's update is applied on the slowest server; the bytes
are the sum over the servers. The link bound of a hardsync update (``link_phases``): whole
messages (every push, then every reply) take the busiest link's pushes, then its replies; in
P parts (wire.parts) the replies overlap the pushes, but a link direction that carries both
(a host whose server answers remote learners while its learner pushes to remote servers:
``colocated``) still carries both, so the bound is the larger of that direction's bytes and
the pushes plus the last part's replies.
"""

from __future__ import annotations

import statistics

from .. import wire
from . import synthetic_cluster as sc
from . import synthetic_roles as sr
from .lan_ddp import FORWARD_SHARE
from .lan_link import (
    deadline_s,
    parse_rate,
    pushed_in_backward,
    retries,
    row_head,
    traffic,
    wire_bytes,
)

PLACEMENTS = ("colocated", "extra")
MODEL_LEARNERS = ("model", "product")  # --learner: the synthetic model, pushing in backward


def server_hosts(lan, a, k: int, placement: str) -> list:
    """The host of each of the ``k`` servers (``lan.hosts``: root, learner hosts, extra)."""
    learner_hosts = lan.hosts[1 : 1 + a.hosts]
    if placement == "colocated":
        return [learner_hosts[i % a.hosts] for i in range(k)]
    extra = lan.hosts[1 + a.hosts : 1 + a.hosts + k]
    if len(extra) < k:
        raise ValueError(f"{k} extra server hosts needed, the LAN has {len(extra)}")
    return extra


def extra_hosts(a) -> int:
    """Hosts the LAN needs beyond the root and the learner hosts for ``a``'s runs."""
    return max(a.servers) if "extra" in a.server_placement else 0


def link_phases(hosts: int, per_host: int, k: int, placement: str) -> tuple[float, float, float]:
    """A hardsync update's busiest link loads, in models (M): (pushes, replies, both): the
    most any link direction carries of the pushes, of the replies, and of the two together.
    ``hosts`` learner hosts of ``per_host`` learners; ``k`` servers of M/k each, server i on
    learner host i mod hosts (``colocated``) or on a host of its own (``extra``); a learner's
    slice for a server on its own host does not cross a link. Pure."""
    lam = hosts * per_host
    on = [0] * hosts  # servers on each learner host
    if placement == "colocated":
        for i in range(k):
            on[i % hosts] += 1
    learner_out = [per_host * (k - on[h]) / k for h in range(hosts)]  # = its replies in
    server_out = [on[h] * (lam - per_host) / k for h in range(hosts)]  # = its pushes in
    if placement == "extra":
        server_out += [lam / k] * k  # hosts with one server and no learner
        learner_out += [0.0] * k
    pushes = max(max(learner_out), max(server_out))
    both = max(x + y for x, y in zip(learner_out, server_out))
    return pushes, pushes, both


def bound_s_per_epoch(
    case: str, a, k: int, placement: str, wire_dtype: str, parts: int = 1
) -> float | None:
    """The link bound of one epoch of ``case`` (hardsync only; None otherwise): per update
    the busiest link's pushes then its replies, or in P parts (wire.parts) the larger of the
    busiest direction's pushes and replies together and the pushes plus 1/P of the replies
    (module docstring), plus one compute."""
    if case not in ("base-hardsync", "base-softsync"):
        return None
    pushes, replies, both = link_phases(a.hosts, a.per_host, k, placement)
    m = a.params * wire_bytes(wire_dtype) / parse_rate(a.rate)
    link, c = max(both, pushes + replies / parts) * m, a.compute_ms / 1000
    if case == "base-softsync":  # a reply may be UPTODATE (no weights): the pushes alone
        link = pushes * m
    per_update = link + c
    if getattr(a, "learner", "sleep") in MODEL_LEARNERS:  # pushes during backward: DDP's
        per_update = c * FORWARD_SHARE + max(c * (1 - FORWARD_SHARE), link)
    return a.epoch_gradients / (a.hosts * a.per_host) * per_update


def learner_args(a) -> dict:
    """``synthetic_cluster.run``'s learner arguments for ``a.learner``: sleep, the synthetic
    model through the exchange (model; model-after), or the product's learner on it (product:
    ``a.model``, its model.name and folder). Pure."""
    learner = getattr(a, "learner", "sleep")
    if learner == "product":
        return {"model": a.model}
    return {
        "layers": 0 if learner == "sleep" else a.layers,
        "push_after": learner == "model-after",
    }


def epochs_across(servers: list[dict], n: int, epochs: int) -> list[dict]:
    """Per epoch: seconds (the slowest server's end of it, from the previous epoch's end or
    the first gradient anywhere), the bytes every server received, its updates (server 0's)
    and ⟨σ⟩ (mean over servers). ``n``: gradients per epoch."""
    ends, rows_of = [], []
    for ps in servers:
        rows = [dict(zip(ps["log_fields"], r)) for r in ps["log"]]
        rows_of.append(rows)
        ends.append([next(i for i, r in enumerate(rows) if r["grads"] >= e * n) for e in
                     range(1, epochs + 1)])  # fmt: skip
    prev_t = min(ps["t_first_grad"] for ps in servers)
    prev_k = [-1] * len(servers)
    out = []
    for e in range(epochs):
        t = max(rows[ends[j][e]]["t"] for j, rows in enumerate(rows_of))
        rx, tx = (
            sum(
                rows[ends[j][e]][key] - (rows[prev_k[j]][key] if prev_k[j] >= 0 else 0)
                for j, rows in enumerate(rows_of)
            )
            for key in ("rx_bytes", "tx_bytes")
        )
        sig = [
            statistics.fmean(r["mean_sigma"] for r in rows[prev_k[j] + 1 : ends[j][e] + 1])
            for j, rows in enumerate(rows_of)
        ]
        out.append(
            {
                "epoch": e + 1,
                "s": t - prev_t,
                "t_end": t,
                "rx_bytes": rx,
                "tx_bytes": tx,
                "updates": ends[0][e] - prev_k[0],
                "mean_sigma": statistics.fmean(sig),
            }
        )
        prev_t, prev_k = t, [ends[j][e] for j in range(len(servers))]
    return out


def run_case(
    case: str, a, lan, workdir: str, wire_dtype: str, k: int, placement: str, parts: int = 1,
    timeline: str | None = None,
) -> dict:  # fmt: skip
    """One Rudra-base or Rudra-adv case (one tree per range) with ``k`` sharded servers
    placed by ``placement``: its row, as ``lan_table1.run_case``'s (the root's columns are
    the servers' sums; ``timeline`` as there). Blocks."""
    arch, protocol = case.split("-")
    if arch not in ("base", "adv"):
        raise ValueError(f"--servers: sharded servers serve base and adv, not {case}")
    lam = a.hosts * a.per_host
    ov = sr.overrides(
        arch, protocol, lam, a.epoch_gradients, epochs=a.epochs, softsync_n=1,
        fanout=a.per_host, depth=1, retry_s=a.retry_s, wire_dtype=wire_dtype, parts=parts,
        sndbuf_kib=a.sndbuf_kib, stripes=getattr(a, "stripes", "on") == "on",
        priority=getattr(a, "priority", None),
    )  # fmt: skip
    bound = bound_s_per_epoch(case, a, k, placement, wire_dtype, parts)
    deadline = deadline_s(bound, a.epochs) + (120 if getattr(a, "learner", "") == "product" else 0)
    r = sc.run(
        arch, ov, params=a.params, learners=lam, root=lan.hosts[0],
        hosts=lan.hosts[1 : 1 + a.hosts], workdir=workdir, compute_ms=a.compute_ms,
        per_process=a.per_host, servers=server_hosts(lan, a, k, placement),
        timeout_s=deadline, timeline=timeline, local_ipc=a.local == "ipc",
        **learner_args(a),
    )  # fmt: skip
    servers = r["servers"]
    per = wire_bytes(wire_dtype)
    for ps in servers:
        if ps["rx_grad_bytes"] != ps["numel"] * per * ps["rx_grad_msgs"]:
            raise RuntimeError(f"a server's gradient bytes != its numel x {per} x messages")
    ep = epochs_across(servers, a.epoch_gradients, a.epochs)
    timed = ep[1:] or ep
    s = statistics.median(e["s"] for e in timed)
    name = f"{case}-k{k}-{placement}" + (
        "" if wire_dtype == "float32" else f"-{wire.WIRE_DTYPES[wire_dtype]}"
    )
    name += f"-p{parts}" if parts > 1 else ""
    name += f"-sb{a.sndbuf_kib}" if a.sndbuf_kib else ""
    name += "-ranges" if parts > 1 and getattr(a, "stripes", "on") == "off" else ""
    prio = getattr(a, "priority", None)
    name += {"on": "-prio", "off": "-noprio"}.get(prio, "") if parts > 1 else ""
    name += "-ipc" if a.local == "ipc" and placement == "colocated" else ""
    name += "" if getattr(a, "learner", "sleep") == "sleep" else f"-{a.learner}"
    row_traffic = traffic(timed, a.epoch_gradients * len(timed))  # summed over the servers
    share = max(ps["rx_grad_bytes"] for ps in servers) / sum(ps["rx_grad_bytes"] for ps in servers)
    return {
        **row_head(name, a, wire_dtype, s, [e["s"] for e in ep], bound),
        "arch": arch,
        "protocol": protocol,
        "servers": k,
        "placement": placement,
        "parts": parts,
        **row_traffic,
        # the busiest server's ingress: its measured share of the gradient bytes
        "busiest_rx_bytes_per_epoch": row_traffic["root_rx_bytes_per_epoch"] * share,
        "root_cpu_s": max(ps["cpu_s"] for ps in servers),  # the busiest server's
        "grads_total": servers[0]["grads"],
        "server_numel": [ps["numel"] for ps in servers],
        "server_cpu_s": [ps["cpu_s"] for ps in servers],
        "wall_s": r["wall_s"],
        "timed_window": [
            ep[0]["t_end"] if len(ep) > 1 else min(ps["t_first_grad"] for ps in servers),
            ep[-1]["t_end"],
        ],
        **pushed_in_backward(r["learners"]),
        **retries(servers, r["learners"]),
    }
