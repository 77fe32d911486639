# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""rudra_zmq's update kernels, compiled as the AVX2 variant: x86-64-v3 (AVX2, FMA, F16C, BMI1/2).

Import ``rudra_zmq.kernels``: it picks the variant this CPU runs. The kernels are written once,
in ``_kernels.pxi`` and ``_kernels_half.pxi``; setup.py compiles them once per variant, each
with its own flags (``rudra_zmq/kernels/variants.py``).
"""

include "_kernels.pxi"
