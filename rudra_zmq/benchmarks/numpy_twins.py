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
