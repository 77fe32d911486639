"""Which updates' weights the parameter server sends to be evaluated
(server/report.EvalSchedule), driven directly."""

from types import SimpleNamespace

from rudra_zmq.server.report import EvalSchedule


def train(every_updates=0, every_epochs=0):
    return SimpleNamespace(eval_every_updates=every_updates, eval_every_epochs=every_epochs)


def update(ts, epoch):
    return SimpleNamespace(timestamp=ts, epoch=epoch)


def test_evaluations_come_each_epoch_from_where_a_resumed_server_starts_and_at_the_end():
    evals = EvalSchedule(train(every_epochs=1), epoch=2.5)
    assert not evals.due(update(10, 2.7), done=False)
    assert evals.due(update(11, 3.1), done=False)
    assert not evals.due(update(12, 3.5), done=False)
    assert evals.due(update(13, 3.6), done=True)


def test_evaluations_come_every_n_updates_and_never_when_both_are_off():
    evals = EvalSchedule(train(every_updates=5))
    assert [u for u in range(1, 12) if evals.due(update(u, u / 10), done=False)] == [5, 10]
    off = EvalSchedule(train())
    assert not any(off.due(update(u, u), done=False) for u in range(1, 20))
