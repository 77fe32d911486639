"""NumPy twins of the compiled kernels: the test oracle (and the benchmark baseline).

They live in ``rudra_zmq/benchmarks/numpy_twins.py`` so that the installed benchmark
(``rudra-zmq bench kernels``) has them too; tests import them from here as ``oracles``.
"""

from rudra_zmq.benchmarks.numpy_twins import (  # noqa: F401
    accumulate,
    accumulate_bf16,
    accumulate_f16,
    accumulate_scaled,
    bf16_to_f32,
    copy_into,
    narrow_bf16,
    narrow_f16,
    scale,
    sgd_momentum_step,
    sgd_step,
    widen_bf16,
    widen_f16,
)
