"""Every λ change (a learner evicted or rejoining) is in the records, once
(``stats/missed_records.py``): one whose ``members`` record never reached the statistics server
(it was down) is read from the server's ``members.json``; a record that comes again is not
written twice, nor one a restarted statistics server finds in ``metrics.jsonl``."""

import json
import logging
import time

import pytest

from cluster import small_config
from rudra_zmq.data.data_order import load_data
from rudra_zmq.server import ps as ps_module
from rudra_zmq.server.journal import Journal
from rudra_zmq.shape import ClusterShape
from rudra_zmq.stats.missed_records import GRACE_S, LOOK_EVERY_S, MissedRecords
from stats_outage import read_then_sent_twice, records_of, restarted_ps, stats_up, wait_for

pytestmark = pytest.mark.timeout(180)

T0 = 1.7e9  # the journal's clock (Unix time), passed in


@pytest.fixture(scope="module")
def cfg():
    return small_config("train.checkpoint_every_s=0", "train.checkpoint_every_updates=0")


@pytest.fixture(scope="module")
def digits(cfg):
    return load_data(cfg)


def evicted(learner: int, ts: int = 7) -> dict:
    return {"type": "members", "t": T0, "ts": ts, "learner": learner, "event": "evicted"}


def two_servers(tmp_path):
    """The shape of a run of two servers, and server 1's journal in its files folder."""
    shape = ClusterShape.of(small_config("architecture.servers=2"))
    kept = Journal(shape.server(1).files_dir(tmp_path), "members", 1, resume=False)
    return shape, kept


def test_a_kept_change_no_record_said_is_written_once_after_its_grace(tmp_path):
    shape, kept = two_servers(tmp_path)
    entry = kept.add(evicted(0))
    missed = MissedRecords(tmp_path, shape)
    assert missed.missed(T0 + GRACE_S / 2) == []  # its record may be in flight
    assert missed.missed(T0 + GRACE_S / 2 + LOOK_EVERY_S / 2) == []  # no look
    (got,) = missed.missed(T0 + GRACE_S + LOOK_EVERY_S)
    assert got == {**entry, "server": 1, "source": "members.json"}
    assert missed.first(got)
    late = {**entry, "server": 1}  # its record, delivered late
    assert not missed.first(late)
    assert missed.missed(T0 + 100, force=True) == []


def test_a_restarted_statistics_server_does_not_write_again_what_metrics_holds(tmp_path):
    shape, kept = two_servers(tmp_path)
    written = {**kept.add(evicted(0)), "server": 1}
    newer = kept.add(evicted(1))
    missed = MissedRecords(tmp_path, shape, written=[written])
    assert [r["n"] for r in missed.missed(T0 + 100, force=True)] == [newer["n"]]


def test_a_record_without_its_number_from_an_older_run_is_always_written(tmp_path):
    shape, _ = two_servers(tmp_path)
    old = {**evicted(0), "server": 1}
    missed = MissedRecords(tmp_path, shape, written=[old])
    assert missed.first(old) and missed.first(old)


def test_a_damaged_journal_is_skipped_with_one_warning_and_the_restarts_still_read(
    tmp_path, caplog
):
    shape, _ = two_servers(tmp_path)
    files = shape.server(1).files_dir(tmp_path)
    files.mkdir(parents=True)
    (files / "members.json").write_text('{"members": [{"type": "members"}]}')
    restarts = {"session": "s", "starts": 2, "restarts": []}
    restarts["restarts"].append({"server": 1, "from": "initial", "ts": 0, "lost": 0})
    restarts["restarts"][0].update(incarnation=2, t=T0)
    (files / "restarts.json").write_text(json.dumps(restarts))
    missed = MissedRecords(tmp_path, shape)
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.stats"):
        first = missed.missed(T0 + 100, force=True)
        again = missed.missed(T0 + 200, force=True)
    assert [(r["type"], r["source"]) for r in first] == [("restart", "restarts.json")]
    assert [r["type"] for r in again] == ["restart"]  # first() never called: still missed
    assert ["ignoring" in r.message and "members.json" in r.message for r in caplog.records] == [
        True
    ]


def test_a_change_read_from_the_journal_then_its_record_twice_is_one_record(tmp_path, digits):
    """The statistics server reads server 1's eviction from its file first (the record was
    late), then the record comes, twice: one record, its line saying where it was read."""
    _, kept = two_servers(tmp_path)
    entry = kept.add({**evicted(0), "t": time.time() - 10, "learners": 1, "c": 1})
    server = read_then_sent_twice(tmp_path, digits, entry)
    got = records_of(tmp_path, "members")
    assert [(r["server"], r["learner"], r["n"], r["source"]) for r in got] == [
        (1, 0, 1, "members.json")
    ]
    assert server.repeated == 2
    assert "learner 0 evicted at ts 7), c = 1 (its record read from members.json)" in (
        server.out.getvalue()
    )


def test_an_eviction_while_the_statistics_server_was_down_is_in_the_records_once(
    cfg, digits, tmp_path
):
    """The statistics server goes down; the PS evicts a learner (its members record waits in
    its queue) and is killed before the statistics server comes back, so the record is lost
    with it. The statistics server back reads the eviction from the PS's members.json while
    the run goes on; the restarted PS's eviction, whose record arrives, is written once, and
    so is each again by a statistics server restarted after them."""
    with stats_up(cfg, "tcp://127.0.0.1:0", tmp_path, digits) as stats:
        endpoint = stats.endpoint
        first = ps_module.ParameterServer(
            cfg, "tcp://127.0.0.1:0", stats=endpoint, run_dir=tmp_path
        )
    assert first.state.evict(0) is None
    first._members_changed(0, "evicted")  # the statistics server down
    first.ctx.destroy(linger=0)  # SIGKILL: its queued members record is gone with it
    with stats_up(cfg, endpoint, tmp_path, digits) as stats:
        wait_for(lambda: len(records_of(tmp_path, "members")) == 1)  # read in the run
        second = restarted_ps(cfg, tmp_path, endpoint)  # incarnation 2, its record arrives
        assert second.state.evict(1) is None
        second._members_changed(1, "evicted")
        second._finish()
        wait_for(lambda: len(records_of(tmp_path, "members")) == 2)
        time.sleep(LOOK_EVERY_S + GRACE_S)  # its entry is looked at too
    assert "learner 0 evicted at ts 0), c = 1 (its record read from members.json)" in (
        stats.out.getvalue()
    )
    with stats_up(cfg, endpoint, tmp_path, digits):  # a statistics server restarted later
        time.sleep(LOOK_EVERY_S)
    got = records_of(tmp_path, "members")
    assert [(r["incarnation"], r["n"], r["learner"], r.get("source")) for r in got] == [
        (1, 1, 0, "members.json"),
        (2, 1, 1, None),
    ]
