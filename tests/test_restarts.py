"""The launcher's restart policy (restarts.on_failure), driven directly: no processes; and what a
finished server of several tells a learner new to its range (one server in this process)."""

import numpy as np

from cluster import FakeLearner, running, small_config
from rudra_zmq.launch.restarts import on_failure
from rudra_zmq.server.ps import ParameterServer
from rudra_zmq.wire import Kind

RUN = "/runs/r"


def verdict(role, *overrides, restarts=0, others=True, args=("--config", "c"), final=None):
    cfg = small_config(*overrides)
    label = f"{role}0" if role == "learner" else role
    return on_failure(cfg, label, role, args, restarts, others, RUN, final)


def test_a_restarted_ps_resumes_and_a_restarted_stats_server_stays_in_the_run():
    v = verdict("ps", "runtime.restart=true")
    assert v.action == "restart" and v.args == ("--config", "c", "--resume")
    assert "from its newest checkpoint (1 of at most" in v.message
    v = verdict("stats", "runtime.restart=true", args=("--config", "c", "--resume"))
    assert v.action == "restart" and v.args == ("--config", "c")


def test_a_role_that_failed_past_max_restarts_stops_the_run():
    v = verdict("data", "runtime.restart=true", "runtime.max_restarts=2", restarts=2)
    assert v.action == "stop" and "failed 3 times (runtime.max_restarts=2)" in v.message


def test_without_restarts_a_learner_is_left_out_while_another_goes_on():
    assert verdict("learner", "runtime.restart=false").action == "leave_out"
    v = verdict("learner", "runtime.restart=false", others=False)
    assert v.action == "stop" and "every learner has failed" in v.message
    v = verdict("ps", "runtime.restart=false")
    assert v.action == "stop" and v.message is None  # the failure report said it all


def test_advstar_restarts_only_its_servers_and_says_how_to_resume():
    over = ("runtime.restart=true", "architecture.kind=advstar", "sync.protocol=async")
    assert verdict("stats", *over).action == "restart"
    v = verdict("ps", *over)
    assert v.action == "stop" and f"rudra-zmq run --resume {RUN}" in v.message


def test_without_restarts_a_ps_that_failed_after_saving_its_final_weights_ends_the_run_well():
    final = {"type": "done", "ts": 90, "t": 0.0, "epoch": 2.0}
    v = verdict("ps", "runtime.restart=false", final=final)
    assert v.action == "finished" and "done at timestamp 90, epoch 2.00" in v.message
    # with restarts the PS comes back as before (it finds training done and ends)
    assert verdict("ps", "runtime.restart=true", final=final).action == "restart"
    assert verdict("learner", "runtime.restart=false").action == "leave_out"


def test_a_node_or_learner_whose_servers_all_finished_has_finished_and_is_not_restarted():
    """Chaos soak seed 9: a tree node whose range's root wrote ps_final.json (done) fails
    asking that root, which has exited; restarting it would fail the same way for ever."""
    final = {"type": "done", "ts": 90, "t": 0.0, "epoch": 2.0}
    for restart in ("runtime.restart=true", "runtime.restart=false"):
        over = (restart, "architecture.kind=adv", "sync.protocol=softsync")
        v = verdict("node", *over, final=final)
        assert v.action == "finished" and "(ps_final.json: done at epoch 2.00)" in v.message
        assert verdict("learner", *over, final=final).action == "finished"
        assert verdict("node", *over).action == ("restart" if restart[-4:] == "true" else "stop")


def test_a_learner_failing_after_some_of_its_servers_finished_is_restarted_with_their_weights():
    """K = 2, server 0 finished (its ps_final.json says done) and has exited, server 1 trains
    on: a learner restarted as before would say HELLO to server 0, which is gone, and wait
    runtime.timeout_s for its range's weights (then fail, and again: chaos soak seed 10); it
    is restarted with --finished-in RUN, which takes server 0's range from its final weights,
    whether another learner trains or not."""
    cfg = small_config("runtime.restart=true", "architecture.servers=2")
    args = (cfg, "learner0", "learner", ("--config", "c"), 0)
    for others in (True, False):
        v = on_failure(*args, others, RUN, None, ("ps", "ps1"), ("ps",))
        assert v.action == "restart", v
        assert v.args == ("--config", "c", "--finished-in", RUN), v.args
        assert "restarting learner0 with ps's final weights (ps finished)" in v.message
    # restarted again: --finished-in once
    again = on_failure(cfg, "learner0", "learner", v.args, 1, True, RUN, None, (), ("ps",))
    assert again.args == v.args
    # no server finished: restarted as before
    v = on_failure(*args, True, RUN, None, ("ps", "ps1"), ())
    assert v.action == "restart" and v.args == ("--config", "c")
    # past runtime.max_restarts it stops the run, as any role does
    v = on_failure(cfg, "learner0", "learner", (), 100, True, RUN, None, (), ("ps",))
    assert v.action == "stop" and "runtime.max_restarts" in v.message


def test_a_finished_server_of_two_welcomes_a_new_learner_with_its_final_weights(ctx):
    """A learner new to a finished server's range (restarted, or the run resumed) gets that
    range's final weights, to train the other server's range on, and is told STOP at its next
    request; a learner that holds the range (x{had}) is told STOP at once, as with one server."""
    ps = ParameterServer(small_config("architecture.servers=2"), "tcp://127.0.0.1:0", ctx=ctx)
    st = ps.state
    st.done = True  # training over for server 0
    hello = {"model": st.signature, "numel": st.model_numel, "range": st.share.key}
    with running(ps) as errors:
        new, old = FakeLearner(ctx, ps.endpoint, 0), FakeLearner(ctx, ps.endpoint, 1)
        new.send(Kind.HELLO, **hello)
        got = new.recv()
        assert got.kind == Kind.WELCOME, got
        np.testing.assert_array_equal(np.concatenate(got.payloads), st.w)
        new.send(Kind.PULL, got.ts)
        assert new.recv().kind == Kind.STOP
        old.send(Kind.HELLO, had=5, **hello)
        assert old.recv().kind == Kind.STOP
        new.close(), old.close()
    assert not errors
