"""A link of the emulated LAN in bytes (a tc rate in bytes per second, the bytes of one
parameter on the wire) and the columns every ``lan-table1`` row has. Pure; shared by
``lan_table1`` and ``lan_shards``."""

from __future__ import annotations

import statistics

from .. import wire

ALLREDUCE = "gloo-allreduce"  # what a user would run instead (lan_allreduce.py); not Table 1
DDP = "ddp"  # ... and the real thing: DistributedDataParallel on the synthetic model (lan_ddp.py)
BASELINES = (ALLREDUCE, DDP)  # cases without a parameter server
MIB = 2**20


def wire_bytes(wire_dtype: str) -> int:
    """Bytes per parameter on the wire for a ``wire.*_dtype`` value."""
    return wire.PAYLOAD_DTYPES[wire.WIRE_DTYPES[wire_dtype]].itemsize


# tc's rate units in bytes per second ("bit" units are bits, "bps" units bytes); longest first
_RATE_UNITS = {
    "gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8,
    "gbps": 1e9, "mbps": 1e6, "kbps": 1e3, "bit": 1 / 8, "bps": 1.0,
}  # fmt: skip


def row_head(case: str, a, wire_dtype: str, s: float, epoch_s: list, bound) -> dict:
    """The columns every row has: ``case`` (named as the caller chose), the setting ``a``,
    ``s`` seconds per epoch (each epoch's in ``epoch_s``) and the link ``bound`` (or None)."""
    return {
        "bench": "table1",
        "case": case,
        "wire_dtype": wire_dtype,
        "learners": a.hosts * a.per_host,
        "hosts": a.hosts,
        "per_host": a.per_host,
        "params": a.params,
        "rate": a.rate,
        "compute_ms": a.compute_ms,
        "retry_s": a.retry_s,
        "epoch_gradients": a.epoch_gradients,
        "s_per_epoch": s,
        "epoch_s": epoch_s,
        "bound_s_per_epoch": bound,
        "of_bound": None if bound is None else bound / s,
    }


def deadline_s(bound_s_per_epoch: float | None, epochs: int) -> float:
    """How long a case may run before the bench stops it as hung: ten times its link bound
    over every epoch, and never less than 600 s (a long ``--epochs`` run is not a hang). Pure."""
    return max(600.0, 10 * epochs * (bound_s_per_epoch or 0.0))


def traffic(timed: list[dict], grads: int) -> dict:
    """The root's columns over the ``timed`` epochs (each with rx_bytes, tx_bytes, updates,
    mean_sigma) that took ``grads`` gradients: medians per epoch, bytes per gradient."""
    return {
        "root_rx_bytes_per_epoch": statistics.median(e["rx_bytes"] for e in timed),
        "root_tx_bytes_per_epoch": statistics.median(e["tx_bytes"] for e in timed),
        "root_rx_bytes_per_gradient": sum(e["rx_bytes"] for e in timed) / grads,
        "updates_per_epoch": statistics.median(e["updates"] for e in timed),
        "mean_sigma": statistics.fmean(e["mean_sigma"] for e in timed),
    }


RETRIES = ("checks", "resent", "late", "rejoins")  # the learners' counts (synthetic_learner)


def retries(servers: list[dict], learners: list[dict]) -> dict:
    """What went slow or was lost in a case, summed: the servers' ``undelivered`` replies
    and ``duplicates``, the learners' CHECKs, resends, late answers and rejoins (each
    learner process's report holds its learners'). Pure."""
    out = {k: sum(ps.get(k, 0) for ps in servers) for k in ("undelivered", "duplicates")}
    each = [s for proc in learners for s in proc["learners"]]
    out.update({k: sum(s.get(k, 0) for s in each) for k in RETRIES})
    return out


def pushed_in_backward(learners: list[dict]) -> dict:
    """Messages the product's learners sent from inside backward and after it, summed
    (``synthetic_roles learners --product``; {} for other learners). Pure."""
    each = [s for proc in learners for s in proc["learners"] if s.get("product")]
    if not each:
        return {}
    return {
        "sent_during_backward": sum(s["sent_during_backward"] for s in each),
        "sent_after_backward": sum(s["sent_after_backward"] or 0 for s in each),
        "streamed": all(s["sent_after_backward"] is not None for s in each),
        # wire.priority: modules whose forward ran before their step's whole reply was in
        "layers_ahead": sum(s.get("layers_ahead") or 0 for s in each),
    }


def retries_text(r: dict) -> str:
    """``retries``' counts that are not 0, for a result line ("" when none). Pure."""
    said = [f"{k} {r[k]}" for k in ("undelivered", "duplicates", *RETRIES) if r.get(k)]
    return f"  [{', '.join(said)}]" if said else ""


def parse_rate(rate: str) -> float:
    """A tc rate ("1gbit", "20mbit", "500kbit", "10mbps") in bytes per second. Raises
    ValueError naming the rate where it is not one."""
    for unit, per in _RATE_UNITS.items():
        if rate.lower().endswith(unit):
            try:
                value = float(rate[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * per
            break
    raise ValueError(f"--rate {rate!r}: give a positive tc rate, e.g. 1gbit or 20mbit")
