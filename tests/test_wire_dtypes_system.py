"""Whole runs on a half-precision wire (``wire.gradient_dtype``, ``wire.weights_dtype``): the
same hardsync run on float32 and on float16/bfloat16 ends with weights close to each other
(the PS keeps float32 master weights; learners feed back their rounding) but not equal (the
wire really narrowed), flat and through a Rudra-adv tree; Rudra-adv* broadcasts half weights
and still learns. Roles as threads of this process (tests/inproc.py)."""

import json

import pytest

from cluster import weights_difference
from test_system import ROOT, threaded_run, updates
from test_tree_system import HARD, TREE  # hardsync, λ = 4: the tree tests' flat run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
F16 = ["wire.gradient_dtype=float16", "wire.weights_dtype=float16"]


@pytest.fixture(scope="module")
def float32_run(tmp_path_factory):
    run_dir, _ = threaded_run(tmp_path_factory.mktemp("f32"), "f32", HARD)
    return run_dir


@pytest.mark.parametrize(
    "name,extra",
    [
        ("f16", F16),
        ("bf16-gradients", ["wire.gradient_dtype=bfloat16"]),
        ("f16-no-feedback", [*F16, "wire.error_feedback=false"]),
        ("f16-tree", [*F16, *TREE]),
        ("f16-tree-shm", [*F16, *TREE, "architecture.leaf_shm=true"]),
    ],
)
def test_a_half_wire_ends_near_the_float32_weights_but_not_on_them(
    float32_run, tmp_path, name, extra
):
    half, _ = threaded_run(tmp_path, name, [*HARD, *extra])
    moved, rel = weights_difference(float32_run, half)
    print(f"{name}: training moved the weights by {moved:.2e}; half vs float32 {rel:.2e}")
    assert 0 < rel <= 1e-2, f"relative difference {rel:.2e}"
    u32, uh = updates(float32_run), updates(half)
    assert len(uh) == len(u32) >= 10
    assert all(r["sigmas"] == [0, 0, 0, 0] for r in uh)


def test_advstar_broadcasts_half_weights_and_still_learns(tmp_path):
    config = ROOT / "configs/quickstart_advstar.yaml"
    run_dir, out = threaded_run(tmp_path, "advstar", ["runtime.timeout_s=60", *F16], config)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if r["type"] == "eval"]
    print(f"advstar on a float16 wire: final test error {evals[-1]['test_error']:.2%}")
    assert evals and evals[-1]["test_error"] <= 0.10, evals[-1]
