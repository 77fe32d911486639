"""When the parameter server stops waiting for learners (server/liveness.Liveness), driven
directly with made-up times and a stand-in state: no sockets, no clock."""

import logging
from types import SimpleNamespace

import pytest

from rudra_zmq.server.liveness import EVICT_CHECK_S, WAIT_NOTE_S, Liveness


def runtime(learner_timeout_s=2.0, timeout_s=20.0):
    return SimpleNamespace(learner_timeout_s=learner_timeout_s, timeout_s=timeout_s)


def state(silent=(), done=False, **extra):
    asked = []

    def find(now, timeout_s, waiting, never_by):
        asked.append((now, timeout_s, set(waiting), never_by))
        return list(silent)

    return SimpleNamespace(silent=find, asked=asked, done=done, tree=None, **extra)


def test_silent_learners_are_looked_for_every_check_and_each_eviction_is_a_notice(caplog):
    live = Liveness(runtime())
    live.start(100.0)
    assert live.due(100.0) and not live.due(100.0 + EVICT_CHECK_S / 2)
    assert live.due(100.0 + EVICT_CHECK_S)
    st = state(silent=[1, 3])
    with caplog.at_level(logging.WARNING, logger="rudra_zmq.ps"):
        assert list(live.silent(st, 105.0, {2})) == [1, 3]
    assert st.asked == [(105.0, 2.0, {2}, 120.0)]  # never heard from: timeout_s from the start
    evicted = [r.getMessage() for r in caplog.records if "evicted; it rejoins" in r.getMessage()]
    assert len(evicted) == 2 and "learner 3 sent nothing for 2 s" in evicted[1]


def test_no_learner_is_evicted_when_the_learner_timeout_is_off():
    st = state(silent=[1])
    assert list(Liveness(runtime(learner_timeout_s=0)).silent(st, 1e9, set())) == []
    assert st.asked == []


def test_the_learners_still_untold_are_named_once_after_training_is_done(caplog):
    live, st = Liveness(runtime()), state(done=True, untold={4, 2})
    with caplog.at_level(logging.INFO, logger="rudra_zmq.ps"):
        live.note_waiting(st, 10.0)
        live.note_waiting(st, 10.0 + WAIT_NOTE_S / 2)
        live.note_waiting(st, 10.0 + WAIT_NOTE_S)
        live.note_waiting(st, 10.0 + 2 * WAIT_NOTE_S)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "waiting to tell learners [2, 4] to stop" in said


def test_silence_past_the_timeout_ends_a_finished_run_and_fails_an_unfinished_one():
    live = Liveness(runtime(timeout_s=20.0))
    over = state(done=True, learners=2, stopped={0})
    assert not live.idle(over, 20.0) and live.idle(over, 20.5)
    running = state(
        engine=SimpleNamespace(timestamp=7), identities={0: b"a", -1: b"n"}, subtrees={}
    )
    with pytest.raises(TimeoutError, match=r"for 20 s at timestamp 7 \(learners registered: \[0\]"):
        live.idle(running, 21.0)
