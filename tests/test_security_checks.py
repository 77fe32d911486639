"""The small guards of ``docs/security.md``: an old libzmq is refused, warnings about peers come
at a bounded rate, a plaintext wildcard bind warns once, client routing ids are unpredictable."""

import logging

import pytest
import zmq

from rudra_zmq import transport
from rudra_zmq.security import auth
from rudra_zmq.server import throttled_log


def test_a_libzmq_older_than_4_3_5_is_refused_saying_how_to_upgrade(monkeypatch):
    monkeypatch.setattr(zmq, "zmq_version_info", lambda: (4, 3, 4))
    monkeypatch.setattr(zmq, "zmq_version", lambda: "4.3.4")
    with pytest.raises(auth.SecurityError, match=r"4\.3\.5 or newer.*libzmq 4\.3\.4.*pip"):
        auth.check_libzmq()


def test_a_key_name_that_is_not_a_name_is_refused(tmp_path):
    from rudra_zmq.security import keys

    keys.init(tmp_path / "k")
    with pytest.raises(auth.SecurityError, match="not a key name"):
        auth.Curve(tmp_path / "k", "../etc/passwd")


def test_repeated_warnings_are_logged_once_per_interval_with_a_count(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(throttled_log.time, "monotonic", lambda: now[0])
    warn = throttled_log.ThrottledLog(logging.getLogger("t"), every_s=10.0)
    with caplog.at_level(logging.WARNING, logger="t"):
        logged = [warn.warning(("peer", "bad"), "refused %s", i) for i in range(1000)]
        now[0] += 10.0
        warn.warning(("peer", "bad"), "refused %s", "again")
        warn.warning(("other", "bad"), "refused %s", "other")
    assert logged.count(True) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused 0",
        "refused again (999 more like it in the last 10 s not logged)",
        "refused other",
    ]


def test_many_senders_share_one_key_once_the_table_is_full(monkeypatch):
    monkeypatch.setattr(throttled_log, "MAX_KEYS", 3)
    warn = throttled_log.ThrottledLog(logging.getLogger("t"))
    for i in range(100):
        warn.warning(("peer", i), "x")
    assert len(warn._seen) == 4  # three senders and "(many senders)"


def test_a_plaintext_wildcard_bind_warns_once_naming_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(transport, "_warned_exposed", set())
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="rudra_zmq.transport"):
            socks = [ctx.socket(zmq.ROUTER) for _ in range(2)]
            for s in socks:
                s.linger = 0
                transport.bind(s, "tcp://0.0.0.0:0")
            local = ctx.socket(zmq.ROUTER)
            local.linger = 0
            transport.bind(local, "tcp://127.0.0.1:0")
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1 and "security.curve=true" in warnings[0]
    finally:
        ctx.destroy(linger=0)


def test_under_a_launcher_that_said_it_a_plaintext_wildcard_bind_does_not_warn(monkeypatch, caplog):
    monkeypatch.setattr(transport, "_warned_exposed", set())
    monkeypatch.setenv(transport.PLAINTEXT_NAMED_ENV, "1")
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="rudra_zmq.transport"):
            s = ctx.socket(zmq.ROUTER)
            s.linger = 0
            transport.bind(s, "tcp://0.0.0.0:0")
        assert caplog.records == []
    finally:
        ctx.destroy(linger=0)


def test_client_routing_ids_are_random_and_never_start_with_zero():
    ids = {transport.new_routing_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 16 and i[0] != 0 for i in ids)
