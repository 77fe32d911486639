"""Every compiled kernel, in every variant this CPU runs, against its NumPy twin
(tests/oracles.py)."""

import numpy as np
import pytest

import oracles
import rudra_zmq
import variants
from rudra_zmq import kernels

SIZES = [0, 1, 7, 1001, 70_001, 300_007]  # the last above the kernels' parallel minimum (2**18)
DTYPES = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=2e-6, atol=2e-6), np.float64: dict(rtol=1e-13, atol=1e-13)}


def _arrays(n, dtype, count, seed=0):
    rng = np.random.default_rng(seed + n)
    return [rng.standard_normal(n).astype(dtype) for _ in range(count)]


@pytest.fixture(params=variants.PARAMS)
def k(request):
    """The kernels of one variant (the tests taking it run once per variant)."""
    return variants.load(request.param)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, k):
    old = k.get_num_threads()
    k.set_num_threads(request.param)
    yield request.param
    k.set_num_threads(old)


@pytest.fixture(params=variants.OTHERS)
def other(request):
    """The kernels of each variant but the baseline."""
    return variants.load(request.param)


def test_extension_is_the_compiled_module_of_the_chosen_variant():
    info = rudra_zmq.build_info()
    module = kernels.load_variant(info["variant"])
    assert module.__file__.endswith((".so", ".pyd")), module.__file__
    assert info["module_file"] == module.__file__
    assert module.compile_info()["variant"] == info["variant"]
    assert kernels.accumulate is module.accumulate
    assert info["cython_version"].startswith("3")
    assert info["num_threads"] >= 1
    assert isinstance(info["openmp"], bool)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_matches_numpy(n, dtype, k, threads):
    acc, g = _arrays(n, dtype, 2)
    ref = acc.copy()
    oracles.accumulate(ref, g)
    k.accumulate(acc, g)
    np.testing.assert_allclose(acc, ref, **TOL[dtype])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_scaled_matches_numpy(n, dtype, k, threads):
    acc, g = _arrays(n, dtype, 2)
    ref = acc.copy()
    oracles.accumulate_scaled(ref, g, 0.37)
    k.accumulate_scaled(acc, g, 0.37)
    np.testing.assert_allclose(acc, ref, **TOL[dtype])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_matches_numpy(n, dtype, k, threads):
    (x,) = _arrays(n, dtype, 1)
    ref = x.copy()
    oracles.scale(ref, -1.5)
    k.scale(x, -1.5)
    np.testing.assert_allclose(x, ref, **TOL[dtype])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_into_is_exact(n, dtype, k, threads):
    dst, src = _arrays(n, dtype, 2)
    k.copy_into(dst, src)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_acc", [False, True])
def test_sgd_momentum_step_matches_numpy(n, dtype, zero_acc, k, threads):
    w, v, acc = _arrays(n, dtype, 3)
    rw, rv, racc = w.copy(), v.copy(), acc.copy()
    args = dict(lr=0.01, momentum=0.9, weight_decay=0.004, g_scale=0.25, zero_acc=zero_acc)
    for _ in range(3):  # several steps so momentum carries over
        oracles.sgd_momentum_step(rw, rv, racc, **args)
        k.sgd_momentum_step(w, v, acc, **args)
        if zero_acc:
            acc += 1.0
            racc += 1.0
    np.testing.assert_allclose(v, rv, **TOL[dtype])
    np.testing.assert_allclose(w, rw, **TOL[dtype])
    np.testing.assert_array_equal(acc, racc)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_acc", [False, True])
def test_sgd_step_matches_numpy(n, dtype, zero_acc, k, threads):
    w, acc = _arrays(n, dtype, 2)
    rw, racc = w.copy(), acc.copy()
    args = dict(lr=0.05, weight_decay=0.004, g_scale=0.5, zero_acc=zero_acc)
    oracles.sgd_step(rw, racc, **args)
    k.sgd_step(w, acc, **args)
    np.testing.assert_allclose(w, rw, **TOL[dtype])
    np.testing.assert_array_equal(acc, racc)


@pytest.mark.parametrize("n", [1, 1001, 300_000])
@pytest.mark.parametrize("zero_acc", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_out_of_place_step_equals_in_place_and_leaves_w_untouched(
    n, zero_acc, momentum, k, threads
):
    """The PS writes the next weight version into another buffer (out=) while the current
    one is being sent: the result must be bit-identical to the in-place step, and the
    input weights (read-only here, like a buffer in flight) must not change."""
    w, v, acc = _arrays(n, np.float32, 3)
    w_in = w.copy()
    w_in.flags.writeable = False
    v2, acc2, out = v.copy(), acc.copy(), np.full(n, np.nan, np.float32)
    if momentum:
        k.sgd_momentum_step(w, v, acc, 0.01, momentum, 0.004, 0.5, zero_acc)
        k.sgd_momentum_step(w_in, v2, acc2, 0.01, momentum, 0.004, 0.5, zero_acc, out=out)
    else:
        k.sgd_step(w, acc, 0.01, 0.004, 0.5, zero_acc)
        k.sgd_step(w_in, acc2, 0.01, 0.004, 0.5, zero_acc, out=out)
    np.testing.assert_array_equal(out, w)
    np.testing.assert_array_equal(v2, v)
    np.testing.assert_array_equal(acc2, acc)
    assert not np.array_equal(w_in, w)


@pytest.mark.parametrize("n", [1, 1001, 300_000])
@pytest.mark.parametrize("zero_acc", [False, True])
def test_momentum_into_separate_buffers_equals_in_place_and_leaves_v_untouched(
    n, zero_acc, k, threads
):
    """An update computed aside (out=, v_out=) writes the new weights and the new momentum
    into spare buffers: bit-identical to the in-place step, with w and v (read-only here)
    unchanged, so the result can be adopted or dropped without losing anything."""
    w, v, acc = _arrays(n, np.float32, 3)
    w_in, v_in = w.copy(), v.copy()
    w_in.flags.writeable = v_in.flags.writeable = False
    acc2 = acc.copy()
    out, v_out = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    k.sgd_momentum_step(w, v, acc, 0.01, 0.9, 0.004, 0.5, zero_acc)
    k.sgd_momentum_step(w_in, v_in, acc2, 0.01, 0.9, 0.004, 0.5, zero_acc, out=out, v_out=v_out)
    np.testing.assert_array_equal(out, w)
    np.testing.assert_array_equal(v_out, v)
    np.testing.assert_array_equal(acc2, acc)
    assert not np.array_equal(v_in, v)


def test_v_out_must_be_writable_same_shape_and_not_partly_overlap_v():
    w, v, acc = _arrays(100, np.float32, 3)
    before = v.copy()
    ro = np.zeros(100, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="v_out is read-only"):
        kernels.sgd_momentum_step(w, v, acc, 0.1, 0.9, out=np.zeros(100, np.float32), v_out=ro)
    big = np.zeros(101, np.float32)
    with pytest.raises(ValueError, match="v_out overlaps v"):
        kernels.sgd_momentum_step(w, big[:100], acc, 0.1, 0.9, v_out=big[1:])
    with pytest.raises(ValueError, match="v_out has 99 elements"):
        kernels.sgd_momentum_step(w, v, acc, 0.1, 0.9, v_out=np.zeros(99, np.float32))
    np.testing.assert_array_equal(v, before)


def test_out_must_be_writable_same_shape_and_not_partly_overlap_w():
    w, v, acc = _arrays(100, np.float32, 3)
    before = w.copy()
    ro = np.zeros(100, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        kernels.sgd_momentum_step(w, v, acc, 0.1, 0.9, out=ro)
    with pytest.raises(ValueError, match="has 100 elements but out has 99"):
        kernels.sgd_step(w, acc, 0.1, out=np.zeros(99, np.float32))
    big = np.zeros(101, np.float32)
    with pytest.raises(ValueError, match="out overlaps w"):
        kernels.sgd_step(big[:100], acc, 0.1, out=big[1:])
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        kernels.sgd_step(w, acc, 0.1, out=[0.0] * 100)
    np.testing.assert_array_equal(w, before)
    kernels.sgd_step(w, acc, 0.1, out=w)  # out is w: in place
    assert not np.array_equal(w, before)


def test_read_only_zmq_like_inputs_are_accepted(k):
    g = np.arange(10, dtype=np.float32)
    frame = np.frombuffer(g.tobytes(), dtype=np.float32)  # read-only, as from a zmq.Frame
    assert not frame.flags.writeable
    acc = np.ones(10, np.float32)
    k.accumulate(acc, frame)
    k.accumulate_scaled(acc, frame, 2.0)
    w, v = np.zeros(10, np.float32), np.zeros(10, np.float32)
    k.sgd_momentum_step(w, v, frame, lr=1.0, momentum=0.0)
    k.sgd_step(w, frame, lr=1.0)
    k.copy_into(acc, frame)
    np.testing.assert_array_equal(w, -2 * g)
    np.testing.assert_array_equal(acc, g)


def test_mismatched_length_names_both_sizes_and_writes_nothing():
    acc = np.zeros(89_578, np.float32)
    g = np.ones(89_570, np.float32)
    with pytest.raises(ValueError, match=r"g has 89,570 elements but acc has 89,578"):
        kernels.accumulate(acc, g)
    assert not acc.any()


def test_mismatched_dtype_is_a_value_error_naming_dtypes():
    with pytest.raises(ValueError, match="g is float64 but acc is float32"):
        kernels.accumulate(np.zeros(4, np.float32), np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="dtype int32"):
        kernels.scale(np.zeros(4, np.int32), 2.0)


def test_read_only_output_and_zeroed_read_only_acc_are_refused():
    ro = np.frombuffer(np.zeros(4, np.float32).tobytes(), np.float32)
    with pytest.raises(ValueError, match="acc is read-only"):
        kernels.accumulate(ro, np.zeros(4, np.float32))
    w, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="acc is read-only"):
        kernels.sgd_momentum_step(w, v, ro, lr=0.1, momentum=0.9, zero_acc=True)
    assert not w.any()


def test_non_contiguous_non_array_and_nonfinite_arguments_are_refused():
    x = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.scale(x[::2], 2.0)
    with pytest.raises(ValueError, match="1-D"):
        kernels.scale(np.zeros((2, 2), np.float32), 2.0)
    with pytest.raises(TypeError, match="numpy.ndarray, got bytes"):
        kernels.accumulate(x, b"\0" * 40)
    with pytest.raises(ValueError, match="lr must be finite, got nan"):
        kernels.sgd_step(x, x.copy(), lr=float("nan"))


def test_thread_settings_are_validated():
    with pytest.raises(ValueError, match="at least 1 thread, got 0"):
        kernels.set_num_threads(0)
    with pytest.raises(ValueError, match="n >= 0"):
        kernels.set_parallel_threshold(-1)


STEPS = {
    "accumulate": lambda k, a: k.accumulate(a[0], a[1]),
    "accumulate_scaled": lambda k, a: k.accumulate_scaled(a[0], a[1], 0.37),
    "scale": lambda k, a: k.scale(a[0], -1.5),
    "sgd_momentum_step": lambda k, a: k.sgd_momentum_step(*a, 0.01, 0.9, 0.004, 0.25),
    "sgd_momentum_step(zero_acc)": lambda k, a: k.sgd_momentum_step(
        *a, 0.01, 0.9, 0.004, 0.25, zero_acc=True
    ),
    "sgd_step": lambda k, a: k.sgd_step(a[0], a[1], 0.05, 0.004, 0.5),
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_variant_computes_the_baseline_bits(other, step, dtype):
    """Variants differ in speed only: the same update on another CPU ends with the same
    weights, bit for bit (setup.py's -ffp-contract=off keeps FMA contraction out of the AVX2
    and AVX-512 builds). 300,007 elements: both threads and a vector loop's scalar tail."""
    base = variants.load("baseline")
    mine = _arrays(300_007, dtype, 3, seed=5)
    ref = [a.copy() for a in mine]
    for _ in range(3):
        STEPS[step](base, ref)
        STEPS[step](other, mine)
    for got, want in zip(mine, ref):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _shifted(arrays, offset):
    """Copies of ``arrays``, the i-th placed ``offset + i`` elements into a buffer of its own:
    each at another distance from a 64-byte boundary."""
    out = []
    for i, a in enumerate(arrays):
        buf = np.empty(a.shape[0] + 32, a.dtype)
        out.append(buf[offset + i : offset + i + a.shape[0]])
        out[-1][...] = a
    return out


@pytest.mark.parametrize("offset", [0, 1, 3, 13])
@pytest.mark.parametrize("step", list(STEPS))
def test_wherever_the_arrays_lie_the_bits_are_the_same(k, threads, step, offset):
    """The kernels split their work at a 64-byte boundary of the array they write, wherever
    NumPy placed it (a head before it, each thread's part after it aligned): arrays at other
    offsets, on one or two threads, end with the bits of the baseline on one thread."""
    base = variants.load("baseline")
    old = base.get_num_threads()
    arrays = _arrays(300_007, np.float32, 3, seed=11)
    ref = [a.copy() for a in arrays]
    try:
        base.set_num_threads(1)
        STEPS[step](base, ref)
    finally:
        base.set_num_threads(old)
    mine = _shifted(arrays, offset)
    STEPS[step](k, mine)
    for got, want in zip(mine, ref):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
