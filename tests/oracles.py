"""NumPy twins of the compiled kernels: the test oracle (and the benchmark baseline).

They live in ``rudra_zmq/benchmarks/numpy_twins.py`` so that the installed benchmark
(``rudra-zmq bench kernels``) has them too; tests import them from here as ``oracles``.
"""
from rudra_zmq.benchmarks.numpy_twins import (  # noqa: F401
    accumulate, accumulate_scaled, copy_into, scale, sgd_momentum_step, sgd_step)
