"""Rudra-adv* broadcast: versions travel from the root through a chain (or tree) of members,
chunk by chunk, bit-identical and in order; credit bounds every link; bad chunks are refused."""

import hashlib
import time

import msgpack
import numpy as np
import pytest
import zmq

from cluster import small_config
from rudra_zmq import topology, wire
from rudra_zmq.broadcast.link import default_window
from rudra_zmq.broadcast.member import BroadcastMember
from rudra_zmq.broadcast.root import BroadcastRoot
from rudra_zmq.config import ConfigError
from rudra_zmq.wire import Kind

pytestmark = pytest.mark.timeout(60)
NUMEL, CHUNK = 10_000, 8192  # 5 chunks of at most 2,048 floats per version
TOTAL = 5


class OwningContext(zmq.Context):
    """A context that also closes the roots and members a test made, newest first."""

    owned: list

    def own(self, thing):
        self.owned.append(thing)


@pytest.fixture
def ctx():
    c = OwningContext()
    c.owned = []
    yield c
    for thing in reversed(c.owned):
        thing.close()
    c.destroy(linger=0)


def digest(chunks) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(c).tobytes() for c in chunks)).hexdigest()


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def members(root) -> set:
    """The learner ids the root's broadcast feeds (its children are kept by connection)."""
    return {c.member for c in root._fan.kids.values()}


def weights(ts):
    return np.random.default_rng(ts).standard_normal(NUMEL).astype(np.float32)


def member(ctx, i, upstream, seen=None, **kw):
    kw.setdefault("timeout_s", 20)
    m = BroadcastMember(
        ctx,
        "tcp://127.0.0.1:0",
        upstream,
        NUMEL,
        member=i,
        chunk_bytes=CHUNK,
        on_version=None if seen is None else (lambda ts, chunks: seen.append((ts, digest(chunks)))),
        **kw,
    )
    ctx.own(m)
    return m.start()


def chain(ctx, n):
    root = BroadcastRoot(ctx, "tcp://127.0.0.1:0", NUMEL, chunk_bytes=CHUNK)
    ctx.own(root)
    root.start()
    members, seen, up = [], [], root.endpoint
    for i in range(n):
        seen.append([])
        members.append(member(ctx, i, up, seen[-1], upstream_name=f"member {i - 1}"))
        up = members[-1].endpoint
    return root, members, seen


def test_a_chain_of_four_delivers_every_version_bit_identical_in_order_or_skips_superseded(ctx):
    root, members, seen = chain(ctx, 4)
    sent = {}
    for ts in range(1, 11):  # one at a time: nothing may be skipped
        w = weights(ts)
        sent[ts] = digest([w])
        root.publish(ts, w)
        w[:] = 0  # publish copied: the caller may write at once
        wait_until(lambda ts=ts: all(m.latest()[0] == ts for m in members), what=f"version {ts}")
    for log in seen:
        assert log == [(ts, sent[ts]) for ts in range(1, 11)]
    for ts in range(11, 61):  # a burst: links skip what was superseded
        sent[ts] = digest([weights(ts)])
        root.publish(ts, weights(ts))
    wait_until(lambda: all(m.latest()[0] == 60 for m in members), what="version 60")
    for i, log in enumerate(seen):
        stamps = [ts for ts, _ in log]
        assert stamps == sorted(set(stamps)) and stamps[-1] == 60, stamps
        assert all(h == sent[ts] for ts, h in log), f"member {i} got different bytes"
        if i:  # a member only has what its upstream completed
            assert set(stamps) <= {ts for ts, _ in seen[i - 1]}
    ts, w = members[3].latest()
    assert ts == 60 and np.array_equal(w, weights(60))
    dst = np.zeros(NUMEL, np.float32)
    assert members[2].copy_latest_into(dst, newer_than=59) == 60
    assert np.array_equal(dst, weights(60))
    assert members[2].copy_latest_into(dst, newer_than=60) == 60  # nothing newer: no copy
    assert all(m.refused == 0 and m.aborted == 0 for m in members)


def test_a_member_whose_consumer_never_adopts_still_forwards_everything(ctx):
    root, members, seen = chain(ctx, 3)
    for ts in range(1, 31):
        root.publish(ts, weights(ts))
        wait_until(lambda ts=ts: members[2].latest()[0] == ts, what=f"version {ts}")
    wait_until(lambda: members[1].latest()[0] == 30, what="member 1's bookkeeping")
    # nobody ever read member 1's versions: it forwarded all 30 versions (150 chunks) anyway,
    # and holds only the newest complete one
    assert members[1].received == members[2].received == 30 * TOTAL
    assert members[1].versions == 30 and members[1]._partial is None
    assert [ts for ts, _ in seen[2]] == list(range(1, 31))


def test_a_stalled_link_holds_at_most_its_credit_and_nobody_else_waits_for_it(ctx):
    root = BroadcastRoot(ctx, "tcp://127.0.0.1:0", NUMEL, chunk_bytes=CHUNK)
    ctx.own(root)
    root.start()
    fast_seen = []
    fast = member(ctx, 0, root.endpoint, fast_seen)
    stalled = ctx.socket(zmq.DEALER)  # a member that grants one version, then hangs
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.RCVTIMEO, 5000)
    stalled.setsockopt(zmq.ROUTING_ID, b"stalled")
    stalled.connect(root.endpoint)
    stalled.send_multipart(wire.encode(Kind.CREDIT, 7, 1, credit=TOTAL, reset=True))
    wait_until(lambda: {0, 7} <= members(root), what="both children's credit")
    for ts in range(1, 41):
        t0 = time.monotonic()
        root.publish(ts, weights(ts))
        assert time.monotonic() - t0 < 1.0, "publish must never wait for the network"
        wait_until(lambda ts=ts: fast.latest()[0] == ts, what=f"version {ts} at the fast member")
    assert [ts for ts, _ in fast_seen] == list(range(1, 41)), "the stalled link made it skip"
    queued = []
    while stalled.poll(300):
        queued.append(wire.decode(stalled.recv_multipart()))
    assert [(m.ts, m.fields["chunk"]) for m in queued] == [(1, c) for c in range(TOTAL)]
    assert [c.credit for c in root._fan.kids.values() if c.member == 7] == [0]
    # credit again: it gets the newest version whole, having skipped only superseded ones
    stalled.send_multipart(wire.encode(Kind.CREDIT, 7, 2, credit=TOTAL, reset=False))
    got = (
        [wire.decode(stalled.recv_multipart()) for _ in range(TOTAL)] if stalled.poll(5000) else []
    )
    assert [(m.ts, m.fields["chunk"]) for m in got] == [(40, c) for c in range(TOTAL)]
    assert digest([m.payloads[0] for m in got]) == digest([weights(40)])
    stalled.close(0)


class FakeUpstream:
    """A raw ROUTER standing in for a member's upstream, to send it anything."""

    def __init__(self, ctx):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ident = None

    def credit(self):
        assert self.sock.poll(5000), "the member granted no credit"
        self.ident, *frames = self.sock.recv_multipart()
        return wire.decode(frames)

    def send(self, frames):
        self.sock.send_multipart([self.ident, *frames])

    def version(self, ts, w):
        for i, off in enumerate(range(0, NUMEL, CHUNK // 4)):
            part = w[off : off + CHUNK // 4]
            self.send(
                wire.encode(
                    Kind.BCAST,
                    wire.SENDER_PS,
                    i,
                    ts,
                    payloads=[part],
                    chunk=i,
                    offset=off,
                    total=TOTAL,
                )
            )


def bcast(ts=2, chunk=0, offset=0, total=TOTAL, n=2048, sender=wire.SENDER_PS, dtype=np.float32):
    return wire.encode(
        Kind.BCAST,
        sender,
        1,
        ts,
        payloads=[np.ones(n, dtype)],
        chunk=chunk,
        offset=offset,
        total=total,
    )


def test_invalid_broadcast_messages_are_refused_without_touching_the_newest_version(ctx):
    up = FakeUpstream(ctx)
    m = member(ctx, 1, up.endpoint, children=[3])
    first = up.credit()
    assert first.sender == 1 and first.fields == {
        "credit": default_window(NUMEL, CHUNK),
        "reset": True,
    }
    child = ctx.socket(zmq.DEALER)
    child.setsockopt(zmq.LINGER, 0)
    child.setsockopt(zmq.RCVTIMEO, 5000)
    child.connect(m.endpoint)
    child.send_multipart(wire.encode(Kind.CREDIT, 3, 1, credit=10, reset=True))
    time.sleep(0.2)
    up.version(1, weights(1))
    wait_until(lambda: m.latest()[0] == 1, what="version 1")
    got = [child.recv_multipart() for _ in range(TOTAL)]
    assert digest([wire.decode(f).payloads[0] for f in got]) == digest([weights(1)])
    header = msgpack.unpackb(bcast()[0])
    bad = {
        "garbage header": [b"\xc1not msgpack", b"x"],
        "pickled payload": [msgpack.packb({**header, "p": [["O", 8]]}), b"\x80\x04K\x01."],
        "int64 payload": bcast(dtype=np.int64),
        "length not as declared": [bcast()[0], np.ones(7, np.float32)],
        "two payloads": [
            msgpack.packb({**header, "p": [["f4", 1], ["f4", 1]]}),
            np.ones(1, np.float32),
            np.ones(1, np.float32),
        ],
        "chunk 0 not at offset 0": bcast(offset=8),
        "chunk without its predecessors": bcast(chunk=2, offset=4096),
        "no chunks": bcast(total=0),
        "chunk index beyond total": bcast(chunk=5),
        "beyond the model": bcast(chunk=0, total=1, n=NUMEL + 1),
        "last chunk short of the model": bcast(chunk=0, total=1, n=NUMEL - 1),
        "stale version": bcast(ts=1),
        "from a learner": bcast(sender=3),
        "a request kind": wire.encode(Kind.PULL, wire.SENDER_PS, 1, 0),
    }
    for frames in bad.values():
        up.send(frames)
    wait_until(lambda: m.refused == len(bad), what="every bad message refused")
    assert m.latest()[0] == 1 and digest([m.latest()[1]]) == digest([weights(1)])
    assert m.versions == 1 and m._partial is None
    assert not child.poll(300), "a refused chunk must not be forwarded"
    # a version in progress survives an intruding bad chunk, and the link still works
    w2 = weights(2)
    up.send(
        wire.encode(
            Kind.BCAST, wire.SENDER_PS, 1, 2, payloads=[w2[:2048]], chunk=0, offset=0, total=TOTAL
        )
    )
    up.send(bcast(ts=2, chunk=2, offset=2048))
    up.version(2, w2)  # restarts at chunk 0: the partial one is abandoned, not mixed
    wait_until(lambda: m.latest()[0] == 2, what="version 2")
    assert digest([m.latest()[1]]) == digest([w2]) and m.aborted == 1
    assert m.refused == len(bad) + 1
    credits = 0
    while up.sock.poll(200):
        credits += up.credit().fields["credit"]
    # every message but a STOP returns its credit: version 1, the bad ones, 2 + version 2
    assert credits == TOTAL + len(bad) + 2 + TOTAL
    child.close(0)


def test_a_member_whose_upstream_is_silent_times_out_naming_it(ctx):
    nobody = "tcp://127.0.0.1:9"  # discard port: nothing answers
    m = member(ctx, 3, nobody, timeout_s=0.5, upstream_name="learner 2")
    wait_until(lambda: m.error is not None, what="the timeout")
    with pytest.raises(
        TimeoutError,
        match=r"learner 3: no weights from learner 2 at "
        r"tcp://127.0.0.1:9 for 0.5 s \(runtime.timeout_s\)",
    ):
        m.check()


def test_stop_travels_down_the_chain_and_ends_the_timeout(ctx):
    root, members, _ = chain(ctx, 3)
    for m in members:
        m.timeout_s = 0.5
    root.publish(1, weights(1), done=True, reason="training finished at epoch 2.00")
    wait_until(lambda: all(m.stopped for m in members), what="STOP at every member")
    assert all(m.stop_reason == "training finished at epoch 2.00" for m in members)
    assert all(m.latest()[0] == 1 for m in members)
    time.sleep(1.0)
    for m in members:
        m.check()  # silent upstream after STOP is not an error


def test_advstar_config_is_spelled_advstar_and_is_asynchronous():
    cfg = small_config(
        "architecture.kind=advstar",
        "sync.protocol=softsync",
        "sync.learners=5",
        "architecture.broadcast_fanout=2",
    )
    assert [topology.broadcast_upstream(cfg, i) for i in range(5)] == [None, None, 0, 0, 1]
    assert topology.broadcast_children(cfg, None) == [0, 1]
    assert topology.broadcast_children(cfg, 1) == [4] and topology.broadcast_children(cfg, 2) == []
    chain_cfg = small_config("architecture.kind=advstar", "sync.protocol=async")
    assert [topology.broadcast_upstream(chain_cfg, i) for i in range(2)] == [None, 0]
    with pytest.raises(ConfigError, match="write it advstar"):
        small_config("architecture.kind=adv*", "sync.protocol=softsync")
    with pytest.raises(ConfigError, match="hardsync is not supported.*architecture.kind=adv"):
        small_config("architecture.kind=advstar", "sync.protocol=hardsync")
    with pytest.raises(ConfigError, match="broadcast_fanout must be >= 1"):
        small_config(
            "architecture.kind=advstar", "sync.protocol=async", "architecture.broadcast_fanout=0"
        )


def test_role_commands_ask_for_the_broadcast_endpoints_advstar_needs(tmp_path, capsys):
    from rudra_zmq import cli

    cfg = tmp_path / "c.yaml"
    cfg.write_text("architecture: {kind: advstar, fanout: 2}\nsync: {protocol: async}\n")
    base = ["--config", str(cfg)]
    assert cli.main(["ps", *base, "--bind", "tcp://h:1"]) == 2
    assert (
        "--bcast-bind (the endpoint the broadcast root binds) is needed" in capsys.readouterr().err
    )
    learner = ["learner", *base, "--id", "0,1", "--ps", "tcp://h:1", "--data", "tcp://h:2"]
    assert cli.main([*learner, "--bcast-upstream", "tcp://h:5"]) == 2
    assert (
        "one --bcast-upstream and one --bcast-bind endpoint per learner id (2)"
        in capsys.readouterr().err
    )
    assert cli.main([*learner, "--bcast-upstream", "tcp://h:5,tcp://h:6"]) == 2
    assert (
        "learner 0 forwards the broadcast to learners 1: give it a --bcast-bind"
        in capsys.readouterr().err
    )


# ----------------------------------------------------------------------------- PS and tree node
SIG, SMALL = "feedface", 12


def advstar(*overrides):
    return small_config(
        "architecture.kind=advstar",
        "sync.protocol=softsync",
        "sync.n=1",
        "architecture.fanout=2",
        *overrides,
    )


class FakeNode:
    """A raw DEALER speaking as tree node 0 (learners 0, 1) to the root."""

    def __init__(self, ctx, endpoint):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"node0")
        self.sock.connect(endpoint)
        self.seq = 0

    def request(self, kind, ts=0, payloads=(), **fields):
        self.seq += 1
        self.sock.send_multipart(
            wire.encode(kind, wire.node_sender(0), self.seq, ts, 0, payloads, **fields)
        )
        assert self.sock.poll(5000), "no reply"
        return wire.decode(self.sock.recv_multipart())


def test_the_root_answers_relays_ack_and_broadcasts_every_new_version(ctx):
    from cluster import running
    from rudra_zmq.server.ps import ParameterServer

    w0 = np.arange(SMALL, dtype=np.float32)
    ps = ParameterServer(
        advstar(),
        "tcp://127.0.0.1:0",
        ctx=ctx,
        broadcast="tcp://127.0.0.1:0",
        model=(w0, [(0, SMALL, 1.0, 1.0)], SIG),
    )
    seen = []
    m = BroadcastMember(
        ctx,
        None,
        ps.weights_out.endpoint,
        SMALL,
        member=0,
        timeout_s=20,
        on_version=lambda ts, chunks: seen.append((ts, digest(chunks))),
    )
    ctx.own(m)
    m.start()
    with running(ps) as errors:
        node = FakeNode(ctx, ps.endpoint)
        welcome = node.request(Kind.HELLO, model=SIG, numel=SMALL, subtree=[0, 1])
        assert welcome.kind == Kind.WELCOME
        wait_until(lambda: m.latest()[0] == 0, what="version 0 (the initial weights)")
        g = np.ones(SMALL, np.float32)
        for ts in (0, 1, 2):
            reply = node.request(Kind.RELAY, ts, [g + ts], clock=[[0, ts], [1, ts]])
            assert reply.kind == Kind.ACK and reply.ts == ts + 1 and not reply.payloads
            wait_until(lambda ts=ts: m.latest()[0] == ts + 1, what=f"version {ts + 1}")
            assert np.array_equal(m.latest()[1], ps.state.w), (
                "the broadcast carries the PS's weights"
            )
        assert [ts for ts, _ in seen] == [0, 1, 2, 3] and not errors
        assert not np.array_equal(ps.state.w, w0)


def test_an_advstar_leaf_relays_pushes_answers_ack_and_serves_no_weights(ctx):
    from cluster import FakeLearner, running
    from rudra_zmq.tree.node import TreeNode

    parent = ctx.socket(zmq.ROUTER)
    parent.setsockopt(zmq.LINGER, 0)
    parent_ep = f"tcp://127.0.0.1:{parent.bind_to_random_port('tcp://127.0.0.1')}"
    node = TreeNode(advstar(), 0, "tcp://127.0.0.1:0", parent_ep, ctx=ctx)
    with running(node) as errors:
        learners = [FakeLearner(ctx, node.endpoint, i) for i in (0, 1)]
        learners[0].send(Kind.HELLO, model=SIG, numel=SMALL)
        assert parent.poll(5000)
        ident, *frames = parent.recv_multipart()
        assert wire.decode(frames).kind == Kind.HELLO
        parent.send_multipart(
            [
                ident,
                *wire.encode(
                    Kind.WELCOME,
                    wire.SENDER_PS,
                    1,
                    0,
                    7,
                    [np.zeros(SMALL, np.float32)],
                    learners=2,
                    protocol="softsync",
                ),
            ]
        )
        assert learners[0].recv().kind == Kind.WELCOME
        learners[1].hello(SIG, SMALL)
        learners[1].send(Kind.PULL, 0)
        refused = learners[1].recv()
        assert refused.kind == Kind.ERROR and "serves no weights" in refused.fields["error"]
        # a version newer than any the node has seen (it came by broadcast): accepted
        learners[0].send(Kind.PUSH, 5, [np.ones(SMALL, np.float32)])
        assert parent.poll(5000)
        ident, *frames = parent.recv_multipart()
        relay = wire.decode(frames)
        assert relay.kind == Kind.RELAY and relay.clock == [(0, 5)]
        parent.send_multipart([ident, *wire.encode(Kind.ACK, wire.SENDER_PS, 2, 6, 7)])
        ack = learners[0].recv()
        assert ack.kind == Kind.ACK and not ack.payloads and node.ts == 6
        for lr in learners:
            lr.close()
    assert not errors
    parent.close(0)


def test_a_sender_serves_only_its_planned_children_with_sane_credit(ctx):
    root = BroadcastRoot(ctx, "tcp://127.0.0.1:0", NUMEL, chunk_bytes=CHUNK, children=[0])
    ctx.own(root)
    root.start()
    socks = []
    for member, credit in ((5, 4), (0, 0), (0, 10**6), (0, TOTAL)):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.setsockopt(zmq.ROUTING_ID, f"m{member}-{credit}".encode())
        s.connect(root.endpoint)
        s.send_multipart(wire.encode(Kind.CREDIT, member, 1, credit=credit, reset=True))
        socks.append(s)
    wait_until(lambda: root._fan.invalid == 3 and 0 in members(root), what="the credits")
    assert sorted(members(root)) == [0]  # a stranger, no credit, absurd credit: refused
    root.publish(1, weights(1))
    assert [wire.decode(socks[3].recv_multipart()).fields["chunk"] for _ in range(TOTAL)] == list(
        range(TOTAL)
    )
    assert not any(s.poll(200) for s in socks[:3])
    for s in socks:
        s.close(0)


def test_a_member_closed_after_stop_tells_a_planned_child_that_connects_late(ctx):
    """A learner that started after training ended still gets STOP from its upstream member
    (which lingers up to STOP_LINGER_S for its planned children), not a 120 s timeout."""
    import threading

    root = BroadcastRoot(ctx, "tcp://127.0.0.1:0", NUMEL, chunk_bytes=CHUNK)
    ctx.own(root)
    root.start()
    m = member(ctx, 1, root.endpoint, children=[2])
    closer = threading.Thread(target=m.close, args=("training finished at epoch 1.00",))
    closer.start()  # nobody connected yet: it waits for learner 2
    time.sleep(0.5)
    late = ctx.socket(zmq.DEALER)
    late.setsockopt(zmq.LINGER, 0)
    late.setsockopt(zmq.RCVTIMEO, 5000)
    late.connect(m.endpoint)
    late.send_multipart(wire.encode(Kind.CREDIT, 2, 1, credit=TOTAL, reset=True))
    msg = wire.decode(late.recv_multipart())
    assert msg.kind == Kind.STOP and msg.fields["reason"] == "training finished at epoch 1.00"
    closer.join(10)
    assert not closer.is_alive()  # told everyone: closed before the linger ran out
    late.close(0)
