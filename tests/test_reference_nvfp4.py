"""NVFP4 reference (formats.md §3.1-3.3, §8): two-level scale, underflow trap, packing, layouts."""
import pytest
import torch

import _scalar_reference as sref
from lpmoe.reference.nvfp4 import NVFP4Quantized, dequantize_nvfp4, nvfp4_scale_shape, quantize_nvfp4
from lpmoe.reference.numerics import e2m1_decode, unpack_e2m1
from lpmoe.reference.swizzle import swizzle_scales

NAN, INF = float("nan"), float("inf")


def u8(t):
    return t.view(torch.uint8)


ROW0 = [6.0, -3.0, 1.5, 0.25, 0.75, -0.0, NAN, 5.0, 2.5, 1.25, 0.5, 4.0, -6.0, 3.5, 1.75, 0.0]
ROW0_CODES = [7, 13, 3, 0, 2, 8, 7, 6, 4, 2, 1, 6, 15, 6, 4, 0]
ROW0_BYTES = [0xD7, 0x03, 0x82, 0x67, 0x24, 0x61, 0x6F, 0x04]


def hand_input():
    x = torch.zeros(16, 32)
    x[0, :16] = torch.tensor(ROW0)
    return x


# ----------------------------------------------------------------------------- hand values
def test_hand_rowwise_codes_scales_and_packing():
    """amax 6: S_enc = 448, sf(bamax 6) = RN(6 * fl(448 * fl(1/6))) = 448, enc_b = 1 exactly."""
    q = quantize_nvfp4(hand_input(), columnwise=False)
    assert q.amax.tolist() == [6.0]                                  # NaN ignored
    assert q.data.shape == (16, 16) and q.data.dtype == torch.uint8
    assert q.data[0, :8].tolist() == ROW0_BYTES                      # even element in low nibble
    assert (q.data[0, 8:] == 0).all() and (q.data[1:] == 0).all()
    assert unpack_e2m1(q.data)[0, :16].tolist() == ROW0_CODES
    s = q.scale_inv
    assert s.dtype == torch.float8_e4m3fn and s.shape == (128, 4)
    assert u8(s)[0, 0].item() == 0x7E                                # 448
    assert (u8(s)[0, 1:] == 0).all() and (u8(s)[1:] == 0).all()      # empty blocks, padding: 0
    y = dequantize_nvfp4(q)
    # final = fl(fl(448 * 6) * fl(1/2688)) = 1.0
    expect = torch.tensor([6.0, -3.0, 1.5, 0.0, 1.0, -0.0, 6.0, 4.0, 2.0, 1.0, 0.5, 4.0, -6.0,
                           4.0, 2.0, 0.0])
    assert torch.equal(y[0, :16], expect) and torch.signbit(y[0, 5]).item()
    assert (y[1:] == 0).all() and (y[0, 16:] == 0).all()


def test_hand_columnwise():
    x = hand_input()
    q = quantize_nvfp4(x)
    assert q.columnwise_data.shape == (32, 8)                        # (K, M/2), packed along M
    assert q.columnwise_scale_inv.shape == (128, 4)                  # (roundup(K,128), roundup(M/16,4))
    assert q.columnwise_amax.tolist() == [6.0]
    assert q.columnwise_data[0].tolist() == [0x07] + [0] * 7         # column 0 = (6, 0, ...)
    # column 1 = (-3, 0...): sf = RN(fl(3 * 74.66667)) = 224, enc_b = fl(1/fl(224*fl(1/448))) = 2
    assert u8(q.columnwise_scale_inv)[1, 0].item() == 0x76          # 224
    assert q.columnwise_data[1].tolist() == [0x0F] + [0] * 7        # -3 * 2 = -6
    qt = quantize_nvfp4(x.T.contiguous(), columnwise=False, amax=q.amax)
    assert torch.equal(q.columnwise_data, qt.data)
    assert torch.equal(u8(q.columnwise_scale_inv), u8(qt.scale_inv))


def test_scale_underflow_trap():
    """One huge element makes a tiny block's scale round to E4M3 zero -> enc_b = FLT_MAX,
    nonzero elements saturate to ±6 (codes 7 / 15) yet dequantize to 0."""
    x = torch.zeros(16, 32)
    x[0, 0] = 1e6
    x[1, :16] = torch.tensor([1e-3, -1e-3, 0.0, 2e-4] * 4)
    q = quantize_nvfp4(x, columnwise=False)
    assert u8(q.scale_inv)[1, 0].item() == 0x00
    assert unpack_e2m1(q.data)[1, :4].tolist() == [7, 15, 0, 7]
    assert u8(q.scale_inv)[0, 0].item() == 0x7E
    assert unpack_e2m1(q.data)[0, 0].item() == 7
    y = dequantize_nvfp4(q)
    assert (y[1] == 0).all() and torch.signbit(y[1, 1]).item()
    assert abs(y[0, 0].item() - 1e6) <= 1e6 * 2.0 ** -20


def test_scale_association_tie_case():
    """amax 3 -> S_enc 896, fl(S_enc * fl(1/6)) = 149.33334350585938.  bamax 2.25:
    2.25 * 149.33334 = 336.00003 -> E4M3 352 (0x7B).  The other association,
    fl(2.25 * 896) * fl(1/6) = 336.0 exactly, would tie to even 320 (0x7A)."""
    x = torch.zeros(16, 16)
    x[0, 0] = 3.0
    x[1, 0] = 2.25
    q = quantize_nvfp4(x, columnwise=False)
    assert u8(q.scale_inv)[:2, 0].tolist() == [0x7E, 0x7B]


def test_all_zero_tensor_and_explicit_amax():
    x = torch.zeros(16, 16)
    q = quantize_nvfp4(x)
    assert q.amax.tolist() == [0.0]                                  # S_enc = 1, sf = 0, enc = FLT_MAX
    assert (q.data == 0).all() and (u8(q.scale_inv) == 0).all()
    assert (dequantize_nvfp4(q) == 0).all()
    # explicit (larger) amax = 2688 -> S_enc = 1: bamax 6 -> sf = RN(fl(6 * fl(1/6))) = 1.0
    x[0, :16] = torch.tensor(ROW0)
    q = quantize_nvfp4(x, amax=2688.0)
    assert q.amax.tolist() == [2688.0]
    assert u8(q.scale_inv)[0, 0].item() == 0x38                      # E4M3 1.0
    assert unpack_e2m1(q.data)[0, :16].tolist() == ROW0_CODES
    assert q.columnwise_amax.tolist() == [2688.0]


def test_inf_amax_gives_unit_global_scale():
    x = torch.zeros(16, 16)
    x[0, 0], x[0, 1] = INF, 1.0
    q = quantize_nvfp4(x, columnwise=False)
    # S_enc = 2688/inf = 0 -> 1; sf = sat(min(inf, FLT_MAX)) = 448; enc = fl(1/448): 1.0 -> 0
    assert q.amax.tolist() == [INF]
    assert u8(q.scale_inv)[0, 0].item() == 0x7E
    assert unpack_e2m1(q.data)[0, :2].tolist() == [7, 0]


# ----------------------------------------------------------------------------- layouts
SHAPES = {  # (M, K): (rowwise compact, colwise compact)
    (16, 16): ((128, 4), (128, 4)),
    (32, 64): ((128, 4), (128, 4)),
    (144, 48): ((256, 4), (128, 12)),
    (16, 2048): ((128, 128), (2048, 4)),
    (0, 32): ((0, 4), (128, 0)),
}


@pytest.mark.parametrize("mk", list(SHAPES))
def test_scale_shapes(mk):
    M, K = mk
    assert (nvfp4_scale_shape(M, K, False), nvfp4_scale_shape(M, K, True)) == SHAPES[mk]
    x = torch.randn(M, K)
    q = quantize_nvfp4(x)
    assert q.data.shape == (M, K // 2) and q.columnwise_data.shape == (K, M // 2)
    assert q.scale_inv.shape == SHAPES[mk][0] and q.columnwise_scale_inv.shape == SHAPES[mk][1]
    qs = quantize_nvfp4(x, swizzled=True)
    assert qs.with_gemm_swizzled_scales
    assert torch.equal(u8(qs.scale_inv), u8(swizzle_scales(q.scale_inv)))
    assert torch.equal(u8(qs.columnwise_scale_inv), u8(swizzle_scales(q.columnwise_scale_inv)))
    assert torch.equal(dequantize_nvfp4(qs), dequantize_nvfp4(q))
    assert dequantize_nvfp4(q).shape == (M, K)


def test_padding_is_zero():
    x = torch.randn(144, 48) + 5.0
    q = quantize_nvfp4(x)
    s = u8(q.scale_inv)
    assert (s[:144, :3] != 0).all() and (s[144:] == 0).all() and (s[:, 3:] == 0).all()
    c = u8(q.columnwise_scale_inv)
    assert (c[:48, :9] != 0).all() and (c[48:] == 0).all() and (c[:, 9:] == 0).all()


# ----------------------------------------------------------------------------- scalar model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_scalar_model(dtype):
    g = torch.Generator().manual_seed(11)
    M, K = 48, 64
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
    x[3, 5], x[7, 9], x[2, :] = NAN, -0.0, 1e-6
    x = x.to(dtype)
    q = quantize_nvfp4(x)
    amax = sref.nan0_amax(x.float().reshape(-1).tolist())
    assert q.amax.item() == amax
    xl = x.float().tolist()
    codes, ccodes = unpack_e2m1(q.data), unpack_e2m1(q.columnwise_data)
    for m in range(M):
        for kb in range(K // 16):
            c, sf = sref.nvfp4_block(xl[m][16 * kb:16 * kb + 16], amax)
            assert codes[m, 16 * kb:16 * kb + 16].tolist() == c
            assert u8(q.scale_inv)[m, kb].item() == sf
    for k in range(K):
        for mb in range(M // 16):
            c, sf = sref.nvfp4_block([xl[m][k] for m in range(16 * mb, 16 * mb + 16)], amax)
            assert ccodes[k, 16 * mb:16 * mb + 16].tolist() == c
            assert u8(q.columnwise_scale_inv)[k, mb].item() == sf


# ----------------------------------------------------------------------------- dequantize
def test_dequantize_formula_and_out_dtypes():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(32, 64, generator=g) * 3
    q = quantize_nvfp4(x, columnwise=False)
    a = q.amax.item()
    sf = q.scale_inv[:32, :4].float().double().tolist()
    vals = e2m1_decode(unpack_e2m1(q.data))
    F32 = sref.F32
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        y = dequantize_nvfp4(q, dt)
        assert y.dtype == dt
        for m in (0, 17, 31):
            for k in (0, 15, 16, 63):
                final = (F32(sf[m][k // 16]) * F32(a)) * (F32(1.0) / F32(2688.0))
                ref = torch.tensor(float(F32(vals[m, k].item()) * final), dtype=torch.float32).to(dt)
                assert y[m, k].item() == ref.item()


@pytest.mark.parametrize("swizzled", [False, True])
def test_dequantize_hand_built(swizzled):
    """Bytes 0x21 0xF9 = codes (1, 2, 9, 15) = (0.5, 1, -0.5, -6); sf 2.0 (0x40), amax 2688:
    final = fl(fl(2 * 2688) * fl(1/2688)) = 2.0; sf 0 in the second block -> all zeros."""
    data = torch.zeros(16, 16, dtype=torch.uint8)
    data[0, :2] = torch.tensor([0x21, 0xF9], dtype=torch.uint8)
    data[0, 8] = 0x77                                            # block 1 (k 16..31): codes 7, 7
    sf = torch.zeros(128, 4, dtype=torch.uint8)
    sf[0, 0] = 0x40
    s = sf.view(torch.float8_e4m3fn)
    q = NVFP4Quantized(data, swizzle_scales(s) if swizzled else s, torch.tensor([2688.0]),
                       None, None, None, swizzled)
    y = dequantize_nvfp4(q)
    assert y.shape == (16, 32)
    assert y[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]
    assert (y[0, 4:] == 0).all() and (y[1:] == 0).all()
    assert dequantize_nvfp4(q, torch.bfloat16)[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]


def test_round_trip_error_bound():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    q = quantize_nvfp4(x)
    y = dequantize_nvfp4(q)
    bamax = x.abs().view(64, 8, 16).amax(-1).repeat_interleave(16, 1)
    # E2M1 half-step at the top is 1 of 6 (1/6 of bamax), plus the E4M3 scale rounding (2^-4)
    assert ((y - x).abs() <= bamax * (1 / 6 + 2.0 ** -4) * 1.01).all()
    assert (y - x).abs().mean() < 0.1 * x.abs().mean()


def test_validation():
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_nvfp4(torch.zeros(16, 24))
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_nvfp4(torch.zeros(15, 16))
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_nvfp4(torch.zeros(16))
    with pytest.raises(ValueError, match="amax"):
        quantize_nvfp4(torch.zeros(16, 16), amax=torch.ones(2))
    q = quantize_nvfp4(torch.randn(16, 16), rowwise=False)
    assert q.data is None and q.scale_inv is None
    with pytest.raises(ValueError, match="columnwise-only"):
        dequantize_nvfp4(q)
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_scale_shape(16, 8, False)
