"""The kernels' instruction-set variants: how each is compiled, and what a CPU needs to run it.

The kernels (``csrc/_kernels.pxi``) are compiled once per variant into their own extension
module, ``rudra_zmq.kernels._<name>``; ``rudra_zmq.kernels`` imports the best one this CPU
runs. setup.py reads this file to know what to build (it imports nothing, so setup.py can run
it before anything is compiled); the dispatcher reads it to choose. One table, both sides.

| variant | ``-march`` | a CPU needs (the x86-64 level's features, and the OS saving their registers) |
|---|---|---|
| ``avx512`` | ``x86-64-v4`` | AVX-512 F, BW, CD, DQ, VL, and everything ``avx2`` needs |
| ``avx2`` | ``x86-64-v3`` | AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE |
| ``baseline`` | ``x86-64-v2`` on x86-64, none elsewhere | nothing more than the package needs |

Pure data and pure functions; thread-safe.
"""

from __future__ import annotations

_V2 = ("sse3", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm")
_V3 = (*_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "lzcnt", "movbe", "os_avx")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "os_avx512")

# name -> (-march on x86-64, the features of rudra_zmq.kernels._cpu.x86_features() it needs), best
# first. The baseline needs nothing the package does not need anyway (numpy>=2.4 itself
# requires x86-64-v2), so it always loads: it is the fallback, and the only variant built on
# other architectures.
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "avx512": ("x86-64-v4", _V4),
    "avx2": ("x86-64-v3", _V3),
    "baseline": ("x86-64-v2", ()),
}
BASELINE = "baseline"
ENV = "RUDRA_ZMQ_KERNELS"  # forces a variant: baseline, avx2, avx512 (empty or auto: the best)


def module_name(variant: str) -> str:
    """``rudra_zmq.kernels._<variant>``: the extension module a variant is compiled into."""
    return f"rudra_zmq.kernels._{variant}"


def missing(variant: str, features) -> list[str]:
    """The features ``variant`` needs that ``features`` lacks, in table order ([] = runs)."""
    return [f for f in VARIANTS[variant][1] if f not in features]


def runnable(features) -> list[str]:
    """The variants a CPU with ``features`` can run, best first (always ends with baseline)."""
    return [v for v in VARIANTS if not missing(v, features)]
