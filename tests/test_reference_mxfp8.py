"""MXFP8 reference (formats.md §2.1-2.4): E8M0 round-up, traps, layouts, swizzle, scalar model."""
import math

import pytest
import torch

import _scalar_reference as sref
from lpmoe.reference.mxfp8 import MXFP8Quantized, dequantize_mxfp8, mxfp8_scale_shape, quantize_mxfp8
from lpmoe.reference.swizzle import swizzle_scales, swizzled_index

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


def u8(t):
    return t.view(torch.uint8)


def rows_with_amax(amaxes, K=32):
    """One row per amax: the block holds amax at k=0 and amax/4 elsewhere."""
    x = torch.tensor(amaxes, dtype=torch.float32).unsqueeze(1).repeat(1, K) / 4
    x[:, 0] = torch.tensor(amaxes)
    return x


# ----------------------------------------------------------------------------- E8M0 round-up
def test_e8m0_is_ceil_pow2_of_amax_times_rcp():
    x = rows_with_amax([1.0, 448.0, 449.0, 500.0, 0.0])
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale_inv.shape == (128, 4)
    assert q.scale_inv[:5, 0].tolist() == [119, 127, 128, 128, 0]
    assert (q.scale_inv[5:] == 0).all() and (q.scale_inv[:, 1:] == 0).all()   # padding bytes 0
    # q = RN(x * 2^(127-e)): 1*256, 448*1, 449/2 = 224.5 -> 224, 500/2 = 250 -> 256
    assert q.data[:, 0].float().tolist() == [256.0, 448.0, 224.0, 256.0, 0.0]
    assert q.data[:4, 1].float().tolist() == [64.0, 112.0, 56.0, 64.0]   # (amax/4) * 2^(127-e), RN


def test_e8m0_e5m2():
    x = rows_with_amax([1.0, 57344.0, 57345.0])
    q = quantize_mxfp8(x, fp8_dtype=E5M2, columnwise=False)
    # fl(1/57344) is slightly above 1/57344, yet fl(57344 * fl(1/57344)) == 1.0 -> e 127
    assert q.scale_inv[:3, 0].tolist() == [112, 127, 128]


def test_nan_is_ignored_and_canonicalised():
    x = torch.full((1, 32), 0.5)
    x[0, 3] = NAN
    x[0, 4] = -1.0
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale_inv[0, 0].item() == 119                 # amax 1.0, NaN skipped
    assert u8(q.data)[0, 3].item() == 0x7F
    assert q.data[0, 4].item() == -256.0


def test_inf_block_gets_e254_and_subnormal_multiplier():
    x = torch.tensor([[INF, 1.0, -2.0, -INF] + [0.0] * 28])
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale_inv[0, 0].item() == 254
    # multiplier exp2f_rcp(254) = 2^-127: finite values underflow to signed zero, inf -> ±448
    assert u8(q.data)[0, :4].tolist() == [0x7E, 0x00, 0x80, 0xFE]
    y = dequantize_mxfp8(q)
    # 448 * 2^127 overflows fp32 -> inf
    assert y[0, :4].tolist() == [INF, 0.0, -0.0, -INF]


def test_subnormal_amax_products():
    # 2^-120 * fl(1/448) ~ 2^-128.8 <= 2^-127 -> e = 0, multiplier 2^127
    # 2^-118 * fl(1/448) ~ 2^-126.8 in (2^-127, 2^-126) -> e = 1, multiplier 2^126
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 2.0 ** -120, 2.0 ** -118
    q = quantize_mxfp8(x, columnwise=False)
    assert q.scale_inv[:2, 0].tolist() == [0, 1]
    assert q.data[:2, 0].float().tolist() == [128.0, 256.0]
    y = dequantize_mxfp8(q)                                 # exp2f(0) = 2^-127 (subnormal)
    assert y[:2, 0].tolist() == [2.0 ** -120, 2.0 ** -118]


def test_partial_blocks_k48_and_m48():
    x = torch.full((48, 48), 0.25)
    x[:, 40] = 2.0                                          # only in the partial row block (k 32..47)
    x[40, :] = 4.0                                          # only in the partial column block
    q = quantize_mxfp8(x)
    # rowwise: block 0 amax 0.25 -> e 117 (row 40: 4.0 -> e 121); block 1 amax 2.0 -> 120
    assert q.scale_inv.shape == (128, 4)
    assert q.scale_inv[0, :2].tolist() == [117, 120] and q.scale_inv[40, :2].tolist() == [121, 121]
    assert (q.scale_inv[:48, 2:] == 0).all() and (q.scale_inv[48:] == 0).all()
    # columnwise compact (roundup(2,4), roundup(48,128)) = (4, 128), [mb, k]
    s = q.columnwise_scale_inv
    assert s.shape == (4, 128)
    assert s[0, 0].item() == 117 and s[1, 0].item() == 121 and s[0, 40].item() == 120
    assert (s[2:] == 0).all() and (s[:, 48:] == 0).all()


# ----------------------------------------------------------------------------- layouts
SHAPES = {  # (M, K): (rowwise compact, colwise compact)
    (1, 16): ((128, 4), (4, 128)),
    (129, 144): ((256, 8), (8, 256)),
    (32, 32): ((128, 4), (4, 128)),
    (256, 640): ((256, 20), (8, 640)),
    (0, 64): ((0, 4), (0, 128)),
    (64, 0): ((128, 0), (4, 0)),
}


@pytest.mark.parametrize("mk", list(SHAPES))
def test_scale_shapes(mk):
    M, K = mk
    assert (mxfp8_scale_shape(M, K, False), mxfp8_scale_shape(M, K, True)) == SHAPES[mk]
    x = torch.randn(M, K)
    q = quantize_mxfp8(x)
    assert q.data.shape == (M, K) and q.columnwise_data.shape == (M, K)    # NOT transposed
    assert q.scale_inv.shape == SHAPES[mk][0] and q.scale_inv.dtype == torch.uint8
    assert q.columnwise_scale_inv.shape == SHAPES[mk][1]
    qs = quantize_mxfp8(x, swizzled=True)
    assert qs.scale_inv.shape == (math.prod(SHAPES[mk][0]),)
    assert qs.columnwise_scale_inv.shape == (math.prod(SHAPES[mk][1]),)
    assert dequantize_mxfp8(q).shape == (M, K) and dequantize_mxfp8(qs).shape == (M, K)


def test_columnwise_is_rowwise_of_transpose_and_swizzled_transposed():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 300, generator=g) * torch.exp(torch.randn(160, 1, generator=g))
    q, qt = quantize_mxfp8(x), quantize_mxfp8(x.T.contiguous())
    assert torch.equal(u8(q.columnwise_data), u8(qt.data).T)
    assert torch.equal(q.columnwise_scale_inv, qt.scale_inv.T)
    qs = quantize_mxfp8(x, swizzled=True)
    assert qs.with_gemm_swizzled_scales
    assert torch.equal(qs.scale_inv, swizzle_scales(q.scale_inv))
    # columnwise: i = column k, j = row block mb, over the (roundup(K,128), roundup(M/32,4)) matrix
    comp = q.columnwise_scale_inv                           # (8, 384) = [mb, k]
    cols = comp.shape[0]
    mb = torch.arange(comp.shape[0]).unsqueeze(1).expand_as(comp)
    k = torch.arange(comp.shape[1]).unsqueeze(0).expand_as(comp)
    idx = swizzled_index(k, mb, cols)
    assert torch.equal(qs.columnwise_scale_inv[idx], comp)


# ----------------------------------------------------------------------------- scalar model
def spiky(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 10)
    flat = x.view(-1)
    pick = torch.randint(0, flat.numel(), (6,), generator=g)
    flat[pick[0]], flat[pick[1]], flat[pick[2]], flat[pick[3]] = NAN, INF, -INF, 0.0
    x[1, :] = 0.0
    x[2, :] = 2.0 ** -130
    return x.to(dtype)


@pytest.mark.parametrize("dtype,fp8_dtype", [(torch.float32, E4M3), (torch.bfloat16, E5M2),
                                             (torch.float16, E4M3)])
def test_matches_scalar_model(dtype, fp8_dtype):
    M, K = 70, 100                                          # partial blocks both ways
    x = spiky(M, K, dtype, seed=7)
    q = quantize_mxfp8(x, fp8_dtype)
    xl = x.float().tolist()
    e5 = fp8_dtype == E5M2
    for m in range(M):
        for kb in range(math.ceil(K / 32)):
            ks = range(32 * kb, min(32 * kb + 32, K))
            b, e = sref.mxfp8_block([xl[m][k] for k in ks], e5)
            assert u8(q.data)[m, ks.start:ks.stop].tolist() == b
            assert q.scale_inv[m, kb].item() == e
    for k in range(K):
        for mb in range(math.ceil(M / 32)):
            ms = range(32 * mb, min(32 * mb + 32, M))
            b, e = sref.mxfp8_block([xl[m][k] for m in ms], e5)
            assert u8(q.columnwise_data)[ms.start:ms.stop, k].tolist() == b
            assert q.columnwise_scale_inv[mb, k].item() == e


# ----------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("fp8_dtype,rel", [(E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)])
def test_round_trip_error_bound(fp8_dtype, rel):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(96, 160, generator=g) * torch.exp(torch.randn(96, 1, generator=g) * 4)
    amax_r = x.abs().view(96, 5, 32).amax(-1).repeat_interleave(32, 1)
    amax_c = x.abs().view(3, 32, 160).amax(1).repeat_interleave(32, 0)
    for sw in (False, True):
        q = quantize_mxfp8(x, fp8_dtype, swizzled=sw)
        y = dequantize_mxfp8(q)
        assert ((y - x).abs() <= rel * amax_r).all()
        big = x.abs() >= amax_r * 2.0 ** -5
        assert ((y - x).abs() <= rel * x.abs())[big].all()
        yc = dequantize_mxfp8(MXFP8Quantized(None, None, q.columnwise_data, q.columnwise_scale_inv,
                                             fp8_dtype, sw))
        assert ((yc - x).abs() <= rel * amax_c).all()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("swizzled", [False, True])
def test_dequantize_random_bytes_and_all_scales(fp8_dtype, swizzled):
    """Random data bytes and every scale byte 0..255: y = fl(q * 2^(e-127)), 255 -> NaN."""
    g = torch.Generator().manual_seed(9)
    M, K = 128, 256                                           # 8 scale columns * 128 rows
    data = torch.randint(0, 256, (M, K), dtype=torch.uint8, generator=g)
    if fp8_dtype == E4M3:
        data[(data & 0x7F) == 0x7F] = 0x01                    # keep NaNs out of the data
    else:
        data[(data & 0x7F) >= 0x7C] = 0x01
    e = torch.arange(M * K // 32, dtype=torch.int64).reshape(M, K // 32) % 256
    e = e.to(torch.uint8)
    s = swizzle_scales(e) if swizzled else e
    ref = data.view(fp8_dtype).double() * torch.pow(2.0, e.double() - 127).repeat_interleave(32, 1)
    ref = torch.where((e == 255).repeat_interleave(32, 1), torch.full_like(ref, NAN), ref)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        q = MXFP8Quantized(data.view(fp8_dtype), s, None, None, fp8_dtype, swizzled)
        y = dequantize_mxfp8(q, dt)
        expect = ref.float().to(dt)   # exact double product, rounded to fp32 once, then to dt
        assert y.dtype == dt
        assert torch.equal(torch.isnan(y), torch.isnan(expect))
        assert torch.equal(torch.nan_to_num(y, nan=0.0), torch.nan_to_num(expect, nan=0.0))
        assert torch.equal(torch.signbit(torch.nan_to_num(y)), torch.signbit(torch.nan_to_num(expect)))
    # the columnwise path reads [mb, k]
    ec = (torch.arange(4 * K) * 7 % 256).to(torch.uint8).reshape(4, K)   # compact (4, 256) [mb, k]
    qc = MXFP8Quantized(None, None, data.view(fp8_dtype), swizzle_scales(ec.T.contiguous()) if swizzled else ec,
                        fp8_dtype, swizzled)
    yc = dequantize_mxfp8(qc)
    refc = data.view(fp8_dtype).double() * torch.pow(2.0, ec.double() - 127).repeat_interleave(32, 0)
    refc = torch.where((ec == 255).repeat_interleave(32, 0), torch.full_like(refc, NAN), refc).float()
    assert torch.equal(torch.nan_to_num(yc, nan=0.0), torch.nan_to_num(refc, nan=0.0))
    assert torch.equal(torch.isnan(yc), torch.isnan(refc))


def test_validation():
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_mxfp8(torch.zeros(32))
    with pytest.raises(TypeError, match="x must be float32"):
        quantize_mxfp8(torch.zeros(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_mxfp8(torch.zeros(2, 32), fp8_dtype=torch.uint8)
    q = quantize_mxfp8(torch.zeros(32, 32))
    q.scale_inv = q.scale_inv[:64]
    with pytest.raises(ValueError, match="expected"):
        dequantize_mxfp8(q)
