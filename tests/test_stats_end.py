"""When the statistics server may finish (stats/run_end.RunEnd), driven directly with
made-up times: no sockets, no clock."""

import json
import os

from rudra_zmq import wire
from rudra_zmq.stats.run_end import (
    DONE_QUIET_S,
    DONE_WAIT_S,
    FINAL_FILE_EVERY_S,
    FINAL_FILE_GRACE_S,
    RunEnd,
)


def done(ts=40, epoch=4.0, **extra):
    return {"type": "done", "ts": ts, "epoch": epoch, **extra}


def test_the_run_waits_for_stragglers_then_for_its_final_weights_then_gives_up(tmp_path):
    end = RunEnd(tmp_path, epochs=4)
    end.done_received(done(), 100.0, wire.SENDER_PS)
    end.done_received(done(ts=99), 101.0, wire.SENDER_PS)  # the first done counts
    assert end.done["ts"] == 40 and end.done["arrived"] == 100.0
    assert end.verdict(100.0 + DONE_QUIET_S / 2, evaluated=set()) == "wait"
    assert end.verdict(100.0 + DONE_QUIET_S, evaluated={40}) == "finished"
    assert end.verdict(100.0 + DONE_QUIET_S, evaluated={39}) == "final"
    assert not end.waited_out(100.0 + DONE_WAIT_S / 2)
    assert end.waited_out(100.0 + DONE_WAIT_S)


def test_a_done_without_ts_waits_for_the_evals_it_announced(tmp_path):
    end = RunEnd(tmp_path, epochs=4)
    end.done_received({"type": "done", "evals_sent": 2}, 0.0, wire.SENDER_PS)
    end.eval_received(wire.SENDER_PS)
    assert end.verdict(1.0, evaluated=set()) == "wait"
    end.eval_received(wire.SENDER_PS)
    assert end.verdict(1.0, evaluated=set()) == "finished"
    other = RunEnd(tmp_path, epochs=4)
    other.done_received({"type": "done", "evals_sent": 2}, 0.0, wire.SENDER_PS)
    assert other.verdict(DONE_WAIT_S, evaluated=set()) == "finished"  # waited long enough


def test_ps_final_json_saying_training_is_done_stands_for_the_done_looked_at_now_and_then(tmp_path):
    end = RunEnd(tmp_path, epochs=4)
    assert not end.look_for_file(10.0, t0=0.0)  # no file yet
    final = tmp_path / "ps_final.json"
    final.write_text(json.dumps({"timestamp": 40, "epoch": 4.0, "done": True}))
    os.utime(final, (11.0, 11.0))  # written at 11.0 (the PS's "done" went just before)
    assert not end.look_for_file(11.0 + FINAL_FILE_EVERY_S, t0=0.0)  # its "done" may be in flight
    assert not end.look_for_file(11.0 + FINAL_FILE_EVERY_S * 1.5, t0=0.0)  # not looked again
    assert end.look_for_file(11.0 + FINAL_FILE_GRACE_S + FINAL_FILE_EVERY_S, t0=0.0)
    assert end.done["ts"] == 40 and end.done["sender"] == wire.SENDER_PS
    rec = end.file_record()  # for the metrics: how the end became known, once
    assert rec["type"] == "done" and rec["ts"] == 40 and rec["source"] == "ps_final.json"
    assert rec["t"] == 11.0 and "arrived" not in rec and end.file_record() is None
    stale = RunEnd(tmp_path, epochs=5)  # resumed to train on
    assert not stale.look_for_file(10.0, t0=0.0)
    assert stale.file_record() is None
