"""Servers on ranks of their own under `rudra-zmq worker`: which rank runs what, and rank 0's
directory where they register and the learners find them (launch/server_directory.py)."""

import threading
import time

import msgpack
import pytest

from rudra_zmq.config import ConfigError, load_config
from rudra_zmq.launch import ranks, server_directory, worker
from rudra_zmq.transport import free_tcp_endpoint


def _ranks(rank, world, **more):
    env = {"RUDRA_RANK": str(rank), "RUDRA_WORLD_SIZE": str(world), "RUDRA_MASTER_ADDR": "n1"}
    env.update({f"RUDRA_{k.upper()}": str(v) for k, v in more.items()})
    return ranks.resolve({}, env)


@pytest.mark.parametrize(
    "world, parts",
    [
        # 1 + 4 ranks: every server on rank 0, as before
        (5, [("servers", None)] + [("learner", i) for i in range(4)]),
        # 3 + 4: servers 1 and 2 on ranks 1 and 2, the learners after them
        (7, [("servers", None), ("server", 1), ("server", 2)] + [("learner", i) for i in range(4)]),
    ],
)
def test_each_rank_takes_its_part_servers_first_then_learners(world, parts):
    cfg = load_config(None, ["sync.learners=4", "architecture.servers=3"])
    assert [worker.part(cfg, _ranks(r, world)) for r in range(world)] == parts
    assert worker.server_ranks(cfg, _ranks(0, world)) == (2 if world == 7 else 0)


def test_a_rank_count_that_fits_neither_way_names_both():
    cfg = load_config(None, ["sync.learners=4", "architecture.servers=3"])
    with pytest.raises(ConfigError, match="start 5 ranks .* or 7 to give servers 1..2 ranks"):
        worker.part(cfg, _ranks(1, 6))


def test_servers_of_their_own_with_a_tree_are_refused_naming_both_ways():
    cfg = load_config(None, ["sync.learners=4", "architecture.servers=2", "architecture.kind=adv"])
    with pytest.raises(ConfigError, match="architecture.kind=adv does not plan .* start 5 ranks"):
        worker.part(cfg, _ranks(5, 6))  # 4 learner processes + 2 servers


def test_role_server_needs_a_rank_among_the_server_ranks():
    cfg = load_config(None, ["sync.learners=4", "architecture.servers=2"])
    assert worker.part(cfg, _ranks(1, 6, role="server")) == ("server", 1)
    with pytest.raises(ConfigError, match="role server needs a rank from 1 to 1 and 6 ranks"):
        worker.part(cfg, _ranks(1, 5, role="server"))  # 5 ranks: no server ranks


def test_the_directory_listens_after_the_last_server_port():
    cfg = load_config(None, ["architecture.servers=3"])
    p = worker.plan(cfg, _ranks(0, 7))
    assert p.endpoints["ps2"] == "tcp://n1:29504" and p.endpoints["directory"] == "tcp://n1:29505"


def _directory(servers=3, timeout_s=60):
    cfg = load_config(None, [f"architecture.servers={servers}", f"runtime.timeout_s={timeout_s}"])
    ep = free_tcp_endpoint()
    return server_directory.Directory(cfg, ep, "tcp://n1:1", "/runs/r", "tok"), ep


@pytest.mark.parametrize(
    "request_, error",
    [
        (b"\xc1", "not a msgpack request"),
        (msgpack.packb([1, 2]), "expected a map with op"),
        (msgpack.packb({"op": "rm"}), "expected a map with op"),
        (msgpack.packb({"op": "lookup", "x": 1}), "a lookup has no other fields"),
        (msgpack.packb({"op": "register", "server": 1}), "exactly op, server and endpoint"),
        (
            msgpack.packb({"op": "register", "server": 0, "endpoint": "tcp://h:1"}),
            "server must be an integer from 1 to 2, got 0",
        ),
        (
            msgpack.packb({"op": "register", "server": True, "endpoint": "tcp://h:1"}),
            "got True",
        ),
        (
            msgpack.packb({"op": "register", "server": 1, "endpoint": "ipc:///x"}),
            "endpoint must be a tcp:// endpoint, got 'ipc:///x'",
        ),
        (msgpack.packb({"op": "failed", "server": 1}), "exactly op, server and why"),
        (msgpack.packb({"op": "failed", "server": 1, "why": ""}), "why must be a text of 1"),
        (msgpack.packb({"op": "failed", "server": 1, "why": "x" * 401}), "1 to 400 characters"),
        (msgpack.packb({"op": "failed", "server": 3, "why": "x"}), "from 1 to 2, got 3"),
        (msgpack.packb({"op": "alive"}), "'alive' has exactly op and server"),
        (msgpack.packb({"op": "bye", "server": 1, "x": 0}), "'bye' has exactly op and server"),
        (msgpack.packb({"op": "alive", "server": 0}), "from 1 to 2, got 0"),
    ],
)
def test_a_bad_request_is_answered_with_why_and_changes_nothing(request_, error):
    d, _ = _directory()
    try:
        assert error in d.answer(request_, None)["error"]
        assert d.endpoints == {0: "tcp://n1:1"} and d.failure() is None and not d.heard
    finally:
        d.stop()  # never started: closes the socket


@pytest.mark.timeout(30)
def test_servers_register_and_a_learner_finds_them_in_range_order():
    d, ep = _directory()
    d.start()
    try:
        assert d.answer(msgpack.packb({"op": "lookup"}), None) == {"missing": [1, 2]}
        found = []
        looker = threading.Thread(target=lambda: found.append(server_directory.lookup(ep, 3, 20)))
        looker.start()  # asks again until both registered
        assert server_directory.register(ep, 2, "tcp://h2:7", 5) == ("/runs/r", "tok")
        assert server_directory.register(ep, 1, "tcp://h1:7", 5) == ("/runs/r", "tok")
        looker.join(25)
        assert found == [["tcp://n1:1", "tcp://h1:7", "tcp://h2:7"]]
    finally:
        d.stop()


@pytest.mark.timeout(30)
def test_a_lookup_that_never_completes_names_the_missing_servers():
    d, ep = _directory()
    d.start()
    try:
        server_directory.register(ep, 1, "tcp://h1:7", 5)
        with pytest.raises(ConfigError, match=r"servers \[2\] have not registered after 1 s"):
            server_directory.lookup(ep, 3, 1)
    finally:
        d.stop()


@pytest.mark.timeout(30)
def test_no_directory_is_named_after_the_timeout():
    ep = free_tcp_endpoint()
    with pytest.raises(ConfigError, match=f"directory at {ep} .* no reply after 0.5 s"):
        server_directory.register(ep, 1, "tcp://h1:7", 0.5)


@pytest.mark.timeout(30)
def test_a_server_rank_that_gave_up_is_known_to_rank_0_with_why():
    d, ep = _directory()
    d.start()
    try:
        assert d.failure() is None
        assert server_directory.report_failed(ep, 2, "ps2 exited with code -9", 5)
        assert d.failure() == (
            "server 2 failed on its own rank and cannot go on (ps2 exited with code -9)"
        )
    finally:
        d.stop()
    # rank 0 gone (the run stopped anyway): the report gives up after its time, no error
    assert not server_directory.report_failed(ep, 2, "ps2 exited with code -9", 0.5)


@pytest.mark.timeout(30)
def test_a_server_rank_silent_for_the_timeout_stops_the_run_unless_it_said_bye():
    """Rank 1 registers and beats; rank 2 registers and then says nothing (its host lost):
    only rank 2 is named, once silent for runtime.timeout_s. A bye ends the watch."""
    d, ep = _directory(timeout_s=1.5)
    d.start()
    try:
        server_directory.register(ep, 1, "tcp://h1:7", 5)
        beat = server_directory.Heartbeat(ep, 1, timeout_s=1.5).start()
        assert beat.every == 0.375  # a quarter of rank 0's patience, under ALIVE_S
        server_directory.register(ep, 2, "tcp://h2:7", 5)
        assert d.failure() is None
        deadline = time.monotonic() + 10
        while d.failure() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.failure() == (
            "the rank of server 2 (tcp://h2:7) has said nothing for 1.5 s (runtime.timeout_s): "
            "its host or its launcher is gone"
        )
        d.gone.add(2)  # as if it had said bye: rank 1, beating, is not named
        assert d.failure() is None
        beat.stop()  # says bye: silence after it is no failure either
        assert 1 in d.gone
        time.sleep(1.7)
        assert d.failure() is None
    finally:
        d.stop()


def test_the_advertised_address_is_the_one_that_reaches_the_master():
    assert server_directory.advertised_address("127.0.0.1") == "127.0.0.1"


@pytest.mark.timeout(30)
def test_with_curve_only_the_ps_key_registers_and_gets_the_token(tmp_path):
    from rudra_zmq.security import auth, keys

    keys.make_run_keys(tmp_path / "keys", ["learner-0", "ps"])
    curve = auth.Curve(tmp_path / "keys")
    cfg = load_config(None, ["architecture.servers=2"])
    ep = free_tcp_endpoint()
    d = server_directory.Directory(cfg, ep, "tcp://n1:1", "/runs/r", "tok", curve).start()

    def as_learner_0(req):  # with learner 0's key
        server_directory._ask(ep, req, 5, auth.Curve(tmp_path / "keys"), 0, lambda r: True)

    try:
        with pytest.raises(
            ConfigError, match="only the ps key may send 'register', not 'learner-0'"
        ):
            as_learner_0({"op": "register", "server": 1, "endpoint": "tcp://h1:7"})
        assert server_directory.register(ep, 1, "tcp://h1:7", 5, auth.Curve(tmp_path / "keys")) == (
            "/runs/r",
            "tok",
        )
        found = server_directory.lookup(ep, 2, 5, auth.Curve(tmp_path / "keys"), sender=0)
        assert found == ["tcp://n1:1", "tcp://h1:7"]
        with pytest.raises(ConfigError, match="only the ps key may send 'failed', not 'learner-0'"):
            as_learner_0({"op": "failed", "server": 1, "why": "a learner says so"})
        assert d.failure() is None
        with pytest.raises(ConfigError, match="only the ps key may send 'alive'"):
            as_learner_0({"op": "alive", "server": 1})
        said = d.heard[1]  # the ps key's heartbeat is heard
        server_directory.Heartbeat(ep, 1, auth.Curve(tmp_path / "keys")).stop()  # its bye
        assert d.heard[1] > said and 1 in d.gone
    finally:
        d.stop()
