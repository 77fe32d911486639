"""What the statistics server takes in: its PULL socket (``receiver``), who may send what (the
parameter server, the only sender of EVALs, proves itself by its CURVE key or the run's token)
and which records a METRIC may carry (a ``batch`` is expanded; some kinds only this server or
the PS write).

The checks are pure: they say why a message or a record is refused; the server counts and logs
the refusals.
"""

from __future__ import annotations

import zmq

from .. import security, transport, wire
from ..wire import Kind

RECV_HWM = 2  # per connection on the server; adds to the sender's queue
OWN_RECORDS = {"eval", "start", "resume"}  # written by this server only
PS_RECORDS = {"done", "update", "ps", "members", "restart"}  # by the parameter server only


def receiver(ctx: zmq.Context, cfg) -> zmq.Socket:
    """The statistics server's PULL socket (not bound). EVALs come in chunks of
    ``runtime.chunk_mib``. No keepalive probes: a server that only receives needs no news of
    dead senders (and no socket sends ZMTP heartbeats: docs/wire.md, "Liveness")."""
    sock = transport.make_socket(
        ctx, zmq.PULL, hwm=RECV_HWM, max_bytes=transport.frame_limit(cfg.runtime.chunk_mib << 20)
    )
    sock.setsockopt(zmq.TCP_KEEPALIVE, 0)
    return sock


def forged(frames, msg: wire.Message, curve, token) -> str | None:
    """Why ``msg`` (decoded from ``frames``) cannot be from the sender it names, or None. With
    CURVE (``curve``: ``transport.security()``) its key must be allowed to speak as that
    sender; without, what claims to be the PS (and every EVAL) must carry the run's ``token``
    when the server has one (``rudra-zmq run``)."""
    if curve is not None:
        if not curve.may_speak(frames[0], msg.sender):
            return f"its key may not speak as {wire.sender_name(msg.sender)}"
    elif token is not None and (msg.sender == wire.SENDER_PS or msg.kind == Kind.EVAL):
        if not security.token_matches(msg.fields.get("token"), token):
            return "it claims to be the parameter server without the run's token"
    if msg.kind == Kind.EVAL and msg.sender != wire.SENDER_PS:
        return "only the parameter server sends weights to evaluate"
    return None


def batch_items(rec: dict) -> list | None:
    """The records one METRIC's ``rec`` carries: a ``batch``'s ``items``, else ``[rec]``; None
    when a batch holds no list."""
    items = rec.get("items") if rec.get("type") == "batch" else [rec]
    return items if isinstance(items, list) else None


def record_refusal(r, sender: int) -> tuple[str, str] | None:
    """(code, message) when the record ``r`` from ``sender`` is refused: not a map with a
    string ``type`` (``bad_metric``), or a kind only this server or the PS writes
    (``forged``); None when it may be written."""
    if not isinstance(r, dict) or not isinstance(r.get("type"), str) or r["type"] == "batch":
        return "bad_metric", f"a record that is not a map with a string 'type': {r!r:.80}"
    kind = r["type"]
    if kind in OWN_RECORDS or (kind in PS_RECORDS and sender != wire.SENDER_PS):
        writer = "this server" if kind in OWN_RECORDS else "the PS"
        return "forged", (
            f"a {kind!r} record from {wire.sender_name(sender)}: only {writer} writes those"
        )
    return None
