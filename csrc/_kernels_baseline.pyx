# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""rudra_zmq's update kernels, compiled as the portable variant (any x86-64-v2
CPU; the only variant on other architectures).

Import ``rudra_zmq.kernels``: it picks the variant this CPU runs. The kernels are written once,
in ``_kernels.pxi`` and ``_kernels_half.pxi``; setup.py compiles them once per variant, each
with its own flags (``rudra_zmq/kernels/variants.py``).
"""

include "_kernels.pxi"
