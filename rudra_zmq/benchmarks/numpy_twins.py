"""NumPy twins of the compiled kernels: the test oracle and the benchmark baseline.

Each returns nothing and updates its arguments in place with ordinary multi-op NumPy, the way
one would write it without rudra_zmq (temporaries and several passes over memory included).
They live in the package so that ``rudra-zmq bench kernels`` has its baseline wherever
rudra_zmq is installed; the tests import them through ``tests/oracles.py``.
"""

import numpy as np


def accumulate(acc, g):
    acc += g


def accumulate_scaled(acc, g, s):
    acc += acc.dtype.type(s) * g


def scale(x, s):
    x *= x.dtype.type(s)


def copy_into(dst, src):
    np.copyto(dst, src)


def sgd_momentum_step(w, v, acc, lr, momentum, weight_decay=0.0, g_scale=1.0, zero_acc=False):
    t = w.dtype.type
    v *= t(momentum)
    v += t(lr) * (t(g_scale) * acc + t(weight_decay) * w)
    w -= v
    if zero_acc:
        acc[:] = 0


def sgd_step(w, acc, lr, weight_decay=0.0, g_scale=1.0, zero_acc=False):
    t = w.dtype.type
    w -= t(lr) * (t(g_scale) * acc + t(weight_decay) * w)
    if zero_acc:
        acc[:] = 0


# Half precision. NumPy has no bfloat16: it travels as uint16 bit patterns (the top half of a
# float32), so its twins work on the bits; float16 is NumPy's own (casts round to nearest even).
def bf16_to_f32(bits):
    """bfloat16 bit patterns (uint16) as a new float32 array (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def accumulate_f16(acc, g, s=1.0):
    acc += np.float32(s) * g.astype(np.float32)


def accumulate_bf16(acc, g, s=1.0):
    acc += np.float32(s) * bf16_to_f32(g)


def widen_f16(dst, src):
    np.copyto(dst, src)


def widen_bf16(dst, src):
    np.copyto(dst, bf16_to_f32(src))


def narrow_f16(dst, src):
    np.copyto(dst, src, casting="same_kind")


def narrow_bf16(dst, src):
    bits = src.view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16  # nearest, ties even
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    np.copyto(dst, np.where(nan, (bits >> 16) | 0x40, rounded).astype(np.uint16))
