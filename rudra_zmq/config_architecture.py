"""The architecture section's checks (``architecture.*`` against ``sync.*``), called by
``Config.validate``: what a PS tree or the broadcast can run. Pure."""

from __future__ import annotations

from .sync import check_protocol
from .typed_yaml import ConfigError, one_of

MAX_PARTS = 256  # parts of one server's range (each one message each way per round)


def check_parts(self) -> None:
    """Raise ConfigError unless ``wire.parts`` can run: 1 (whole messages), or 2..MAX_PARTS
    under hardsync with architecture.kind=base and a protocol fixed for the run. Pure."""
    p, s, a = self.wire.parts, self.sync, self.architecture
    if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= MAX_PARTS:
        raise ConfigError(f"wire.parts must be a whole number from 1 to {MAX_PARTS}, got {p!r}")
    b = self.wire.bucket_mb
    if isinstance(b, bool) or not isinstance(b, int | float) or not 0 < b < 1 << 20:
        raise ConfigError(
            f"wire.bucket_mb must be a size in MiB > 0 (below 1 TiB; DDP's default is 25), "
            f"got {b!r}"
        )
    if p == 1:
        return
    why = None
    if s.protocol != "hardsync":
        why = (
            f"sync.protocol={s.protocol}: a part is answered once every learner's part is in, "
            "which only hardsync's rounds have (softsync's learners push at their own times, "
            "so their links overlap already)"
        )
    elif s.schedule or s.target_staleness is not None:
        why = "sync.schedule and sync.target_staleness leave hardsync during the run"
    elif a.kind != "base":
        why = f"architecture.kind={a.kind}: tree nodes and the broadcast send whole vectors"
    if why:
        raise ConfigError(f"wire.parts={p} needs hardsync rounds; {why}: set wire.parts=1")


def most_parts(cfg) -> int:
    """The most parts any range may be cut in under ``cfg`` (for queue limits). Pure."""
    return 1 if cfg.wire.parts == 1 else MAX_PARTS


def validate_architecture(self) -> None:
    """Raise ConfigError, naming the value, unless ``self.architecture`` (a Config's) can run
    with its sync section: the tree's shape, leaves, relay, and the protocols a tree or the
    broadcast runs. Pure."""
    a, lam = self.architecture, self.sync.learners
    if a.kind == "adv*":
        raise ConfigError(
            "architecture.kind is 'adv*'; write it advstar (the YAML-friendly "
            "spelling of Rudra-adv*)"
        )
    one_of("architecture.kind", a.kind, ("base", "adv", "advstar"))
    one_of("architecture.relay", a.relay, ("eager", "gather"))
    for key, val in (
        ("architecture.servers", a.servers),
        ("architecture.fanout", a.fanout),
        ("architecture.depth", a.depth),
        ("architecture.broadcast_fanout", a.broadcast_fanout),
    ):
        if val < 1:
            raise ConfigError(f"{key} must be >= 1, got {val}")
    check_parts(self)
    if a.servers > 1 and a.kind == "advstar":
        raise ConfigError(
            f"architecture.servers={a.servers} with architecture.kind=advstar: the adv* "
            "broadcast serves one root; with K servers each one's weight traffic is already "
            "1/K and the gradients bind, which adv* does not change (measured: "
            "bench/RESULTS.md, Rudra-adv with one tree per range); use architecture.kind="
            "adv (one tree per range) or base, or architecture.servers=1"
        )
    if a.servers > 1 and a.leaf_shm:
        raise ConfigError(
            f"architecture.leaf_shm with architecture.servers={a.servers}: a learner's "
            "shared-memory slots hold the whole vector, and each range has its own leaf; "
            "set architecture.leaf_shm=false, or architecture.servers=1"
        )
    if a.servers > 1 and self.sync.target_staleness is not None:
        raise ConfigError(
            f"sync.target_staleness steers the protocol by the server's own <sigma>; with "
            f"architecture.servers={a.servers} each server would steer apart: use "
            "architecture.servers=1, or a fixed protocol"
        )
    if a.kind != "base" and (self.sync.schedule or self.sync.target_staleness is not None):
        raise ConfigError(
            f"sync.schedule and sync.target_staleness change the protocol during the run; "
            f"architecture.kind={a.kind}'s nodes follow the protocol fixed at start: use "
            "architecture.kind=base"
        )
    try:  # advstar's servers answer at once: a protocol that holds replies cannot run
        check_protocol(
            self.sync.protocol,
            self.sync.n,
            lam,
            broadcast=a.kind == "advstar",
            max_staleness=self.sync.max_staleness,
            tree=a.kind == "adv",
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if a.kind == "base":
        if a.leaves:
            raise ConfigError(
                "architecture.leaves is used only by the PS tree: set "
                "architecture.kind=adv, or remove architecture.leaves"
            )
        if a.leaf_shm:
            raise ConfigError(
                "architecture.leaf_shm shares memory between a leaf tree node "
                "and its learners; with architecture.kind=base there are no "
                "leaves: set architecture.kind=adv (or advstar), or leaf_shm "
                "false"
            )
        return
    if self.optimizer.lr_policy == "per_gradient":
        raise ConfigError(
            "optimizer.lr_policy per_gradient needs every gradient separately "
            "at the root; a PS tree (architecture.kind=adv) relays sums: use "
            "constant or staleness"
        )
    if a.leaves:
        flat = [i for leaf in a.leaves for i in leaf]
        empty = [k for k, leaf in enumerate(a.leaves) if not leaf]
        if empty:
            raise ConfigError(
                f"architecture.leaves[{empty[0]}] is empty; every leaf needs at least one learner"
            )
        bad = sorted({i for i in flat if not 0 <= i < lam})
        twice = sorted({i for i in flat if flat.count(i) > 1})
        missing = sorted(set(range(lam)) - set(flat))
        if bad or twice or missing:
            raise ConfigError(
                f"architecture.leaves must place every learner 0..{lam - 1} "
                f"(sync.learners={lam}) in exactly one leaf; got {a.leaves}: "
                + "; ".join(
                    f"{what} {ids}"
                    for what, ids in (
                        ("out of range", bad),
                        ("in two leaves", twice),
                        ("in no leaf", missing),
                    )
                    if ids
                )
            )
