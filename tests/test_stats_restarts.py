"""Every restart of a parameter server is in the records, once (``stats/missed_records.py``):
one whose ``restart`` record never reached the statistics server (it was down) is read from
the server's ``restarts.json``; a record that comes again is not written twice."""

import time

import pytest

from cluster import small_config
from rudra_zmq.data.data_order import load_data
from rudra_zmq.server import ps as ps_module
from rudra_zmq.server.restart_record import RestartHistory, as_record
from rudra_zmq.stats.missed_records import GRACE_S, LOOK_EVERY_S
from stats_outage import read_then_sent_twice, records_of, restarted_ps, stats_up, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cfg():
    return small_config("train.checkpoint_every_s=0", "train.checkpoint_every_updates=0")


@pytest.fixture(scope="module")
def digits(cfg):
    return load_data(cfg)


def test_a_server_restarted_while_the_statistics_server_was_down_is_in_the_records_once(
    cfg, digits, tmp_path
):
    """The statistics server goes down; the PS restarts (its restart record waits in its
    queue) and is killed before the statistics server comes back, so the record is lost with
    it. The statistics server back reads the restart from the PS's restarts.json while the
    run goes on; a later restart's record, which does arrive, is written once, and so is
    each restart again by a statistics server restarted after them."""
    with stats_up(cfg, "tcp://127.0.0.1:0", tmp_path, digits) as stats:
        endpoint = stats.endpoint
        first = ps_module.ParameterServer(
            cfg, "tcp://127.0.0.1:0", stats=endpoint, run_dir=tmp_path
        )
        first._finish()
    second = restarted_ps(cfg, tmp_path, endpoint)  # incarnation 2, the statistics server down
    assert second.history.current["incarnation"] == 2
    second.ctx.destroy(linger=0)  # SIGKILL: its queued restart record is gone with it
    with stats_up(cfg, endpoint, tmp_path, digits) as stats:
        # read in the run, not at its end
        wait_for(lambda: len(records_of(tmp_path, "restart")) == 1)
        third = restarted_ps(cfg, tmp_path, endpoint)  # incarnation 3, its record arrives
        third._finish()
        wait_for(lambda: len(records_of(tmp_path, "restart")) == 2)
        time.sleep(LOOK_EVERY_S + GRACE_S)  # its entry is looked at too
    assert "server restarted (incarnation 2) at ts 0 from the initial weights" in (
        stats.out.getvalue()
    )
    with stats_up(cfg, endpoint, tmp_path, digits):  # a statistics server restarted later
        time.sleep(LOOK_EVERY_S)
    got = records_of(tmp_path, "restart")
    assert [(r["incarnation"], r["from"], r["ts"], r.get("source")) for r in got] == [
        (2, "initial", 0, "restarts.json"),
        (3, "initial", 0, None),
    ]


def test_a_restart_record_that_comes_after_its_entry_was_read_is_not_written_twice(
    cfg, digits, tmp_path
):
    """Server 1 of two lists a restart; the statistics server reads it from the file first
    (the record was late), then the record comes (and comes again): one record, and the
    progress line says where it was read."""
    files = tmp_path / "servers" / "server-1"
    RestartHistory(files, "s1", resume=False)
    entry = RestartHistory(files, "s1", resume=True).record(1, "learner 0", 44, 1, 2.5)
    server = read_then_sent_twice(tmp_path, digits, as_record(entry))
    got = records_of(tmp_path, "restart")
    assert [(r["server"], r["incarnation"], r["lost"], r["source"]) for r in got] == [
        (1, 2, 1, "restarts.json")
    ]
    assert server.repeated == 2
    assert "server 1 restarted (incarnation 2) at ts 44 from learner 0's copy" in (
        server.out.getvalue()
    )
