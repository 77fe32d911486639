"""``wire.parts`` under ``rudra-zmq run``: hardsync with each server's range in parts, each
part answered ahead once every learner's part is in. The weights are the whole messages'; a
server killed with a round half in restarts from its checkpoint and the run ends."""

import json

import numpy as np
import pytest

from fault_runs import FAST, Run, records
from test_sharded_run import HARDSYNC, run

pytestmark = pytest.mark.timeout(300)
HALF = ["wire.gradient_dtype=float16", "wire.weights_dtype=float16"]


def test_hardsync_in_parts_ends_with_the_weights_of_whole_messages(tmp_path):
    """Half precision both ways: gradients narrowed once for all parts (error feedback
    whole), weights ahead narrowed per part. (Two or more servers in parts: test_shards.)"""
    whole, _ = run(tmp_path, "whole", [*HARDSYNC, *HALF])
    parted, out = run(tmp_path, "parts", [*HARDSYNC, *HALF, "wire.parts=4"])
    # two gradients per update sum alike in either order: parts change no bit
    np.testing.assert_array_equal(np.load(parted / "weights.npy"), np.load(whole / "weights.npy"))
    final = json.loads((parted / "ps_final.json").read_text())
    ups = final["updates"]  # 3 of each update's 4 parts went ahead of it
    assert final["parts"] == {"parts": 4, "stepped_ahead": 3 * ups, "dropped": 0, "rate_changed": 0}
    assert "parts" not in json.loads((whole / "ps_final.json").read_text())
    assert "result: test error" in out


@pytest.mark.parametrize("priority", ["false", "true"])
def test_a_server_killed_with_a_round_half_in_restarts_and_the_run_ends(tmp_path, priority):
    """Parts of the round went ahead (some learners hold part of the next version): after
    the restart the server takes the freshest learner's copy (newer than the checkpoint at
    20), every learner rejoins at it and training goes on. With ``wire.priority`` the parts
    still queued at the learner when its channel resends go once, not also in the resend."""
    r = Run(
        tmp_path,
        "killed",
        [*FAST, *HARDSYNC, "train.epochs=2", "wire.parts=4", f"wire.priority={priority}"]
        + ["train.checkpoint_every_updates=10", "train.eval_every_epochs=1"],
        crash={"PS_CRASH_AT": "part-ahead", "PS_CRASH_TS": "25"},
    )
    assert r.finish(timeout=240) == 0, r.out
    assert "restarting ps from its newest checkpoint (1 of at most 3)" in r.out, r.out
    restarts = records(r.dir, "restart")
    assert len(restarts) == 1 and 20 < restarts[0]["ts"] <= 25, restarts
    assert restarts[0]["from"].startswith("learner "), restarts
    final = json.loads((r.dir / "ps_final.json").read_text())
    assert final["incarnation"] == 2 and final["done"]
    assert final["parts"]["stepped_ahead"] > 0
    assert "result: test error" in r.out and records(r.dir, "eval")[-1]["epoch"] >= 2
    # each learner's request to the old incarnation refused once ("rejoin"), not once per
    # part (2 learners x 4 parts = 8 before); a resend after the reconnect may add one each
    assert 1 <= records(r.dir, "done")[-1]["invalid"] <= 4, records(r.dir, "done")
