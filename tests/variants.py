"""The kernel variants, for tests that run once per variant (``rudra_zmq.kernels.variants``).

``PARAMS`` lists every variant; those this CPU cannot run, or this install did not build, are
skipped with the reason. A test file turns them into a fixture::

    @pytest.fixture(params=variants.PARAMS)
    def k(request):
        return variants.load(request.param)

``OTHERS``: the same, less the baseline (the variant the others are compared with).
"""

import pytest

from rudra_zmq import kernels
from rudra_zmq.kernels import variants as kv


def _skip_reason(name: str) -> str | None:
    lacking = kv.missing(name, kernels.CPU_FEATURES)
    if lacking:
        return f"this CPU lacks {', '.join(lacking)} for the {name} kernels"
    if name not in kernels.built_variants():
        return f"this install has no {name} kernels (the compiler rejected its -march)"
    return None


PARAMS = [
    pytest.param(v, marks=pytest.mark.skip(reason=r)) if (r := _skip_reason(v)) else v
    for v in kv.VARIANTS
]
# every variant but the baseline, to compare with it
OTHERS = [p for p in PARAMS if getattr(p, "values", (p,))[0] != kv.BASELINE]


def load(name: str):
    """The extension module of variant ``name`` (one this CPU runs)."""
    return kernels.load_variant(name)
