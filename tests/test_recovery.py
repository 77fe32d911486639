"""A server restarted without a usable checkpoint takes its range back from the freshest copy
its learners hold (``server/recovery.py``, ``ServerState.adopt``), the copies checked like any
network message; the restarts are listed in ``restarts.json`` and ``ps_final.json``; the
statistics server joins slices by the epoch boundary they crossed. No sockets, no clock."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rudra_zmq import wire
from rudra_zmq.config import load_config
from rudra_zmq.results.compare import restarts_cell, restarts_text
from rudra_zmq.results.record_fields import DamagedRecord
from rudra_zmq.results.records import check_restarts, load_final
from rudra_zmq.server.end_files import write_final
from rudra_zmq.server.recovery import Recovery
from rudra_zmq.server.restart_record import RestartHistory
from rudra_zmq.server.state import ServerState
from rudra_zmq.stats.eval_join import EvalJoin
from rudra_zmq.wire import Kind

N = 10


def hello(sender, had=None, copy=None, step=None, seq=1):
    fields = {"model": "m", "numel": N}
    if had is not None:
        fields["had"] = had
    if step is not None:
        fields["step"] = step
    frames = wire.encode(Kind.HELLO, sender, seq, 0, 0, () if copy is None else [copy], **fields)
    return wire.decode([bytes(f) if not isinstance(f, bytes) else f for f in frames], numel=N)


def test_the_freshest_sound_copy_is_taken_and_a_bad_one_refused():
    rec = Recovery(learners=3, numel=N, window_s=2.0)
    old = np.full(N, 1.0, np.float32)
    new = np.full(N, 2.0, np.float32)
    bad = new.copy()
    bad[3] = np.nan
    rec.offer(b"a", hello(0, had=7, copy=old, step=40), now=100.0)
    assert not rec.due(100.5)
    rec.offer(b"c", hello(2, had=12, copy=bad, step=41), now=100.6)  # newest, but not finite
    assert not rec.due(101.0)
    rec.offer(b"b", hello(1, had=9, copy=new, step=39), now=101.0)
    assert rec.due(101.0)  # every learner said HELLO
    got = rec.result()
    assert got.source == 1 and got.ts == 9 and got.origin == "learner 1"
    np.testing.assert_array_equal(got.weights, new)
    assert got.steps == {0: 40, 2: 41, 1: 39}
    assert got.newest == 12 and got.lost == 3  # learner 2 had seen 12: those 3 are lost
    assert got.refused == [(2, "its copy holds values that are not finite")]
    assert [h.sender for h in rec.held] == [0, 2, 1]


def test_the_window_ends_the_wait_and_no_copy_means_the_initial_weights():
    rec = Recovery(learners=4, numel=N, window_s=2.0)
    rec.offer(b"a", hello(0), now=10.0)  # a learner started afresh: no copy, no timestamp
    assert not rec.due(11.9) and rec.due(12.0)
    got = rec.result()
    assert got.weights is None and got.origin == "initial" and got.lost == 0


def test_out_of_range_timestamps_and_steps_are_refused():
    rec = Recovery(learners=2, numel=N, window_s=1.0)
    rec.offer(b"a", hello(0, had=2**60, copy=np.ones(N, np.float32)), now=0.0)
    rec.offer(b"b", hello(1, had=3, step=-5, copy=np.ones(N, np.float32)), now=0.0)
    got = rec.result()
    assert got.weights is None and len(got.refused) == 2


@pytest.mark.parametrize(
    "payload, code",
    [
        (np.ones(N - 1, np.float32), "bad_length"),  # not the range's size
        (np.ones(N, np.float16), "bad_dtype"),  # copies travel as float32 only
    ],
)
def test_a_copy_of_the_wrong_size_or_type_is_refused_on_the_wire(payload, code):
    frames = wire.encode(Kind.HELLO, 0, 1, 0, 0, [payload], model="m", numel=N, had=3)
    with pytest.raises(wire.WireError) as exc:
        wire.decode([bytes(f) for f in frames], numel=N)
    assert exc.value.code == code


def test_adopt_resumes_at_the_copys_timestamp_with_the_reported_steps():
    cfg = load_config(
        None,
        [
            "data.dataset=digits",
            "sync.protocol=hardsync",
            "sync.learners=2",
            "sync.batch_size=16",
            "train.epochs=3",
        ],
    )
    st = ServerState(cfg, np.zeros(N, np.float32), [(0, N, 1.0, 1.0)], "m", epoch_size=1600)
    rec = Recovery(learners=2, numel=N, window_s=1.0)
    copy = np.arange(N, dtype=np.float32)
    rec.offer(b"a", hello(0, had=15, copy=copy, step=15), now=0.0)
    rec.offer(b"b", hello(1, had=16, copy=copy + 1, step=16), now=0.0)
    st.adopt(rec.result())
    eng = st.engine
    assert eng.timestamp == 16 and eng.updates == 16
    assert eng.gradients_received == 32 and eng.epoch == pytest.approx(32 * 16 / 1600)
    np.testing.assert_array_equal(st.w, copy + 1)
    assert st.steps == {0: 15, 1: 16} and st.restored_ts == 16
    assert st.counters.lost_updates == 0 and not st.done


def test_restart_history_tells_a_restart_from_a_resume(tmp_path):
    first = RestartHistory(tmp_path, "s1", resume=False)
    assert first.record(0, "initial", 0, 0) is None  # a first start is no restart
    again = RestartHistory(tmp_path, "s1", resume=True)  # the same launch: a restart
    rec = again.record(1, "learner 0", 40, 2, epoch=1.6)
    assert rec == {
        "server": 1,
        "from": "learner 0",
        "ts": 40,
        "lost": 2,
        "incarnation": 2,
        "t": pytest.approx(time.time(), abs=60),  # when: the statistics server may read it
        "epoch": 1.6,
        "checkpoint": None,
    }
    again.lost(3)
    again.save()
    later = RestartHistory(tmp_path, "s2", resume=True)  # `run --resume`: not a restart
    assert later.record(1, "checkpoint", 90, 0) is None
    assert later.restarts == [{**rec, "lost": 3}] and later.starts == 3
    (tmp_path / "restarts.json").write_text('{"restarts": [{"server": -1}]}')
    assert RestartHistory(tmp_path, "s2", resume=True).restarts == []  # damaged: ignored


def test_ps_final_lists_the_restarts_and_a_damaged_list_is_refused(tmp_path):
    class State:
        class engine:
            timestamp, epoch, updates = 50, 3.0, 50

        done, incarnations, parts = True, [1], None

    restarts = [{"server": 1, "from": "learner 2", "ts": 30, "lost": 1, "incarnation": 2}]
    write_final(tmp_path, State, restarts=restarts, incarnation=2)
    final = load_final(tmp_path)
    assert final["restarts"] == restarts and final["incarnation"] == 2
    assert restarts_text(restarts, True) == "server 1 from learner 2 at ts 30, 1 updates lost"
    assert restarts_cell(restarts) == "1 (1 lost)" and restarts_cell([]) == "0"
    damaged = json.loads((tmp_path / "ps_final.json").read_text())
    damaged["restarts"][0]["lost"] = -4
    (tmp_path / "ps_final.json").write_text(json.dumps(damaged))
    with pytest.raises(DamagedRecord, match="restarts"):
        load_final(tmp_path)
    with pytest.raises(DamagedRecord, match="from"):
        check_restarts([{**restarts[0], "from": "elsewhere"}], "x")


@pytest.mark.parametrize("sender", [0, 7, 123456789, wire.node_sender(0), wire.node_sender(5)])
def test_the_copy_holders_name_a_restart_record_carries_reads_back_as_its_sender(sender):
    name = wire.sender_name(sender)
    assert wire.copy_holder_sender(name) == sender
    assert check_restarts([{"server": 0, "from": name, "ts": 1, "lost": 0}], "x")


@pytest.mark.parametrize(
    "name",
    ["parameter server", "learner", "learner -1", "learner ²", "tree node 1234567890", "x 1"],
)
def test_a_name_that_is_no_copy_holder_is_refused(name):
    assert wire.copy_holder_sender(name) is None
    with pytest.raises(DamagedRecord, match="from"):
        check_restarts([{"server": 0, "from": name, "ts": 1, "lost": 0}], "x")


class _Shape:
    def __init__(self, k):
        # ranges in order: EvalJoin puts their payloads end to end
        self.servers = [SimpleNamespace(share=SimpleNamespace(contiguous=True))] * k

    def eval_server(self, fields):
        return fields["server"]

    def eval_record(self, ts):
        return {"server_ts": ts}


class _Slice:
    def __init__(self, server, epoch, ts, final=False):
        self.fields = {"server": server, "epoch": epoch, **({"final": True} if final else {})}
        self.ts, self.payloads = ts, [server]


def test_slices_join_by_the_boundary_they_crossed_and_a_boundary_again_is_ignored():
    join = EvalJoin(_Shape(2), every_epochs=1.0)
    assert join.add(_Slice(0, 2.01, 90)) is None
    joined = join.add(_Slice(1, 2.04, 88))  # server 1 restarted: its epochs a little apart
    assert joined is not None and joined.fields["epoch"] == 2.01 and joined.payloads == [0, 1]
    assert join.add(_Slice(1, 2.0, 87)) is None and join.again == 1  # crossed again: ignored
    assert not join.open
    assert join.add(_Slice(1, 2.9, 99, final=True)) is None
    assert join.add(_Slice(0, 3.0, 100, final=True)) is not None  # final: whatever the epochs


def test_a_restart_killed_before_it_recorded_anything_still_uses_up_its_incarnation(tmp_path):
    """Chaos soak seed 0: a restarted server killed before its first checkpoint (here: while
    it held its learners' HELLOs, before it recorded where it resumed from) left no trace, so
    the next restart said the same incarnation number again."""
    RestartHistory(tmp_path, "s1", resume=False).record(0, "initial", 0, 0)
    RestartHistory(tmp_path, "s1", resume=True)  # killed before it recorded anything
    third = RestartHistory(tmp_path, "s1", resume=True)
    assert third.starts == 3
    assert third.record(0, "learner 1", 12, 0)["incarnation"] == 3


def test_the_incarnation_count_of_a_checkpoint_stands_when_the_restarts_file_was_lost(tmp_path):
    assert RestartHistory(tmp_path, "s1", resume=True, known=5).starts == 5


def test_a_restarted_server_says_one_incarnation_number_on_its_line_record_and_final_file(
    tmp_path, capsys
):
    """Through the real server: started, restarted and killed while it waited for its
    learners' copies (no checkpoint yet), restarted again: the third start is incarnation 3
    on the terminal, in its restart record and in ps_final.json."""
    from cluster import small_config
    from rudra_zmq.server import ps as ps_module

    cfg = small_config("train.checkpoint_every_s=0", "train.checkpoint_every_updates=0")
    first = ps_module.ParameterServer(cfg, "tcp://127.0.0.1:0", run_dir=tmp_path)
    first._finish()  # a first run of the server that trained nothing
    for start in (2, 3):
        server = ps_module.ParameterServer(cfg, "tcp://127.0.0.1:0", run_dir=tmp_path, resume=True)
        assert server.recovery is not None and server.history.starts == start
        if start == 2:  # killed (SIGKILL) while it held the HELLOs: nothing more written
            server.sock.close(linger=0)
            server.ctx.term()
    server.recovery.first_at = 0.0  # its window passed: no learner came back
    server._recover_if_due()
    assert server.history.current["incarnation"] == 3
    server._finish()
    assert json.loads((tmp_path / "ps_final.json").read_text())["incarnation"] == 3
