"""The statistics server's join of a sharded run's EVAL slices (stats/eval_join.py) and its
end of a run of K servers (stats/run_end.py): pure logic, no sockets."""

import numpy as np

from rudra_zmq.shape import ClusterShape
from rudra_zmq.stats.eval_join import MAX_OPEN, EvalJoin
from rudra_zmq.stats.run_end import RunEnd
from rudra_zmq.wire import SENDER_PS, Kind, Message


def eval_msg(lo, hi, ts, epoch, final=False, value=None, n=None):
    n = hi - lo if n is None else n
    payload = np.full(n, lo if value is None else value, np.float32)
    fields = {"epoch": epoch, "range": [lo, hi], "final": final}
    return Message(Kind.EVAL, SENDER_PS, 1, ts, 1, fields, [payload])


def test_the_slices_of_one_epoch_join_in_range_order_whatever_their_arrival():
    join = EvalJoin(ClusterShape(3).sized(10))  # ranges [0, 4), [4, 7), [7, 10)
    assert join.add(eval_msg(7, 10, ts=5, epoch=1.0)) is None
    assert join.add(eval_msg(0, 4, ts=4, epoch=1.0)) is None
    whole = join.add(eval_msg(4, 7, ts=6, epoch=1.0))
    assert whole.ts == 4 and whole.fields == {"epoch": 1.0, "server_ts": [4, 6, 5]}
    np.testing.assert_array_equal(np.concatenate(whole.payloads), [0] * 4 + [4] * 3 + [7] * 3)
    assert join.open == {}


def test_striped_slices_join_with_every_stripe_in_its_place():
    shape = ClusterShape(2, parts_per_range=3).sized(10)  # stripes [0,2) [4,6) [8,9) | the rest
    join = EvalJoin(shape)
    vector = np.arange(10, dtype=np.float32)
    msgs = []
    for s in shape.servers:
        m = eval_msg(0, 0, ts=3, epoch=1.0, n=s.share.numel)
        m.fields["range"] = s.share.key
        m.payloads[0][:] = s.share.gather(vector)
        assert join.refusal(m) is None
        msgs.append(m)
    assert join.add(msgs[1]) is None
    whole = join.add(msgs[0])
    np.testing.assert_array_equal(np.concatenate(whole.payloads), vector)


def test_final_slices_join_whatever_their_epochs_and_other_epochs_stay_apart():
    join = EvalJoin(ClusterShape(2).sized(4))
    assert join.add(eval_msg(0, 2, 9, 2.0, final=True)) is None
    assert join.add(eval_msg(2, 4, 9, 1.0)) is None  # epoch 1 of server 1: not the final
    whole = join.add(eval_msg(2, 4, 7, 2.01, final=True))  # a restarted server's end
    assert whole is not None and whole.fields["epoch"] == 2.0
    assert list(join.open) == [1.0]


def test_a_slice_of_another_range_or_size_is_refused_and_old_incomplete_ones_dropped():
    join = EvalJoin(ClusterShape(2).sized(10))
    assert "this run's 2 servers serve [[0, 5], [5, 10]]" in join.refusal(eval_msg(0, 4, 1, 0.0))
    assert "with 3 floats, not 5" in join.refusal(eval_msg(0, 5, 1, 0.0, n=3))
    assert join.refusal(eval_msg(5, 10, 1, 0.0)) is None
    for e in range(MAX_OPEN + 2):
        join.add(eval_msg(0, 5, e, float(e)))
    assert join.dropped == 2 and list(join.open)[0] == 2.0  # the oldest went


def test_a_run_of_three_servers_ends_once_each_servers_done_came(tmp_path):
    end = RunEnd(tmp_path, epochs=2.0, shape=ClusterShape(3))
    done = {"type": "done", "ts": 40, "epoch": 2.0}
    end.done_received({**done, "server": 1, "ts": 41}, 1.0, SENDER_PS)
    end.done_received({**done, "server": 1}, 1.5, SENDER_PS)  # again: still one server
    end.done_received({**done}, 1.7, SENDER_PS)  # names no server: not counted
    assert end.done is None
    end.done_received({**done, "server": 0}, 2.0, SENDER_PS)
    assert end.done is None
    end.done_received({**done, "server": 2, "ts": 39}, 3.0, SENDER_PS)
    assert end.done["ts"] == 40 and end.done["arrived"] == 3.0  # server 0's, when all came
    assert end.verdict(3.5, evaluated={40}) == "finished"
    assert end.verdict(3.5, evaluated={41}) == "final"


def test_tensorboard_puts_other_servers_staleness_and_rates_under_their_own_tags():
    from types import SimpleNamespace

    from rudra_zmq.stats.tensorboard_log import TensorBoardLog

    written = []
    tb = TensorBoardLog.__new__(TensorBoardLog)  # without TensorBoard: a writer that records
    tb.writer = SimpleNamespace(add_scalar=lambda tag, v, step, walltime: written.append(tag))
    tb.t0, tb.started, tb._early, tb._rates, tb._ts = 0.0, 0.0, {}, {}, 0
    tb.record({"type": "update", "t": 1.0, "ts": 5, "mean_sigma": 0.5, "server": 0})
    tb.record({"type": "update", "t": 1.0, "ts": 4, "mean_sigma": 0.7, "server": 2})
    tb.record({"type": "ps", "t": 1.0, "ts": 4, "updates_per_s": 3.0, "server": 2})
    assert written == [
        "staleness/mean_sigma",
        "server-2/staleness/mean_sigma",
        "server-2/throughput/updates_per_s",
    ]
    assert tb._ts == 5  # server 0's clock only


def test_one_servers_eval_is_a_whole_evaluation_at_once():
    join = EvalJoin(ClusterShape(1).sized(4))
    msg = Message(Kind.EVAL, SENDER_PS, 1, 3, 1, {"epoch": 1.0}, [np.ones(4, np.float32)])
    assert join.refusal(msg) is None
    whole = join.add(msg)
    assert whole.ts == 3 and whole.fields == {"epoch": 1.0} and join.open == {}
    short = Message(Kind.EVAL, SENDER_PS, 1, 3, 1, {"epoch": 1.0}, [np.ones(3, np.float32)])
    assert "with 3 floats, not 4" in join.refusal(short)
