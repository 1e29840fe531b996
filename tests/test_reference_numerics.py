"""Hand-computed checks of the shared primitives (formats.md §0, §1.1)."""
import math

import pytest
import torch

import _scalar_reference as sref
from lpmoe.reference.numerics import (
    FP8_MAX,
    INPUT_DTYPE_MAX,
    cast_to_fp8_satfinite,
    ceil_div,
    compute_block_scale,
    e2m1_decode,
    e2m1_encode,
    exp2f,
    exp2f_rcp,
    float_to_e8m0,
    nan_ignoring_amax,
    nan_to_zero_abs,
    pack_e2m1,
    round_up,
    unpack_e2m1,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def bits(t):
    return t.float().view(torch.int32).tolist()


def from_bits(b):
    return torch.tensor(b, dtype=torch.int32).view(torch.float32)


def fp8_bytes(values, dtype):
    return cast_to_fp8_satfinite(f32(values), dtype).view(torch.uint8).tolist()


# ----------------------------------------------------------------------------- helpers / amax
def test_integer_helpers():
    assert [ceil_div(a, 128) for a in (0, 1, 128, 129, 256)] == [0, 1, 1, 2, 2]
    assert [round_up(a, 4) for a in (0, 1, 4, 5, 129)] == [0, 4, 4, 8, 132]


def test_nan_to_zero_abs_and_amax():
    x = f32([NAN, -INF, -3.0, 2.0, -NAN])
    assert nan_to_zero_abs(x).tolist() == [0.0, INF, 3.0, 2.0, 0.0]
    assert nan_ignoring_amax(f32([NAN, -3.0, 2.0])).tolist() == [3.0]
    assert nan_ignoring_amax(f32([NAN, -INF])).tolist() == [INF]
    assert nan_ignoring_amax(f32([NAN, NAN])).tolist() == [0.0]
    assert nan_ignoring_amax(torch.zeros(0, 7)).tolist() == [0.0]
    # bf16 input: amax is exact
    assert nan_ignoring_amax(torch.tensor([-1.5, NAN], dtype=torch.bfloat16)).tolist() == [1.5]


# ----------------------------------------------------------------------------- FP8 cast
def test_fp8_e4m3_saturating_cast_traps():
    vals = [470.0, -470.0, 1e6, INF, -INF, NAN, -NAN, 464.0, 448.0, 0.0, -0.0, -1e-9, 1.0,
            2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 1 + 2.0 ** -4, 1 + 3 * 2.0 ** -4, -1.0]
    expect = [0x7E, 0xFE, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x7E, 0x7E, 0x00, 0x80, 0x80, 0x38,
              0x01, 0x00, 0x01, 0x38, 0x3A, 0xB8]
    assert fp8_bytes(vals, E4M3) == expect


def test_fp8_e5m2_saturating_cast_traps():
    vals = [1e6, -1e6, 57344.0, 60000.0, 61440.0, 65536.0, INF, -INF, NAN, -NAN, -0.0, 1.0,
            2.0 ** -16, 2.0 ** -17, 1.125, 1.375]
    expect = [0x7B, 0xFB, 0x7B, 0x7B, 0x7B, 0x7B, 0x7B, 0xFB, 0x7F, 0x7F, 0x80, 0x3C,
              0x01, 0x00, 0x3C, 0x3E]
    assert fp8_bytes(vals, E5M2) == expect


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_cast_every_code_midpoint_and_neighbours(dtype):
    """Every representable value, every midpoint (ties to even) and the fp32 neighbours of it."""
    e5m2 = dtype == E5M2
    table = sref.E5M2_VALUES if e5m2 else sref.E4M3_VALUES
    probes = list(table)
    for lo, hi in zip(table[:-1], table[1:]):
        mid = torch.tensor((lo + hi) / 2, dtype=torch.float32)
        probes += [mid.item(), torch.nextafter(mid, f32(-1.0)).item(),
                   torch.nextafter(mid, f32(INF)).item()]
    probes += [-p for p in probes]
    got = fp8_bytes(probes, dtype)
    assert got == [sref.fp8_byte(p, e5m2) for p in probes]
    # and the decoded value of every code agrees with torch's fp8 -> fp32
    codes = torch.arange(256, dtype=torch.uint8)
    dec = codes.view(dtype).float().tolist()
    for c, v in enumerate(dec):
        ref = sref.fp8_value(c, e5m2)
        assert (math.isnan(v) and math.isnan(ref)) or v == ref, c


def test_fp8_cast_rejects_bad_dtype():
    with pytest.raises(ValueError, match="fp8_dtype"):
        cast_to_fp8_satfinite(f32([1.0]), torch.float16)


# ----------------------------------------------------------------------------- block scale
def scale_of(amax, dtype=E4M3, pow2=True, eps=0.0, in_dtype=torch.float32):
    s, s_inv = compute_block_scale(f32([amax]), dtype, pow2, eps, in_dtype)
    return s.item(), s_inv.item(), bits(s)[0], bits(s_inv)[0]


def test_block_scale_ordinary_values():
    assert scale_of(3.0)[:2] == (128.0, 1 / 128)               # 448/3 = 149.33 -> 2^7
    assert scale_of(3.0, pow2=False)[2] == 0x43155555          # fl(448/3)
    assert scale_of(3.0, pow2=False)[3] == bits(f32([1.0]) / from_bits([0x43155555]))[0]
    assert scale_of(448.0)[:2] == (1.0, 1.0)
    assert scale_of(449.0)[:2] == (0.5, 2.0)
    assert scale_of(0.5)[:2] == (512.0, 1 / 512)               # 896 -> 512
    assert scale_of(1.0, dtype=E5M2)[:2] == (32768.0, 2.0 ** -15)
    s, s_inv = compute_block_scale(f32([1.0]), E5M2, False, 0.0, torch.float32)
    assert s.item() == 57344.0 and bits(s_inv) == bits(f32([1.0]) / f32([57344.0]))


def test_block_scale_zero_inf_nan_amax_give_one():
    for amax in (0.0, INF, NAN):
        for pow2 in (True, False):
            assert scale_of(amax, pow2=pow2)[:2] == (1.0, 1.0)


def test_block_scale_eps_applied_before_zero_check():
    # amax 0 with eps 1e-3: scale = 448/fl(1e-3) = 447999.97 -> pow2 2^18 (NOT 1)
    assert scale_of(0.0, eps=1e-3)[:2] == (2.0 ** 18, 2.0 ** -18)
    assert scale_of(0.0, eps=1e-3, pow2=False)[0] == 447999.96875
    assert scale_of(0.5, eps=1.0)[:2] == (256.0, 1 / 256)      # amax raised to eps = 1
    assert scale_of(2.0, eps=1.0)[:2] == (128.0, 1 / 128)      # eps below amax: no effect


def test_block_scale_tiny_amax_uses_input_dtype_max():
    tiny = 1e-38  # 448 / tiny overflows fp32
    # fp32 input: FLT_MAX -> pow2 2^127; scale_inv is the fp32 subnormal 2^-127
    s, s_inv, sb, sib = scale_of(tiny, in_dtype=torch.float32)
    assert s == 2.0 ** 127 and sib == 0x00400000
    s, s_inv, sb, sib = scale_of(tiny, in_dtype=torch.float32, pow2=False)
    assert sb == 0x7F7FFFFF and sib == 0x00200000              # fl(1/FLT_MAX) = 2^-128
    # bf16: 0x1.FEp127 -> pow2 2^127
    s, s_inv, sb, sib = scale_of(tiny, in_dtype=torch.bfloat16, pow2=False)
    assert s == INPUT_DTYPE_MAX[torch.bfloat16] == float.fromhex("0x1.FEp127")
    assert scale_of(tiny, in_dtype=torch.bfloat16)[3] == 0x00400000
    # fp16: 65504 -> pow2 2^15
    assert scale_of(tiny, in_dtype=torch.float16, pow2=False)[0] == 65504.0
    assert scale_of(tiny, in_dtype=torch.float16)[:2] == (32768.0, 2.0 ** -15)


def test_block_scale_is_vectorised_and_shape_preserving():
    amax = f32([[0.0, 3.0], [INF, 448.0]])
    s, s_inv = compute_block_scale(amax, E4M3, True, 0.0, torch.float32)
    assert s.shape == (2, 2) and s.tolist() == [[1.0, 128.0], [1.0, 1.0]]
    assert s_inv.tolist() == [[1.0, 1 / 128], [1.0, 1.0]]


def test_block_scale_matches_scalar_model_on_many_amaxes():
    g = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.exp(torch.randn(2000, generator=g) * 30).clamp(max=3e38),
                      f32([0.0, INF, 1e-38, 1e-45, 448.0, 449.0, 3.0])])
    for dtype in (E4M3, E5M2):
        for pow2 in (True, False):
            for in_dtype in (torch.float32, torch.bfloat16, torch.float16):
                for eps in (0.0, 1.0):
                    s, s_inv = compute_block_scale(amax, dtype, pow2, eps, in_dtype)
                    ref = [sref.block_scale(a, FP8_MAX[dtype], pow2, eps, INPUT_DTYPE_MAX[in_dtype])
                           for a in amax.tolist()]
                    assert bits(s) == bits(f32([float(r[0]) for r in ref]))
                    assert bits(s_inv) == bits(f32([float(r[1]) for r in ref]))


# ----------------------------------------------------------------------------- E8M0
def test_float_to_e8m0_table():
    rcp448 = from_bits([0x3B124925])  # fl(1/448)
    products = (f32([1.0, 448.0, 449.0, 500.0, 0.0]) * rcp448).tolist()
    vals = products + [1.0, 1.5, 2.0, 2.0 ** -126, 1.5 * 2.0 ** -126, 2.0 ** 127, 1.5 * 2.0 ** 127,
                       3.4028234663852886e38, INF, NAN, -0.0]
    expect = [119, 127, 128, 128, 0, 127, 128, 128, 1, 2, 254, 254, 254, 254, 255, 0]
    assert float_to_e8m0(f32(vals)).tolist() == expect
    # fp32 subnormal inputs: (0, 2^-127] -> 0, (2^-127, 2^-126) -> 1
    sub = from_bits([0x00000001, 0x00200000, 0x00400000, 0x00400001, 0x007FFFFF, 0x00800000])
    assert float_to_e8m0(sub).tolist() == [0, 0, 0, 1, 1, 1]
    assert float_to_e8m0(sub).dtype == torch.uint8


def test_float_to_e8m0_matches_scalar_model():
    g = torch.Generator().manual_seed(1)
    v = torch.cat([torch.exp(torch.randn(5000, generator=g) * 40).clamp(max=3e38),
                   torch.randint(0, 1 << 31, (3000,), generator=g, dtype=torch.int32).view(torch.float32).abs()])
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)
    assert float_to_e8m0(v).tolist() == [sref.e8m0(x) for x in v.tolist()]


def test_exp2f_rcp_and_exp2f_bits():
    e = torch.tensor([0, 1, 126, 127, 128, 253, 254, 255], dtype=torch.uint8)
    r = exp2f_rcp(e)
    assert bits(r)[:7] == [0x7F000000, 0x7E800000, 0x3F800000 + (1 << 23), 0x3F800000,
                           0x3F000000, 0x00800000, 0x00400000]
    assert math.isnan(r[7].item())
    d = exp2f(e)
    assert bits(d)[:7] == [0x00400000, 0x00800000, 0x3F000000, 0x3F800000, 0x40000000,
                           0x7E800000, 0x7F000000]
    assert math.isnan(d[7].item())
    # exact reciprocals for all normal exponents; spec's ldexp equivalence for 0..254
    all_e = torch.arange(0, 255, dtype=torch.int32)
    assert bits(exp2f(all_e)) == bits(torch.ldexp(torch.ones(255), all_e - 127))
    assert bits(exp2f_rcp(all_e)) == bits(torch.ldexp(torch.ones(255), 127 - all_e))


def test_subnormals_survive_cpu_arithmetic():
    # exp2f_rcp(254) / exp2f(0) = 2^-127 must not be flushed in products either
    one_five = f32([1.5])
    assert bits(one_five * exp2f_rcp(torch.tensor([254])))[0] == 0x00600000
    assert bits(exp2f(torch.tensor([0])) * f32([3.0]))[0] == 0x00C00000  # 3*2^-127 = 1.5*2^-126
    assert bits(f32([1.0]) / f32([2.0 ** 127]))[0] == 0x00400000


# ----------------------------------------------------------------------------- E2M1
E2M1_CASES = [
    (0.0, 0), (0.1, 0), (0.25, 0), (0.5, 1), (0.75, 2), (1.0, 2), (1.25, 2), (1.5, 3),
    (1.75, 4), (2.0, 4), (2.5, 4), (3.0, 5), (3.5, 6), (4.0, 6), (5.0, 6), (6.0, 7), (7.0, 7),
    (1e30, 7), (INF, 7), (NAN, 7), (-NAN, 7), (-0.0, 8), (-0.1, 8), (-0.25, 8), (-0.75, 10),
    (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14), (-6.0, 15), (-INF, 15),
]


def test_e2m1_encode_table_with_ties_to_even():
    vals = [v for v, _ in E2M1_CASES]
    assert e2m1_encode(f32(vals)).tolist() == [c for _, c in E2M1_CASES]


def test_e2m1_threshold_neighbours():
    # just above a round-down tie goes up, just below a round-up tie goes down
    ties_down = [0.25, 1.25, 2.5, 5.0]   # go to the lower (even) code
    ties_up = [0.75, 1.75, 3.5]          # go to the upper (even) code
    above = torch.nextafter(f32(ties_down), f32([INF] * 4))
    assert e2m1_encode(above).tolist() == [1, 3, 5, 7]
    below = torch.nextafter(f32(ties_up), f32([0.0] * 3))
    assert e2m1_encode(below).tolist() == [1, 3, 5]


def test_e2m1_encode_matches_nearest_even_model():
    grid = torch.arange(-9 * 64, 9 * 64 + 1, dtype=torch.float32) / 64   # includes all ties
    g = torch.Generator().manual_seed(2)
    x = torch.cat([grid, torch.randn(4000, generator=g) * 4])
    assert e2m1_encode(x).tolist() == [sref.e2m1_code(v) for v in x.tolist()]


def test_e2m1_decode_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    dec = e2m1_decode(codes)
    assert dec.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(dec[8]).item()
    assert e2m1_encode(dec).tolist() == list(range(16))


def test_pack_unpack_e2m1_order():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 8, 7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x78]]   # even element in the low nibble
    assert torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_e2m1(torch.zeros(2, dtype=torch.int32))
