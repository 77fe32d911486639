# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""rudra_zmq's update kernels, compiled as the AVX-512 variant: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL).

Import ``rudra_zmq.kernels``: it picks the variant this CPU runs. The kernels are written once,
in ``_kernels.pxi`` and ``_kernels_half.pxi``; setup.py compiles them once per variant, each
with its own flags (``rudra_zmq/kernels/variants.py``).
"""

include "_kernels.pxi"
