"""The half-precision kernels (float16, bfloat16 as uint16 bits, against float32), in every
variant this CPU runs, against their NumPy twins (tests/oracles.py), and bfloat16 against torch
as a second, independent oracle."""

import numpy as np
import pytest

import oracles
import variants
from rudra_zmq import kernels

# the last above the kernels' parallel minimum (2**18); 1001 and 70,001 end in a part block
SIZES = [0, 1, 7, 1001, 70_001, 300_007]
HALVES = ["f16", "bf16"]
# Widening is exact, so what is left is float32 arithmetic in the accumulator (s*g, then +).
TOL = {"f16": {"rtol": 2e-6, "atol": 2e-6}, "bf16": {"rtol": 2e-6, "atol": 2e-6}}
EPS = {"f16": 2.0**-11, "bf16": 2.0**-8}  # a half's relative rounding error


def _narrow_ref(fmt, x):
    out = np.empty(x.shape[0], np.float16 if fmt == "f16" else np.uint16)
    (oracles.narrow_f16 if fmt == "f16" else oracles.narrow_bf16)(out, x)
    return out


def _half(fmt, n, seed=0):
    """A random half array of ``fmt`` (float16, or uint16 bfloat16 bits) and ``n`` values."""
    rng = np.random.default_rng(seed + n)
    return _narrow_ref(fmt, (rng.standard_normal(n) * 3).astype(np.float32))


def _widened(fmt, h):
    return h.astype(np.float32) if fmt == "f16" else oracles.bf16_to_f32(h)


def _kernel(name, fmt, k=kernels):
    return getattr(k, f"{name}_{fmt}")


def _bits(a):
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


@pytest.fixture(params=variants.PARAMS)
def k(request):
    """The kernels of one variant (the tests taking it run once per variant)."""
    return variants.load(request.param)


@pytest.fixture(params=variants.OTHERS)
def other(request):
    """The kernels of each variant but the baseline."""
    return variants.load(request.param)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, k):
    old = k.get_num_threads()
    k.set_num_threads(request.param)
    yield request.param
    k.set_num_threads(old)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", HALVES)
@pytest.mark.parametrize("s", [1.0, 0.37])
def test_accumulate_half_matches_numpy(n, fmt, s, k, threads):
    g = _half(fmt, n)
    acc = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    ref = acc.copy()
    getattr(oracles, f"accumulate_{fmt}")(ref, g, s)
    _kernel("accumulate", fmt, k)(acc, g, s)
    np.testing.assert_allclose(acc, ref, **TOL[fmt])
    if s == 1.0:  # acc + widened g: one float32 addition, bit for bit
        np.testing.assert_array_equal(acc, ref)


@pytest.mark.parametrize("fmt", HALVES)
def test_widen_is_exact_for_every_bit_pattern(fmt, k, threads):
    bits = np.arange(1 << 16, dtype=np.uint16)
    src = bits.view(np.float16) if fmt == "f16" else bits
    dst = np.full(bits.shape[0], 7.0, np.float32)
    _kernel("widen", fmt, k)(dst, src)
    ref = _widened(fmt, src)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(dst), nan)
    np.testing.assert_array_equal(_bits(dst)[~nan], _bits(ref)[~nan])  # -0.0, subnormals too


def _awkward_floats(n, seed=1):
    """Random float32 bit patterns (every magnitude, NaNs, infinities), normal values, values
    near the half formats' limits and ties."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.float32(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504,
            65519.99,
            65520,
            -65520,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-26,
            2.0**-14,
            1 + 2.0**-11,
            1 + 3 * 2.0**-11,
            1 + 2.0**-8,
            3.4e38,
            1e-40,
        ]
    )
    return np.concatenate([raw, rng.standard_normal(n).astype(np.float32) * 1e-4, edges])


@pytest.mark.parametrize("fmt", HALVES)
def test_narrow_rounds_like_numpy_bit_for_bit(fmt, k, threads):
    x = _awkward_floats(300_000)
    dst = np.empty(x.shape[0], np.float16 if fmt == "f16" else np.uint16)
    _kernel("narrow", fmt, k)(dst, x)
    with np.errstate(over="ignore"):
        ref = _narrow_ref(fmt, x)
    np.testing.assert_array_equal(_bits(dst), _bits(ref))


def test_bfloat16_agrees_with_torch():
    """The bfloat16 twins are our own bit arithmetic: check both directions against torch."""
    torch = pytest.importorskip("torch")
    x = _awkward_floats(100_000, seed=2)
    x = x[~np.isnan(x)]  # torch keeps NaN payloads its own way; NaN-ness is checked above
    bits = np.empty(x.shape[0], np.uint16)
    kernels.narrow_bf16(bits, x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, ref)
    back = np.empty(x.shape[0], np.float32)
    kernels.widen_bf16(back, bits)
    np.testing.assert_array_equal(
        back, torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16).float().numpy()
    )


@pytest.mark.parametrize("fmt", HALVES)
def test_narrow_then_widen_is_within_half_precision(fmt):
    x = np.random.default_rng(3).uniform(-100, 100, 10_001).astype(np.float32)
    h = np.empty(x.shape[0], np.float16 if fmt == "f16" else np.uint16)
    back = np.empty_like(x)
    _kernel("narrow", fmt)(h, x)
    _kernel("widen", fmt)(back, h)
    np.testing.assert_allclose(back, x, rtol=EPS[fmt], atol=1e-7)
    assert not np.array_equal(back, x)  # it did round


@pytest.mark.parametrize("fmt", HALVES)
def test_read_only_half_frames_are_accepted(fmt):
    g = _half(fmt, 10)
    frame = np.frombuffer(g.tobytes(), g.dtype)  # read-only, as from a zmq.Frame
    acc = np.zeros(10, np.float32)
    _kernel("accumulate", fmt)(acc, frame, 2.0)
    dst = np.empty(10, np.float32)
    _kernel("widen", fmt)(dst, frame)
    np.testing.assert_array_equal(acc, 2 * _widened(fmt, g))
    np.testing.assert_array_equal(dst, _widened(fmt, g))


@pytest.mark.parametrize("fmt", HALVES)
def test_bad_arguments_name_the_problem_and_write_nothing(fmt):
    hdt = np.float16 if fmt == "f16" else np.uint16
    acc = np.zeros(8, np.float32)
    accumulate = _kernel("accumulate", fmt)
    with pytest.raises(ValueError, match=r"g has 7 elements but acc has 8"):
        accumulate(acc, np.ones(7, hdt))
    with pytest.raises(ValueError, match="g has dtype float32; it must be"):
        accumulate(acc, np.ones(8, np.float32))
    with pytest.raises(ValueError, match="acc has dtype float64; it must be float32"):
        accumulate(np.zeros(8), np.ones(8, hdt))
    with pytest.raises(ValueError, match="acc is read-only"):
        accumulate(np.frombuffer(acc.tobytes(), np.float32), np.ones(8, hdt))
    with pytest.raises(ValueError, match="C-contiguous"):
        accumulate(acc, np.ones(16, hdt)[::2])
    with pytest.raises(TypeError, match="numpy.ndarray, got bytes"):
        accumulate(acc, b"\0" * 16)
    with pytest.raises(ValueError, match="s must be finite, got inf"):
        accumulate(acc, np.ones(8, hdt), float("inf"))
    assert not acc.any()
    out = np.zeros(8, hdt)
    with pytest.raises(ValueError, match="dst is read-only"):
        _kernel("narrow", fmt)(np.frombuffer(out.tobytes(), hdt), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="src has 9 elements but dst has 8"):
        _kernel("widen", fmt)(acc, np.ones(9, hdt))
    assert not acc.any() and not out.any()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", HALVES)
def test_narrow_with_feedback_matches_numpy_bit_for_bit(n, fmt, k, threads):
    """v = src + residual (float32), dst = v narrowed (nearest even), residual = v - dst."""
    rng = np.random.default_rng(n)
    src = (rng.standard_normal(n) * 3).astype(np.float32)
    res = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = src + res
    want_dst = _narrow_ref(fmt, v)
    want_res = v - _widened(fmt, want_dst)
    dst = np.empty(n, want_dst.dtype)
    src_before = src.copy()
    getattr(k, f"narrow_{fmt}_feedback")(dst, src, res)
    np.testing.assert_array_equal(_bits(dst), _bits(want_dst))
    np.testing.assert_array_equal(_bits(res), _bits(want_res))
    np.testing.assert_array_equal(src, src_before)  # src is only read


@pytest.mark.parametrize("fmt", HALVES)
def test_narrow_with_feedback_saturates_instead_of_poisoning_the_residual(fmt, k):
    """A finite value past the half range goes out as the largest finite half and the excess
    stays in the residual, to follow: plain narrowing's infinity would leave inf - inf = NaN
    in the residual and every later vector NaN."""
    big = 1e5 if fmt == "f16" else 3.4e38
    top = 65504.0 if fmt == "f16" else float(_widened("bf16", np.array([0x7F7F], np.uint16))[0])
    k = getattr(k, f"narrow_{fmt}_feedback")
    src = np.array([big, -big, 1.0], np.float32)
    res = np.zeros(3, np.float32)
    dst = np.empty(3, np.float16 if fmt == "f16" else np.uint16)
    k(dst, src, res)
    np.testing.assert_array_equal(_widened(fmt, dst), [top, -top, 1.0])
    assert np.isfinite(res).all()
    np.testing.assert_array_equal(res, src - np.float32([top, -top, 1.0]))
    k(dst, np.zeros(3, np.float32), res)  # the excess follows in the next push
    assert np.isfinite(_widened(fmt, dst)).all() and np.isfinite(res).all()


@pytest.mark.parametrize("fmt", HALVES)
def test_narrow_with_feedback_checks_its_residual(fmt):
    hdt = np.float16 if fmt == "f16" else np.uint16
    k = getattr(kernels, f"narrow_{fmt}_feedback")
    dst, src, res = np.zeros(8, hdt), np.ones(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="dst has 8 elements but residual has 7"):
        k(dst, src, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="residual has dtype float64"):
        k(dst, src, np.zeros(8))
    with pytest.raises(ValueError, match="residual is read-only"):
        k(dst, src, np.frombuffer(res.tobytes(), np.float32))
    with pytest.raises(ValueError, match="residual and src overlap"):
        k(dst, src, src)
    assert not dst.any() and not res.any()


def test_f16_and_bf16_are_not_confused():
    """float16 arrays go to the *_f16 kernels; bfloat16 travels as uint16 bits."""
    acc = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"uint16 \(bfloat16 bits\)"):
        kernels.accumulate_bf16(acc, np.ones(4, np.float16))
    with pytest.raises(ValueError, match="it must be float16"):
        kernels.accumulate_f16(acc, np.ones(4, np.uint16))


def test_every_kernel_says_it_releases_the_gil():
    settings = {
        "set_num_threads",
        "get_num_threads",
        "set_parallel_threshold",
        "get_parallel_threshold",
        "openmp_enabled",
    }
    for name in sorted(set(kernels.__all__) - settings):
        assert "Releases the GIL" in getattr(kernels, name).__doc__, name


@pytest.mark.parametrize("fmt", HALVES)
def test_every_variant_writes_the_baseline_bits(other, fmt):
    """The AVX2 and AVX-512 variants convert float16 with the CPU's instructions: the same
    rounding, and a NaN keeps the payload the C rule gives it (a group of values holding a NaN
    takes the C rule). Every bit pattern in a shuffled order, so NaNs sit among ordinary values
    in the groups; the float32 side: random bit patterns, edges and ordinary values."""
    base = variants.load("baseline")
    rng = np.random.default_rng(7)
    bits = rng.permutation(np.arange(1 << 16, dtype=np.uint16))
    half = bits.view(np.float16) if fmt == "f16" else bits
    x = rng.permutation(_awkward_floats(200_000, seed=8))

    def run(k):
        widened = np.empty(half.shape[0], np.float32)
        _kernel("widen", fmt, k)(widened, half)
        acc = np.linspace(-3, 3, half.shape[0], dtype=np.float32)
        _kernel("accumulate", fmt, k)(acc, half, 0.37)
        narrowed = np.empty(x.shape[0], half.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            _kernel("narrow", fmt, k)(narrowed, x)
            dst, res = np.empty(x.shape[0], half.dtype), np.full(x.shape[0], 1e-3, np.float32)
            getattr(k, f"narrow_{fmt}_feedback")(dst, x, res)
        return widened, acc, narrowed, dst, res

    for got, want in zip(run(other), run(base)):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _placed(a, offset):
    """A copy of ``a`` ``offset`` elements into a buffer of its own."""
    buf = np.empty(a.shape[0] + 32, a.dtype)
    out = buf[offset : offset + a.shape[0]]
    out[...] = a
    return out


@pytest.mark.parametrize("offset", [(0, 0), (1, 3), (5, 2), (13, 30)])
@pytest.mark.parametrize("fmt", HALVES)
@pytest.mark.parametrize("op", ["accumulate", "widen", "narrow", "narrow_feedback"])
def test_wherever_the_arrays_lie_the_bits_are_the_same(k, threads, op, fmt, offset):
    """The kernels' blocks start at a 64-byte boundary of the array they write, wherever NumPy
    placed it: the float32 and the half array at other offsets (in elements), on one or two
    threads, end with the bits of the baseline on one thread."""
    n = 300_007
    base = variants.load("baseline")
    f32 = (np.random.default_rng(3).standard_normal(n) * 3).astype(np.float32)
    half, res = _half(fmt, n, seed=4), np.full(n, 1e-3, np.float32)

    def call(mod, f, h, r):
        if op == "accumulate":
            _kernel(op, fmt, mod)(f, h, 0.37)
        elif op == "widen":
            _kernel(op, fmt, mod)(f, h)
        elif op == "narrow":
            _kernel(op, fmt, mod)(h, f)
        else:
            getattr(mod, f"narrow_{fmt}_feedback")(h, f, r)

    ref = [f32.copy(), half.copy(), res.copy()]
    old = base.get_num_threads()
    try:
        base.set_num_threads(1)
        call(base, *ref)
    finally:
        base.set_num_threads(old)
    mine = [_placed(f32, offset[0]), _placed(half, offset[1]), _placed(res, offset[0] + 1)]
    call(k, *mine)
    for got, want in zip(mine, ref):
        np.testing.assert_array_equal(_bits(got), _bits(want))
