"""Expert-MLP activations: the exact-math reference (CPU) and the fused
kernels (GPU) bit for bit against it, high precision and FP8 outputs."""
import math

import pytest
import torch
import torch.nn.functional as F

import lpmoe
from conftest import capture_graph, poison_, requires_cuda
from lpmoe.activation import Activation, activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference import activation as R

KINDS = R.KINDS
E4M3 = torch.float8_e4m3fn
FP8_BUFS = ("rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv")


def torch_activation(h, kind, alpha=1.702, limit=7.0):
    """The activation written with torch ops in fp64 (independent of lpmoe)."""
    h = h.double()
    if kind == "gelu":
        return F.gelu(h, approximate="tanh")
    if kind == "relu":
        return torch.relu(h)
    g, v = h.chunk(2, dim=-1)
    if kind == "swiglu":
        return F.silu(g) * v
    if kind == "geglu":
        return F.gelu(g, approximate="tanh") * v
    gc = g.clamp(max=limit)
    return gc * torch.sigmoid(alpha * gc) * (v.clamp(-limit, limit) + 1)


def rand_h(rows, w, dtype=torch.bfloat16, device="cpu", seed=0, specials=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, w, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    if specials and rows > 8:
        h[1, :] = 0.0
        h[2, 0] = float("nan")
        h[3, 1] = float("inf")
        h[3, 2] = -float("inf")
        h[4, :8] = 1e-38    # subnormal in fp32/bf16
        h[5, :4] = torch.tensor([30.0, -30.0, 100.0, -100.0])
        h[6, :4] = torch.tensor([7.0, -7.0, 7.5, -7.5])  # clamped SwiGLU limits
    return h.to(dtype).to(device)


def same_bits(a, b):
    """Bitwise equal, except that any two NaNs match (NaN payloads are not
    part of the spec for high-precision outputs)."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    ia = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
    bad = (ia != ib) & ~nan
    return int(bad.sum())


# --------------------------------------------------------------- reference
def test_reference_exp_accuracy_and_specials():
    x = torch.cat([torch.linspace(-104, 88.7, 300001), torch.randn(50000) * 4])
    e, ref = R.exp_lp(x).double(), torch.exp(x.double())
    normal = ref > 2.0 ** -126
    assert float(((e - ref).abs() / ref)[normal].max()) < 2.0 ** -23  # 1 ulp at a binade's bottom (0.88 ulp measured)
    assert float((e - ref).abs()[~normal].max()) <= 2.0 ** -149  # subnormal results, one rounding
    sp = R.exp_lp(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, 88.73, -104.0]))
    assert math.isnan(sp[0]) and sp[1] == float("inf") and sp[2] == 0 and sp[3] == 1
    assert sp[4] == float("inf") and sp[5] == 0


def test_reference_exp_pinned_bits():
    """exp's exact bits at inputs where the degree-6 minimax exp (stop 60)
    and the degree-7 Taylor one before it differ by an ulp: the spec is the
    one the kernels compute, so a change of polynomial has to be deliberate."""
    x_bits = [0xC10D3DB4, 0x416382A0, 0xC1796F3A, 0x41975228]
    want = [0x3919C206, 0x49B6D0C6, 0x34362323, 0x4D1C5C96]
    x = torch.tensor(x_bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = R.exp_lp(x).view(torch.int32).tolist()
    assert [v & 0xFFFFFFFF for v in got] == want


def test_reference_rcp_flushes_only_subnormal_results():
    """rcp is 1/y correctly rounded, and 0 exactly where 1/y is subnormal (the
    kernels' reciprocal approximation flushes those): 2^126 -> 2^-126, the
    next float up -> 0."""
    two126 = torch.tensor(2.0 ** 126)
    y = torch.stack([two126, torch.nextafter(two126, torch.tensor(float("inf"))),
                     torch.nextafter(two126, torch.tensor(0.0)), torch.tensor(3.0), torch.tensor(2.0 ** 127)])
    got = R.rcp_lp(y)
    assert got[0] == 2.0 ** -126 and got[1] == 0 and got[4] == 0
    assert got[2] == 1 / y[2] and got[3] == torch.tensor(1.0) / torch.tensor(3.0)


def _kernel_exp_for_sigmoid(x):
    """The kernels' exp (csrc/activation/act_math.cuh, exp_for_sigmoid) in
    torch: the spec's exp with x clamped to [-86, 87.5] and 2^n applied as one
    multiply."""
    j, p = R.exp_reduced(x.float().clamp(-86.0, 87.5))
    pow2n = ((j.view(torch.int32).long() << 23) + 0x3F800000) & 0xFFFFFFFF  # 32-bit wrap-around
    pow2n = torch.where(pow2n >= 1 << 31, pow2n - (1 << 32), pow2n).to(torch.int32)
    return p * pow2n.view(torch.float32)


def test_kernel_exp_shortcut_gives_the_spec_sigmoid():
    """The kernels clamp exp's input to [-86, 87.5] and scale by 2^n in one
    multiply; the sigmoid built on it must equal the spec's bit for bit:
    every fp32 in the two clamp regions (|x| in [80, 112), every 3rd value),
    the clamp bounds' neighbours, and random values."""
    base = torch.arange(0x42A00000, 0x42E00000, 3, dtype=torch.int64).to(torch.int32).view(torch.float32)  # 80..112
    edges = torch.tensor([86.0, 87.5, 86.64, 88.72, 103.97, 104.0, 1e30, float("inf"), float("nan"), 0.0])
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e38))])
    x = torch.cat([base, -base, edges, -edges, torch.randn(100000) * 30])
    e_kernel = _kernel_exp_for_sigmoid(-x)
    inside = (-x >= -86.0) & (-x <= 87.5)
    assert torch.equal(e_kernel[inside].view(torch.int32), R.exp_lp(-x)[inside].view(torch.int32))
    ours = R.rcp_lp(R.ONE + e_kernel)
    spec = R.sigmoid_lp(x)
    assert same_bits(ours, spec) == 0
    assert bool(torch.isnan(ours[torch.isnan(x)]).all())


@pytest.mark.parametrize("kind", KINDS)
def test_reference_forward_close_to_torch(kind):
    h = rand_h(512, 256, torch.float32, specials=False)
    a = R.activation_forward(h, kind)
    ref = torch_activation(h, kind)
    assert a.dtype == torch.float32 and a.shape == ref.shape
    assert float((a.double() - ref).abs().max()) < 1e-5 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_backward_matches_fp64_autograd(kind):
    h = rand_h(300, 256, torch.float32, specials=False).double().requires_grad_(True)
    p = torch.rand(300, dtype=torch.float64, requires_grad=True)
    y = torch_activation(h, kind) * p[:, None]
    da = torch.randn_like(y)
    y.backward(da)
    dh, a, dp = R.activation_backward(da.float(), h.detach().float(), kind, p.detach().float())
    assert float((dh.double() - h.grad).abs().max()) < 1e-5 * float(h.grad.abs().max())
    assert float((dp.double() - p.grad).abs().max()) < 1e-5 * float(p.grad.abs().max())
    assert float((a.double() - y.detach()).abs().max()) < 1e-5 * float(y.detach().abs().max())


def _fma_f32_exact(a: float, b: float, c: float) -> torch.Tensor:
    """fp32 fma by exact rational arithmetic: a * b + c rounded once to the
    nearest fp32, ties to even (finite inputs)."""
    from fractions import Fraction
    q = Fraction(a) * Fraction(b) + Fraction(c)
    x = torch.tensor(float(q), dtype=torch.float32)
    cands = [x, torch.nextafter(x, torch.tensor(float("inf"))), torch.nextafter(x, torch.tensor(-float("inf")))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - q), int(v.view(torch.int32)) & 1))
    return best


def test_reference_probs_sum_order():
    """The documented order (8 columns left to right by fused multiply-adds,
    a halving tree over 16 groups, blocks left to right), written out
    independently with scalars and exact rational fma.  Row 0 starts with a
    pair where one fma and a multiply-then-add differ: -(1 + 2^-11) * 1, then
    (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, whose product alone rounds to 1 + 2^-11."""
    g = torch.Generator().manual_seed(7)
    da = torch.randn(3, 300, generator=g) * torch.exp(torch.randn(3, 300, generator=g) * 3)
    u = torch.randn(3, 300, generator=g)
    da[0, :2] = torch.tensor([-(1 + 2.0 ** -11), 1 + 2.0 ** -12])
    u[0, :2] = torch.tensor([1.0, 1 + 2.0 ** -12])
    da[0, 2:8] = 0.0
    got = R.probs_grad_order_sum(da, u)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for r in range(3):
        total = f32(0.0)
        for b in range(3):
            groups = []
            for c in range(16):
                s = f32(0.0)
                for e in range(8):
                    j = b * 128 + c * 8 + e
                    if j < 300:
                        s = _fma_f32_exact(float(da[r, j]), float(u[r, j]), float(s))
                groups.append(s)
                if r == 0 and b == 0 and c == 0:
                    assert float(s) == 2.0 ** -24  # the fma's exact remainder (multiply-then-add: 0)
            while len(groups) > 1:
                half = len(groups) // 2
                groups = [groups[i] + groups[i + half] for i in range(half)]
            total = total + groups[0]
        assert got[r].view(torch.int32) == total.view(torch.int32)


def test_activation_spec():
    assert Activation("swiglu").is_glu and not Activation("gelu").is_glu
    assert Activation("clamped_swiglu", alpha=1.0, limit=5.0) != Activation("clamped_swiglu")
    assert Activation("swiglu") == lpmoe.activation.parse_activation("SwiGLU")
    with pytest.raises(ValueError, match="activation must be one of"):
        Activation("silu")
    with pytest.raises(ValueError, match="positive finite limit"):
        Activation("clamped_swiglu", limit=0.0)
    with pytest.raises(TypeError, match="activation must be a name"):
        lpmoe.activation.parse_activation(3)


# ----------------------------------------------------- standalone op (CPU)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_op_cpu_autograd(kind):
    h = rand_h(64, 256, torch.bfloat16, specials=False).requires_grad_(True)
    p = torch.rand(64, requires_grad=True)
    a = activation(h, kind, p)
    da = torch.randn_like(a)
    a.backward(da)
    dh, ra, dp = R.activation_backward(da, h.detach(), kind, p.detach())
    assert torch.equal(a.detach(), ra) and torch.equal(h.grad, dh) and torch.equal(p.grad, dp)


def test_activation_op_leading_dims_and_errors():
    h = torch.randn(2, 5, 64)
    assert activation(h, "swiglu").shape == (2, 5, 32)
    assert activation(h, "gelu", torch.ones(2, 5)).shape == (2, 5, 64)
    with pytest.raises(ValueError, match="even last dim"):
        activation(torch.randn(4, 33), "swiglu")
    with pytest.raises(ValueError, match="leading shape"):
        activation(h, "gelu", torch.ones(10))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        activation(h.double(), "gelu")


# ------------------------------------------------------------ GPU kernels
def _splits_case(splits, f, kind, tail=37, seed=0):
    rows = sum(splits) + tail
    w = 2 * f if Activation(kind).is_glu else f
    return rand_h(rows, w, seed=seed), torch.tensor(splits), rows


def _poisoned_empty(monkeypatch):
    real = kernels._empty_fp8

    def poisoned(*args, **kw):
        g = real(*args, **kw)
        for b in FP8_BUFS:
            if getattr(g, b) is not None:
                poison_(getattr(g, b))
        return g
    monkeypatch.setattr(kernels, "_empty_fp8", poisoned)


def _ref_quantized(a_cpu, q, splits, dbias=False):
    """lpmoe.group_quantize of the reference values into poisoned buffers."""
    out = lpmoe.GroupedTensor.empty(q, len(splits), tuple(a_cpu.shape), dtype=a_cpu.dtype,
                                    first_dims=splits, device="cpu")
    for b in FP8_BUFS:
        if getattr(out, b) is not None:
            poison_(getattr(out, b))
    if dbias:
        return lpmoe.group_quantize_dbias(a_cpu, q, len(splits), first_dims=splits, output=out)
    return lpmoe.group_quantize(a_cpu, q, len(splits), first_dims=splits, output=out), None


def _assert_same_fp8(ref, got):
    for b in FP8_BUFS:
        x, y = getattr(ref, b), getattr(got, b)
        assert (x is None) == (y is None), b
        if x is not None:
            xb, yb = x.view(torch.uint8).cpu(), y.view(torch.uint8).cpu()
            n = min(xb.numel(), yb.numel())
            diff = (xb[:n] != yb[:n]).nonzero()
            assert diff.numel() == 0, f"{b}: {diff.numel()} bytes differ, first at {diff[:4].flatten().tolist()}"


GPU_SPLITS = [
    ([0, 5, 0], 128),
    ([1, 127, 128, 129, 300], 256),
    ([17, 0, 300], 384),
    ([64] * 16, 128),
    ([3000, 100, 0, 183], 2048),
]


@requires_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_probs", [False, True])
def test_gpu_hp_kernels_bitexact(kind, dtype, with_probs):
    rows, f = 1000, 272  # F % 128 != 0: a partial column tile
    w = 2 * f if Activation(kind).is_glu else f
    h = rand_h(rows, w, dtype)
    da = rand_h(rows, f, dtype, seed=1)
    p = torch.rand(rows) if with_probs else None
    spec = Activation(kind)
    before = dict(kernels.CALLS)
    a = kernels.forward(h.cuda(), spec, p.cuda() if with_probs else None, None, write_hp=True).hp
    res = kernels.backward(da.cuda(), h.cuda(), spec, p.cuda() if with_probs else None, None, dh_hp=True)
    assert kernels.CALLS["fused_forward"] - before["fused_forward"] == 1
    assert kernels.CALLS["fused_backward"] - before["fused_backward"] == 1
    ra = R.activation_forward(h, kind, p)
    rdh, _, rdp = R.activation_backward(da, h, kind, p)
    assert same_bits(a, ra) == 0 and same_bits(res.dh, rdh) == 0
    if with_probs:
        assert same_bits(res.dprobs, rdp) == 0
    else:
        assert res.dprobs is None


@requires_cuda
@pytest.mark.parametrize("f", [512, 640, 1024, 1536, 2048, 2560])
def test_gpu_probs_gradient_every_partial_count(f):
    """d probs sums F/128 partials per row left to right: 4, 8, 12, 16 and 20
    partials take the 16-byte-vector reduction (in batches of 16 and a tail),
    5 the scalar one; both must give the reference's bits."""
    rows = 333
    h = rand_h(rows, 2 * f, torch.bfloat16, seed=f)
    da = rand_h(rows, f, torch.bfloat16, seed=f + 1)
    p = torch.rand(rows)
    res = kernels.backward(da.cuda(), h.cuda(), Activation("swiglu"), p.cuda(), None, dh_hp=True)
    _, _, rdp = R.activation_backward(da, h, "swiglu", p)
    assert same_bits(res.dprobs, rdp) == 0


@requires_cuda
@pytest.mark.parametrize("splits,f", GPU_SPLITS)
@pytest.mark.parametrize("kind", ["swiglu", "gelu", "clamped_swiglu"])
def test_gpu_fused_forward_fp8_bitexact(monkeypatch, splits, f, kind):
    _poisoned_empty(monkeypatch)
    h, sp, rows = _splits_case(splits, f, kind)
    p = torch.rand(rows)
    q = Float8BlockQuantizer(E4M3, block_dim=1)
    spec = Activation(kind)
    before = kernels.CALLS["fused_forward"]
    res = kernels.forward(h.cuda(), spec, p.cuda(), sp.cuda(), write_hp=True, quantizer=q)
    assert kernels.CALLS["fused_forward"] == before + 1
    ra = R.activation_forward(h, kind, p)
    ref, _ = _ref_quantized(ra, q, sp)
    _assert_same_fp8(ref, res.quantized)
    used = sum(splits)
    assert same_bits(res.hp[:used], ra[:used]) == 0  # grouped launch: member rows only


@requires_cuda
@pytest.mark.parametrize("splits,f", GPU_SPLITS)
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "relu", "clamped_swiglu"])
def test_gpu_fused_backward_fp8_bitexact(monkeypatch, splits, f, kind):
    _poisoned_empty(monkeypatch)
    h, sp, rows = _splits_case(splits, f, kind)
    da = rand_h(rows, f, seed=5)
    p = torch.rand(rows)
    qdh = Float8BlockQuantizer(E4M3, block_dim=1)
    spec = Activation(kind)
    before = kernels.CALLS["fused_backward"]
    res = kernels.backward(da.cuda(), h.cuda(), spec, p.cuda(), sp.cuda(), dh_quantizer=qdh, dbias=True)
    assert kernels.CALLS["fused_backward"] == before + 1
    rdh, _, rdp = R.activation_backward(da, h, kind, p)
    ref_dh, _ = _ref_quantized(rdh, qdh, sp)
    _assert_same_fp8(ref_dh, res.dh_quantized)
    used = sum(splits)
    assert same_bits(res.dprobs[:used], rdp[:used]) == 0 and bool((res.dprobs[used:] == 0).all())
    # the fused bias gradient is group_quantize_dbias's, bit for bit
    _, dbias = lpmoe.group_quantize_dbias(rdh.cuda(), qdh, len(splits), first_dims=sp.cuda())
    assert torch.equal(res.dbias.view(torch.int16), dbias.view(torch.int16))


def _table_expected(kind, dtype, table):
    """Whether a bf16 SwiGLU launch that may take the sigmoid table does
    (forward, FP8 backward; never the high-precision backward): forced, or
    the rule of csrc/activation/heuristics.cu (>= 16 DRAM bytes per SM cycle)."""
    if kind != "swiglu" or dtype != torch.bfloat16:
        return False
    if table is None:
        table = lpmoe._ext.ext().activation_dram_bytes_per_sm_cycle(torch.cuda.current_device()) >= 16.0
    return bool(table)


@requires_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table", [False, True])
def test_gpu_kernels_bitexact_on_every_input_value(monkeypatch, kind, dtype, table):
    """Every 16-bit pattern as the activation input (the gate for GLU kinds):
    the element math of the fused kernels (high precision and, for bf16, FP8)
    equals the reference on its whole input domain, not only on samples;
    with the sigmoid table forced off and on (bf16 SwiGLU; the counter proves
    which variant ran: the high-precision backward never takes it)."""
    if table and (kind != "swiglu" or dtype != torch.bfloat16):
        pytest.skip("the table serves bf16 SwiGLU only (forcing it elsewhere is a no-op)")
    _poisoned_empty(monkeypatch)
    monkeypatch.setattr(kernels, "SIGMOID_TABLE", table)
    launches = kernels.sigmoid_table_launches()
    f = 256
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, f)
    rows = every.shape[0]
    x = torch.cat([every, rand_h(rows, f, dtype, seed=3)], dim=1) if Activation(kind).is_glu else every
    da = rand_h(rows, f, dtype, seed=4, specials=False)
    p = torch.rand(rows)
    spec = Activation(kind)
    ra = R.activation_forward(x, kind, p)
    rdh, _, rdp = R.activation_backward(da, x, kind, p)
    a = kernels.forward(x.cuda(), spec, p.cuda(), None, write_hp=True).hp
    res = kernels.backward(da.cuda(), x.cuda(), spec, p.cuda(), None, dh_hp=True)
    assert same_bits(a, ra) == 0 and same_bits(res.dh, rdh) == 0 and same_bits(res.dprobs, rdp) == 0
    assert kernels.sigmoid_table_launches() - launches == (1 if _table_expected(kind, dtype, table) else 0)
    if dtype == torch.bfloat16:
        q = Float8BlockQuantizer(E4M3, block_dim=1)
        sp = torch.tensor([rows])
        before = kernels.CALLS["fused_forward"]
        fw = kernels.forward(x.cuda(), spec, p.cuda(), sp.cuda(), write_hp=False, quantizer=q)
        assert kernels.CALLS["fused_forward"] == before + 1
        _assert_same_fp8(_ref_quantized(ra, q, sp)[0], fw.quantized)
        # the FP8 backward (for SwiGLU: the sigmoid table, da read without staging)
        before = kernels.CALLS["fused_backward"]
        bw = kernels.backward(da.cuda(), x.cuda(), spec, p.cuda(), sp.cuda(), dh_quantizer=q)
        assert kernels.CALLS["fused_backward"] == before + 1
        _assert_same_fp8(_ref_quantized(rdh, q, sp)[0], bw.dh_quantized)
        assert same_bits(bw.dprobs, rdp) == 0
        assert kernels.sigmoid_table_launches() - launches == (3 if _table_expected(kind, dtype, table) else 0)


@requires_cuda
def test_gpu_glu_gradient_with_odd_ffn_takes_the_split_path():
    """F % 128 != 0: dh's 1x128 blocks straddle gate and value, so the kernel
    writes high precision and lpmoe.group_quantize follows; same bits."""
    splits, f = [100, 0, 200], 144
    h, sp, rows = _splits_case(splits, f, "swiglu")
    da = rand_h(rows, f, seed=2)
    q = Float8BlockQuantizer(E4M3, block_dim=1)
    before = dict(kernels.CALLS)
    res = kernels.backward(da.cuda(), h.cuda(), Activation("swiglu"), None, sp.cuda(), dh_quantizer=q)
    assert kernels.CALLS["split_backward"] == before["split_backward"] + 1
    assert kernels.CALLS["fused_backward"] == before["fused_backward"]
    rdh, _, _ = R.activation_backward(da, h, "swiglu")
    for va, vb in zip(_ref_quantized(rdh, q, sp)[0].split(), res.dh_quantized.split()):
        for b in FP8_BUFS:
            if va[b] is not None:
                assert torch.equal(va[b].view(torch.uint8), vb[b].view(torch.uint8).cpu()), b


@requires_cuda
def test_gpu_activation_op_autograd_matches_reference():
    h = rand_h(333, 512, specials=False).cuda().requires_grad_(True)
    p = torch.rand(333, device="cuda", requires_grad=True)
    a = activation(h, "swiglu", p)
    da = torch.randn_like(a)
    a.backward(da)
    dh, ra, dp = R.activation_backward(da.cpu(), h.detach().cpu(), "swiglu", p.detach().cpu())
    assert same_bits(a.detach(), ra) == 0 and same_bits(h.grad, dh) == 0 and same_bits(p.grad, dp) == 0


@requires_cuda
@pytest.mark.parametrize("table", [None, True])
def test_gpu_fused_kernels_capture_and_replay_new_routing_without_syncs(monkeypatch, table):
    """Eager without host syncs, then a captured graph replayed with new
    routing; as the device chooses and with the sigmoid table forced on (the
    table is filled by every launch, so a replay needs no host state)."""
    monkeypatch.setattr(kernels, "SIGMOID_TABLE", table)
    g, f = 8, 256
    rows = 4096
    spec = Activation("swiglu")
    q = Float8BlockQuantizer(E4M3, block_dim=1)
    h = torch.empty(rows, 2 * f, dtype=torch.bfloat16, device="cuda")
    da = torch.empty(rows, f, dtype=torch.bfloat16, device="cuda")
    p = torch.empty(rows, device="cuda")
    sp = torch.zeros(g, dtype=torch.int64, device="cuda")

    def step():
        fw = kernels.forward(h, spec, p, sp, write_hp=False, quantizer=q)
        bw = kernels.backward(da, h, spec, p, sp, dh_quantizer=q, dbias=True)
        return fw.quantized, bw.dh_quantized, bw.dbias, bw.dprobs

    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # eager: no host sync anywhere
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, outs = capture_graph(step)
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        cuts = torch.sort(torch.randint(0, rows - 100, (g - 1,), generator=gen)).values
        splits = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows - 100])]))
        sp.copy_(splits)
        h.copy_(rand_h(rows, 2 * f, seed=trial, specials=False))
        da.copy_(rand_h(rows, f, seed=trial + 10, specials=False))
        p.copy_(torch.rand(rows, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        rdh, _, rdp = R.activation_backward(da.cpu(), h.cpu(), "swiglu", p.cpu())
        qa_ref, _ = _ref_quantized(R.activation_forward(h.cpu(), "swiglu", p.cpu()), q, splits)
        for va, vb in zip(qa_ref.split(), outs[0].split()):
            for b in FP8_BUFS:
                assert torch.equal(va[b].view(torch.uint8), vb[b].view(torch.uint8).cpu()), b
        qdh_ref, _ = _ref_quantized(rdh, q, splits)
        for va, vb in zip(qdh_ref.split(), outs[1].split()):
            for b in FP8_BUFS:
                assert torch.equal(va[b].view(torch.uint8), vb[b].view(torch.uint8).cpu()), b
        used = int(splits.sum())
        assert same_bits(outs[3][:used], rdp[:used]) == 0
