"""FP8 block scaling reference (formats.md §1): hand-built traps, layouts, scalar model, round trips."""
import math

import pytest
import torch

import _scalar_reference as sref
from lpmoe.reference.fp8_block import (
    Fp8BlockQuantized,
    block_scale_shape,
    dequantize_fp8_block,
    quantize_fp8_block,
)
from lpmoe.reference.numerics import FP8_MAX, INPUT_DTYPE_MAX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


def u8(t):
    return t.view(torch.uint8)


def fp8_vals(t):
    return t.float().tolist()


# ----------------------------------------------------------------------------- layouts
SHAPES = {  # (M, K): (1D row, 1D col, 2D row, 2D col)
    (1, 16): ((1, 4), (1, 16), (1, 4), (1, 4)),
    (129, 144): ((2, 132), (2, 144), (2, 4), (2, 4)),
    (256, 640): ((5, 256), (2, 640), (2, 8), (5, 4)),
    (1, 1): ((1, 4), (1, 4), (1, 4), (1, 4)),
    (0, 128): ((1, 0), (0, 128), (0, 4), (1, 0)),
    (130, 0): ((0, 132), (2, 0), (2, 0), (0, 4)),
}


@pytest.mark.parametrize("mk", list(SHAPES))
def test_scale_shapes_and_output_shapes(mk):
    M, K = mk
    expect = SHAPES[mk]
    got = (block_scale_shape(M, K, 1, False), block_scale_shape(M, K, 1, True),
           block_scale_shape(M, K, 2, False), block_scale_shape(M, K, 2, True))
    assert got == expect
    x = torch.randn(M, K)
    for bd, (rs, cs) in ((1, expect[:2]), (2, expect[2:])):
        q = quantize_fp8_block(x, block_dim=bd)
        assert q.data.shape == (M, K) and q.data.dtype == E4M3
        assert q.columnwise_data.shape == (K, M)
        assert q.scale_inv.shape == rs and q.scale_inv.dtype == torch.float32
        assert q.columnwise_scale_inv.shape == cs
        assert dequantize_fp8_block(q).shape == (M, K)


def test_padding_entries_are_zero():
    x = torch.randn(129, 144) + 3.0  # no zero blocks -> every valid scale_inv is > 0
    q1 = quantize_fp8_block(x, block_dim=1)
    assert (q1.scale_inv[:, :129] > 0).all() and (q1.scale_inv[:, 129:] == 0).all()
    assert (q1.columnwise_scale_inv[:, :144] > 0).all()
    assert q1.columnwise_scale_inv.shape == (2, 144)
    x = torch.randn(129, 600) + 3.0
    q1 = quantize_fp8_block(x, block_dim=1)
    assert (q1.columnwise_scale_inv[:, 600:] == 0).all() and q1.columnwise_scale_inv.shape == (2, 600)
    q2 = quantize_fp8_block(x, block_dim=2)                 # tiles 2 x 5
    assert q2.scale_inv.shape == (2, 8)
    assert (q2.scale_inv[:, :5] > 0).all() and (q2.scale_inv[:, 5:] == 0).all()
    assert q2.columnwise_scale_inv.shape == (5, 4)
    assert (q2.columnwise_scale_inv[:, :2] > 0).all() and (q2.columnwise_scale_inv[:, 2:] == 0).all()


# ----------------------------------------------------------------------------- hand-built 1D
def hand_input():
    """(2, 144): row 0 block 0 amax 3 (with a NaN), row 0 partial block 1 amax 7,
    row 1 block 0 all zero, row 1 partial block 1 holds ±inf and 470."""
    x = torch.full((2, 144), 0.5)
    x[0, 0], x[0, 1], x[0, 2] = 3.0, -1.5, NAN
    x[0, 128:] = 2.0
    x[0, 130] = -7.0
    x[1, :128] = 0.0
    x[1, 128:] = 1.0
    x[1, 140], x[1, 141], x[1, 142] = INF, -INF, 470.0
    return x


def test_1d_rowwise_hand_values():
    q = quantize_fp8_block(hand_input(), block_dim=1, columnwise=False)
    assert q.columnwise_data is None and q.columnwise_scale_inv is None
    # scale_inv (ceil(144/128), roundup(2,4)) = (2, 4), block (m, bx) at [bx, m]
    assert q.scale_inv.tolist() == [[1 / 128, 1.0, 0.0, 0.0], [1 / 64, 1.0, 0.0, 0.0]]
    d = q.data
    assert fp8_vals(d[0, :2]) == [384.0, -192.0]            # x * 128
    assert u8(d)[0, 2].item() == 0x7F                       # NaN -> canonical 0x7F
    assert fp8_vals(d[0, 3:5]) == [64.0, 64.0]
    assert fp8_vals(d[0, 128:131]) == [128.0, 128.0, -448.0]  # partial block, scale 64
    assert (u8(d)[1, :128] == 0).all()                      # zero block: scale 1, q = +0
    # inf block: scale 1, ±inf -> ±448, 470 -> 448 (saturate), finite unscaled
    assert fp8_vals(d[1, 139:144]) == [1.0, 448.0, -448.0, 448.0, 1.0]


def test_1d_columnwise_hand_values():
    x = hand_input()
    q = quantize_fp8_block(x, block_dim=1, rowwise=False)
    assert q.data is None
    # transposed data (K, M); scales (ceil(2/128), roundup(144,4)) = (1, 144) at [by, k]
    assert q.columnwise_data.shape == (144, 2)
    s = q.columnwise_scale_inv
    assert s.shape == (1, 144)
    assert s[0, 0].item() == 1 / 128                         # column (3, 0)
    assert s[0, 2].item() == 1.0                             # column (NaN, 0): amax 0
    assert s[0, 130].item() == 1 / 64                        # column (-7, 1)
    assert s[0, 140].item() == 1.0                           # column (2, inf)
    assert s[0, 5].item() == 1 / 512                         # column (0.5, 0): 896 -> 512
    c = q.columnwise_data
    assert fp8_vals(c[0]) == [384.0, 0.0]
    assert u8(c)[2].tolist() == [0x7F, 0x00]
    assert fp8_vals(c[130]) == [-448.0, 64.0]
    assert fp8_vals(c[140]) == [2.0, 448.0]


def test_1d_e5m2_inf_block_saturates_large_values():
    x = torch.tensor([[INF, 1e6, -70000.0, 3.0]])
    q = quantize_fp8_block(x, fp8_dtype=E5M2, block_dim=1)
    assert q.scale_inv[0, 0].item() == 1.0
    assert fp8_vals(q.data) == [[57344.0, 57344.0, -57344.0, 3.0]]
    assert u8(q.data).tolist() == [[0x7B, 0x7B, 0xFB, 0x42]]


def test_eps_and_non_pow2_scales():
    x = torch.zeros(1, 4)
    q = quantize_fp8_block(x, block_dim=1, amax_epsilon=1e-3)
    assert q.scale_inv[0, 0].item() == 2.0 ** -18            # 448/1e-3 -> pow2 2^18
    x = torch.tensor([[3.0, -1.5, 0.0, 1.0]])
    q = quantize_fp8_block(x, block_dim=1, pow2_scales=False)
    scale = torch.tensor([0x43155555], dtype=torch.int32).view(torch.float32)   # fl(448/3)
    assert q.scale_inv[0, 0].item() == (torch.ones(1) / scale).item()
    # 3 * fl(448/3) = 447.99998474... is an exact fp32 tie -> 448
    assert fp8_vals(q.data) == [[448.0, -224.0, 0.0, 144.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiny_amax_scale_is_input_dtype_max(dtype):
    x = torch.tensor([[1e-37, -5e-38, 0.0, 0.0]], dtype=dtype)
    q = quantize_fp8_block(x, block_dim=1)
    assert q.scale_inv.view(torch.int32)[0, 0].item() == 0x00400000   # 2^-127, subnormal
    xs = x.float() * 2.0 ** 127
    assert torch.equal(q.data.float(), xs.clamp(-448, 448).to(E4M3).float())
    q = quantize_fp8_block(x, block_dim=1, pow2_scales=False)
    inv = (torch.ones(1) / torch.tensor([INPUT_DTYPE_MAX[dtype]])).view(torch.int32).item()
    assert q.scale_inv.view(torch.int32)[0, 0].item() == inv
    assert inv < 0x00800000                                         # subnormal scale_inv
    # dequantization multiplies by the subnormal scale_inv without flushing
    y = dequantize_fp8_block(quantize_fp8_block(x, block_dim=1))
    assert (y[0, :2] != 0).all()


# ----------------------------------------------------------------------------- hand-built 2D
def test_2d_tiles_hand_values():
    x = torch.zeros(130, 130)
    x[:128, :128] = 0.25
    x[5, 7] = -1.0                       # tile (0,0) amax 1 -> scale 256
    x[:128, 128:] = 7.0                  # tile (0,1) amax 7 -> 64
    x[128:, :128] = 0.5                  # tile (1,0) amax 0.5 -> 512
    x[129, 3] = NAN                      # ignored
    # tile (1,1) all zero -> 1
    q = quantize_fp8_block(x, block_dim=2)
    assert q.scale_inv.tolist() == [[1 / 256, 1 / 64, 0, 0], [1 / 512, 1.0, 0, 0]]
    assert q.columnwise_scale_inv.tolist() == [[1 / 256, 1 / 512, 0, 0], [1 / 64, 1.0, 0, 0]]
    assert q.data[5, 7].item() == -256.0 and q.data[0, 0].item() == 64.0
    assert q.data[0, 129].item() == 448.0 and q.data[128, 0].item() == 256.0
    assert u8(q.data)[129, 3].item() == 0x7F
    assert torch.equal(u8(q.columnwise_data), u8(q.data).T)   # same scale: data_t == data.T


# ----------------------------------------------------------------------------- scalar model
def scalar_1d(x, fp8_dtype, pow2, eps):
    """Loop model: returns rowwise (bytes, {(m,bx): s_inv}) and colwise (bytes (K,M), {(by,k): s_inv})."""
    M, K = x.shape
    xl = x.float().tolist()
    e5 = fp8_dtype == E5M2
    args = (FP8_MAX[fp8_dtype], pow2, eps, INPUT_DTYPE_MAX[x.dtype], e5)
    rows, rs = [[0] * K for _ in range(M)], {}
    for m in range(M):
        for bx in range(math.ceil(K / 128)):
            ks = range(128 * bx, min(128 * bx + 128, K))
            b, s = sref.quantize_vector_fp8([xl[m][k] for k in ks], *args)
            for k, v in zip(ks, b):
                rows[m][k] = v
            rs[(m, bx)] = s
    cols, cs = [[0] * M for _ in range(K)], {}
    for k in range(K):
        for by in range(math.ceil(M / 128)):
            ms = range(128 * by, min(128 * by + 128, M))
            b, s = sref.quantize_vector_fp8([xl[m][k] for m in ms], *args)
            for m, v in zip(ms, b):
                cols[k][m] = v
            cs[(by, k)] = s
    return rows, rs, cols, cs


def spiky(M, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randint(0, n, (8,), generator=g)
    flat[pick[:2]] = NAN
    flat[pick[2]] = INF
    flat[pick[3]] = -INF
    flat[pick[4]] = 0.0
    flat[pick[5]] = 1e-30
    x[0, :] = 0.0                         # an all-zero row
    return x.to(dtype)


@pytest.mark.parametrize("dtype,fp8_dtype,pow2,eps", [
    (torch.float32, E4M3, True, 0.0),
    (torch.bfloat16, E4M3, False, 0.0),
    (torch.float16, E5M2, True, 1.0),
    (torch.float32, E5M2, False, 0.0),
])
def test_1d_matches_scalar_model(dtype, fp8_dtype, pow2, eps):
    x = spiky(131, 150, dtype, seed=3)
    q = quantize_fp8_block(x, fp8_dtype, 1, True, True, pow2, eps)
    rows, rs, cols, cs = scalar_1d(x, fp8_dtype, pow2, eps)
    assert u8(q.data).tolist() == rows
    assert u8(q.columnwise_data).tolist() == cols
    for (m, bx), s in rs.items():
        assert q.scale_inv[bx, m].item() == s
    for (by, k), s in cs.items():
        assert q.columnwise_scale_inv[by, k].item() == s


def test_2d_matches_scalar_model():
    x = spiky(200, 260, torch.bfloat16, seed=4)
    q = quantize_fp8_block(x, block_dim=2, pow2_scales=False)
    xl = x.float().tolist()
    for ty in range(2):
        for tx in range(3):
            ms, ks = range(128 * ty, min(128 * ty + 128, 200)), range(128 * tx, min(128 * tx + 128, 260))
            vals = [xl[m][k] for m in ms for k in ks]
            b, s = sref.quantize_vector_fp8(vals, 448.0, False, 0.0, INPUT_DTYPE_MAX[torch.bfloat16], False)
            assert u8(q.data)[ms.start:ms.stop, ks.start:ks.stop].reshape(-1).tolist() == b
            assert q.scale_inv[ty, tx].item() == s and q.columnwise_scale_inv[tx, ty].item() == s


def test_columnwise_equals_rowwise_of_transpose():
    x = torch.randn(150, 270)
    q = quantize_fp8_block(x, block_dim=1)
    qt = quantize_fp8_block(x.T.contiguous(), block_dim=1)
    assert torch.equal(u8(q.columnwise_data), u8(qt.data))
    assert torch.equal(q.columnwise_scale_inv, qt.scale_inv)


# ----------------------------------------------------------------------------- dequantize
def block_amax_per_element(x, block_dim):
    M, K = x.shape
    a = torch.zeros(M, K)
    for i in range(0, M, 128 if block_dim == 2 else 1):
        for j in range(0, K, 128):
            sl = (slice(i, i + (128 if block_dim == 2 else 1)), slice(j, j + 128))
            a[sl] = x[sl].abs().max()
    return a


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype,rel", [(E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)])
def test_round_trip_error_bound(block_dim, fp8_dtype, rel):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(200, 300, generator=g) * torch.exp(torch.randn(200, 1, generator=g) * 4)
    amax = block_amax_per_element(x, block_dim)
    for pow2 in (True, False):
        q = quantize_fp8_block(x, fp8_dtype, block_dim, pow2_scales=pow2)
        y = dequantize_fp8_block(q)
        assert ((y - x).abs() <= rel * amax * (1 + 1e-6)).all()
        # normal-range elements: relative error bounded by half an ulp of the format
        big = x.abs() >= amax * 2.0 ** -5
        assert ((y - x).abs() <= rel * x.abs() * (1 + 1e-6))[big].all()
        # the columnwise copy dequantizes to the same bound
        qc = Fp8BlockQuantized(None, None, q.columnwise_data, q.columnwise_scale_inv, fp8_dtype, block_dim)
        yc = dequantize_fp8_block(qc)
        if block_dim == 2:
            assert torch.equal(yc, y)
        else:
            assert ((yc - x).abs() <= rel * block_amax_per_element(x.T.contiguous(), 1).T * (1 + 1e-6)).all()


def test_dequantize_exact_hand_values_and_out_dtypes():
    x = hand_input()
    q = quantize_fp8_block(x, block_dim=1)
    y = dequantize_fp8_block(q)
    assert y[0, :2].tolist() == [3.0, -1.5] and math.isnan(y[0, 2].item())
    assert y[0, 128:131].tolist() == [2.0, 2.0, -7.0]
    assert y[1, 139:144].tolist() == [1.0, 448.0, -448.0, 448.0, 1.0]
    # one fp32 multiply then one rounding to the output dtype (scale_inv = fl(1/3))
    data = torch.tensor([[448.0, 1.5, -0.0, 3.0]]).to(E4M3)
    s_inv = torch.zeros(1, 4)
    s_inv[0, 0] = 1 / 3
    hand = Fp8BlockQuantized(data, s_inv, None, None, E4M3, 1)
    expect = {
        torch.float32: [149.33334350585938, 0.5, -0.0, 1.0],
        torch.bfloat16: [149.0, 0.5, -0.0, 1.0],
        torch.float16: [149.375, 0.5, -0.0, 1.0],
    }
    for dt, vals in expect.items():
        out = dequantize_fp8_block(hand, dt)
        assert out.dtype == dt and out.float().tolist() == [vals]
        assert torch.signbit(out[0, 2]).item()


def test_dequantize_validates():
    q = quantize_fp8_block(torch.randn(4, 8))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_fp8_block(q, M=5)
    assert dequantize_fp8_block(q, M=4, K=8).shape == (4, 8)
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize_fp8_block(q, torch.int32)
    bad = Fp8BlockQuantized(q.data, q.scale_inv[:, :2], None, None, E4M3, 1)
    with pytest.raises(ValueError, match="expected"):
        dequantize_fp8_block(bad)
    with pytest.raises(ValueError, match="neither"):
        dequantize_fp8_block(Fp8BlockQuantized(None, None, None, None, E4M3, 1))


def test_quantize_validates_arguments():
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_fp8_block(torch.zeros(2, 2, 2))
    with pytest.raises(TypeError, match="x must be float32"):
        quantize_fp8_block(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_fp8_block([[1.0]])
    with pytest.raises(ValueError, match="block_dim"):
        quantize_fp8_block(torch.zeros(2, 2), block_dim=3)
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_fp8_block(torch.zeros(2, 2), fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rowwise"):
        quantize_fp8_block(torch.zeros(2, 2), rowwise=False, columnwise=False)
