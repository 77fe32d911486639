"""The shape of a Rudra-adv PS tree, planned from the config: pure logic, no sockets.

``architecture.kind: adv`` puts a tree of PS nodes between the learners and the root
parameter server::

    depth 1 (leaves talk to the root)        depth 2 (leaves -> inner nodes -> root)

             root PS                                    root PS
            /       \\                                      |
       node 0       node 1                               node 2           (inner, level 2)
       /    \\       /    \\                              /      \\
     l0     l1     l2     l3                      node 0       node 1     (leaves, level 1)
                                                  /    \\       /    \\
                                                l0     l1     l2     l3

Leaves (level 1) hold the learners of ``architecture.leaves`` (default: consecutive groups of
``architecture.fanout``); each level above groups ``fanout`` consecutive nodes of the level
below, up to ``architecture.depth`` levels; the top level's nodes are the root's children.
Node ids count leaves first (0 .. L-1, in the order of ``architecture.leaves``), then each
level above in turn. Every role that loads the same config plans the same tree, so the root
and each node can check that a child saying HELLO is the child the plan puts there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import plan_endpoints, wire
from .sync import ProtocolViolation


@dataclass(frozen=True)
class NodeSpec:
    """One tree node: ``parent`` None is the root PS; ``children`` are child node ids (inner
    nodes) and ``learners`` the learners directly below (leaves); ``subtree`` is every learner
    below it."""

    id: int
    level: int
    parent: int | None
    children: tuple[int, ...]
    learners: tuple[int, ...]
    subtree: frozenset

    @property
    def is_leaf(self) -> bool:
        return self.level == 1

    def describe(self) -> str:
        below = (
            f"learners {_ids(self.learners)}"
            if self.is_leaf
            else f"nodes {_ids(self.children)} (learners {_ids(sorted(self.subtree))})"
        )
        up = "the root" if self.parent is None else f"node {self.parent}"
        kind = "leaf" if self.is_leaf else f"inner node, level {self.level}"
        return f"tree node {self.id} ({kind}): {below}; parent {up}"


@dataclass(frozen=True)
class Tree:
    """The planned tree; see the module docstring. Immutable and thread-safe."""

    nodes: tuple[NodeSpec, ...]
    n_learners: int

    @property
    def leaves(self) -> list[NodeSpec]:
        return [n for n in self.nodes if n.is_leaf]

    def children_of(self, parent: int | None) -> list[NodeSpec]:
        """The nodes directly below ``parent`` (None: the root)."""
        return [n for n in self.nodes if n.parent == parent]

    def leaf_of(self, learner: int) -> NodeSpec:
        return next(n for n in self.leaves if learner in n.learners)

    def node(self, node_id: int) -> NodeSpec:
        if not 0 <= node_id < len(self.nodes):
            raise ValueError(
                f"tree node id {node_id} is out of range: this config plans "
                f"{len(self.nodes)} nodes (ids 0..{len(self.nodes) - 1})"
            )
        return self.nodes[node_id]

    def below(self, sender: int) -> frozenset:
        """The learners a STOP to ``sender`` reaches: a learner itself, or a tree node's
        subtree (the node passes STOP on)."""
        k = wire.node_id(sender)
        if k is None:
            return frozenset((sender,))
        return self.nodes[k].subtree if 0 <= k < len(self.nodes) else frozenset()

    def describe(self) -> list[str]:
        return [n.describe() for n in self.nodes]

    # -- checks shared by the root PS and the tree nodes (they raise ProtocolViolation) ----
    def check_child(self, parent: int | None, sender: int, subtree) -> frozenset:
        """Check a HELLO from ``sender`` arriving at ``parent`` (None: the root); return the
        learners below the child. ``subtree`` is the HELLO's field (tree nodes send it)."""
        here = "the root" if parent is None else f"tree node {parent}"
        node_id = wire.node_id(sender)
        if node_id is None:
            if subtree is not None:
                raise ProtocolViolation(f"learner {sender} sent a subtree; only tree nodes do")
            if parent is not None and sender in self.node(parent).learners:
                return frozenset((sender,))
            if not 0 <= sender < self.n_learners:
                raise ProtocolViolation(
                    f"learner id {sender} is out of range 0..{self.n_learners - 1} (sync.learners)"
                )
            raise ProtocolViolation(
                f"learner {sender} belongs under tree node {self.leaf_of(sender).id}, not "
                f"{here} (architecture.kind=adv): point it at that leaf's endpoint"
            )
        if not 0 <= node_id < len(self.nodes) or self.nodes[node_id].parent != parent:
            mine = _ids(n.id for n in self.children_of(parent)) or "none"
            raise ProtocolViolation(
                f"tree node {node_id} is not a child of {here} in this "
                f"config's tree (its children: nodes {mine}); is it "
                "running another config or pointed at the wrong parent?"
            )
        spec = self.nodes[node_id]
        if subtree is None or sorted(subtree) != sorted(spec.subtree):
            raise ProtocolViolation(
                f"tree node {node_id} says it serves learners {subtree}; this config places "
                f"learners {sorted(spec.subtree)} below it (is it running another config?)"
            )
        return spec.subtree

    @staticmethod
    def check_clock(sender: int, entries, below: frozenset) -> None:
        """A relayed sum may only contain gradients of learners below its sender, each once
        (a learner waits for the answer to its push, so it has one gradient in flight)."""
        seen = set()
        for learner, _ts in entries:
            if learner not in below:
                raise ProtocolViolation(
                    f"{wire.sender_name(sender)} relayed a gradient of learner {learner}, which "
                    f"is not below it (its learners: {_ids(sorted(below))})"
                )
            if learner in seen:
                raise ProtocolViolation(
                    f"{wire.sender_name(sender)} relayed two gradients of "
                    f"learner {learner} in one sum"
                )
            seen.add(learner)


def _ids(ids) -> str:
    return ",".join(map(str, ids))


def plan(cfg) -> Tree:
    """The tree ``cfg.architecture`` describes (kind adv); see the module docstring."""
    a, lam = cfg.architecture, cfg.sync.learners
    groups = a.leaves or [list(range(i, min(i + a.fanout, lam))) for i in range(0, lam, a.fanout)]
    nodes: list[dict] = []
    level = []
    for g in groups:
        nodes.append(
            dict(
                id=len(nodes),
                level=1,
                parent=None,
                children=(),
                learners=tuple(g),
                subtree=frozenset(g),
            )
        )
        level.append(nodes[-1])
    for lvl in range(2, a.depth + 1):
        upper = []
        for i in range(0, len(level), a.fanout):
            kids = level[i : i + a.fanout]
            node = dict(
                id=len(nodes),
                level=lvl,
                parent=None,
                children=tuple(k["id"] for k in kids),
                learners=(),
                subtree=frozenset().union(*(k["subtree"] for k in kids)),
            )
            for k in kids:
                k["parent"] = node["id"]
            nodes.append(node)
            upper.append(node)
        level = upper
    return Tree(tuple(NodeSpec(**n) for n in nodes), lam)


def tree_of(cfg) -> Tree | None:
    """The tree of tree nodes ``cfg`` plans (:func:`plan`; ``architecture.kind`` adv or
    advstar, whose learners also talk to leaf nodes), or None for Rudra-base (one PS, no
    tree). Pure."""
    return None if cfg.architecture.kind == "base" else plan(cfg)


def learner_groups(tree: Tree, per_process: int) -> list[list[int]]:
    """Learner ids per process: each leaf's learners in groups of ``per_process`` (a process
    talks to one leaf, on the leaf's host)."""
    out = []
    for leaf in tree.leaves:
        ids = list(leaf.learners)
        out += [ids[i : i + per_process] for i in range(0, len(ids), per_process)]
    return out


def node_endpoints(cfg, processes, run_dir: Path) -> dict[str, str]:
    """``{"nodeK": endpoint}`` (and ``nodeKsI`` for range I's tree) for ``rudra-zmq run``, of
    the tree node ``processes`` ((label, node, server) each: ``shape.ClusterShape.
    tree_processes``): leaves on ipc sockets in the run directory (their learners are on the
    same host), inner nodes on a free tcp port of runtime.host (or ipc when
    runtime.transport is ipc). Raises ConfigError."""
    eps = {}
    for label, n, _ in processes:  # a leaf's learners share its host: ipc
        ipc = n.is_leaf or cfg.runtime.transport == "ipc"
        eps[label] = plan_endpoints.server_endpoint(cfg, run_dir, label, ipc)
    return eps


# ----------------------------------------------------------------------------- Rudra-adv*
def broadcast_upstream(cfg, learner: int) -> int | None:
    """The member that learner ``learner`` receives weight versions from in the advstar
    broadcast (None: the root PS). Members form a k-ary tree in learner order, k =
    ``architecture.broadcast_fanout``: the root feeds learners 0..k-1 and learner i feeds
    k(i+1) .. k(i+1)+k-1, so k = 1 is the chain root -> 0 -> 1 -> ... -> λ-1."""
    k = cfg.architecture.broadcast_fanout
    return None if learner < k else learner // k - 1


def broadcast_children(cfg, learner: int | None) -> list[int]:
    """The learners that ``learner`` (None: the root) forwards every version to."""
    k, lam = cfg.architecture.broadcast_fanout, cfg.sync.learners
    first = 0 if learner is None else k * (learner + 1)
    return list(range(first, min(first + k, lam)))


def describe_broadcast(cfg) -> list[str]:
    """One line per member with children, e.g. ``broadcast: root -> learners 0``."""
    lines = []
    for who in [None, *range(cfg.sync.learners)]:
        kids = broadcast_children(cfg, who)
        if kids:
            name = "root" if who is None else f"learner {who}"
            lines.append(f"broadcast: {name} -> learner{'s' if len(kids) > 1 else ''} {_ids(kids)}")
    return lines


def broadcast_endpoints(cfg, run_dir: Path) -> dict[str, str]:
    """``{"bcast": root, "bcastI": learner I}`` for ``rudra-zmq run``: a free tcp port of
    runtime.host (ipc sockets in the run directory when runtime.transport is ipc) for the
    root and every learner that has children in the broadcast. Raises ConfigError."""
    eps = {}
    for who in [None, *range(cfg.sync.learners)]:
        if not broadcast_children(cfg, who):
            continue
        label = "bcast" if who is None else f"bcast{who}"
        eps[label] = plan_endpoints.server_endpoint(cfg, run_dir, label)
    return eps
