"""MXFP8 and NVFP4 on the GPU (Hopper, software conversions): bit-exact
against lpmoe.reference for every shape kind and direction, compact and
swizzled scales, with poisoned outputs; grouped dequantize equals
member-by-member dequantize; graph capture; standalone swizzle."""
import pytest
import torch

import lpmoe
from conftest import poison_, requires_cuda
from lpmoe import GroupedTensor, MXFP8Quantizer, NVFP4Quantizer, ShapeKind
from lpmoe import mx_ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BUFS = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax", "columnwise_amax")


def _rand(n, dtype=torch.bfloat16, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    return x.to(dtype)


def _set_negative_nan(flat, i):
    """A negative NaN with a payload at flat[i], set by its bits (a cast from
    float makes it +NaN): MXFP8 writes the NaN byte, NVFP4 +6 like any NaN."""
    bits_dtype, neg_nan = {torch.bfloat16: (torch.int16, -63), torch.float16: (torch.int16, -511),
                           torch.float32: (torch.int32, -4194303)}[flat.dtype]
    flat.view(bits_dtype)[i] = neg_nan


def _make_input(kind, dtype, specials=True):
    """(x_cpu, kwargs) for group_quantize for one shape kind."""
    if kind == "same":
        x = _rand(4 * 128 * 144, dtype).view(4 * 128, 144)
        kw = dict(num_tensors=4)
    elif kind == "first":
        splits = [0, 128, 0, 93, 256, 0, 32, 0]       # empty members front/middle/end
        x = _rand((sum(splits) + 40) * 144, dtype).view(-1, 144)  # + capacity tail
        kw = dict(num_tensors=len(splits), first_dims=torch.tensor(splits))
    elif kind == "last":
        ks = [128, 384, 0, 256]
        x = _rand(256 * sum(ks), dtype).view(256, sum(ks))
        kw = dict(num_tensors=4, last_dims=torch.tensor(ks))
    else:  # both
        ms, ks = [128, 0, 256, 128], [256, 128, 128, 384]
        x = _rand(sum(m * k for m, k in zip(ms, ks)), dtype)
        kw = dict(num_tensors=4, first_dims=torch.tensor(ms), last_dims=torch.tensor(ks))
    if specials:
        flat = x.view(-1)
        flat[3] = float("inf")          # -> scale byte 254
        flat[40] = float("nan")         # ignored by amax
        _set_negative_nan(flat, 41)
        flat[1000:1100] = 0             # zero blocks -> scale byte 0
        flat[2000:2032] = 1e-30 if dtype != torch.float16 else 1e-7
    return x, kw


def _quantize_both(x, kw, q):
    outs = []
    for dev in ("cpu", "cuda"):
        kwd = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        g = lpmoe.group_quantize(x.to(dev), q, **kwd)
        outs.append(g)
    return outs


def _compare_members(a: GroupedTensor, b: GroupedTensor, names=BUFS):
    for va, vb in zip(a.split(), b.split()):
        for name in names:
            if va.get(name) is None:
                continue
            x, y = va[name].reshape(-1).view(torch.uint8).cpu(), vb[name].reshape(-1).view(torch.uint8).cpu()
            bad = (x != y).nonzero()
            assert bad.numel() == 0, f"{name}: {bad.numel()} bytes differ, first {bad[:4].flatten().tolist()}"


@requires_cuda
@pytest.mark.parametrize("kind", ["same", "first", "last", "both"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_group_quantize_bitexact(kind, swizzled, fp8, dtype):
    q = MXFP8Quantizer(fp8, swizzled_scales=swizzled)
    x, kw = _make_input(kind, dtype)
    ref, _ = _quantize_both(x, kw, q)
    # GPU with poisoned outputs: every byte of every member must be written.
    kwd = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    from lpmoe.quantize import _as_grouped_input
    g = _as_grouped_input(x.cuda(), kwd.pop("num_tensors"), kwd.get("first_dims"), None, kwd.get("last_dims"))
    out = mx_ops.allocate(q, g)
    for b in BUFS:
        if getattr(out, b) is not None:
            poison_(getattr(out, b))
    got = lpmoe.group_quantize(g, q, output=out)
    assert got.rowwise_data.data_ptr() == out.rowwise_data.data_ptr()
    _compare_members(ref, got)
    # capacity tail (varying-first): rows past the members stay poisoned
    if kind == "first":
        used = int(kw["first_dims"].sum()) * 144
        assert (got.rowwise_data.view(torch.uint8)[used:].cpu() == 0xA5).all()


@requires_cuda
@pytest.mark.parametrize("kind", ["same", "first", "last", "both"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp8_group_dequantize_matches_members(kind, swizzled, columnwise, out_dtype):
    q = MXFP8Quantizer(E4M3, rowwise=not columnwise, columnwise=columnwise, swizzled_scales=swizzled)
    x, kw = _make_input(kind, torch.bfloat16, specials=False)
    ref, got = _quantize_both(x, kw, q)
    # random scale bytes everywhere, including 0, 254 and 255 (NaN)
    name = "columnwise_scale_inv" if columnwise else "scale_inv"
    sc = torch.randint(0, 256, (getattr(ref, name).numel(),), dtype=torch.uint8)
    sc[:3] = torch.tensor([0, 254, 255], dtype=torch.uint8)
    getattr(ref, name).copy_(sc)
    getattr(got, name).copy_(sc.cuda())
    yg = lpmoe.group_dequantize(got, out_dtype)
    yc = lpmoe.group_dequantize(ref, out_dtype)
    assert yg.shape_kind is got.shape_kind and yg.logical_shape == got.logical_shape
    shapes = [tuple(t.shape) for t in yg.split()]
    assert shapes == [tuple(t.shape) for t in yc.split()]
    for a, b in zip(yc.split(), yg.split()):
        b = b.cpu()
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float()))
        assert torch.equal(a[~nan].view(-1).float(), b[~nan].view(-1).float())
    # grouped == member-by-member single dequantize on the GPU, bitwise
    for v, y in zip(got.split(), yg.split()):
        if v["shape"][0] * v["shape"][1] == 0:
            continue
        t = lpmoe.reference.MXFP8Quantized(
            data=None if columnwise else v["rowwise_data"], scale_inv=None if columnwise else v["scale_inv"],
            columnwise_data=v["columnwise_data"] if columnwise else None,
            columnwise_scale_inv=v["columnwise_scale_inv"] if columnwise else None,
            fp8_dtype=E4M3, with_gemm_swizzled_scales=swizzled)
        single = lpmoe.dequantize(t, out_dtype)
        assert torch.equal(single.view(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@requires_cuda
@pytest.mark.parametrize("shape", [(0, 128), (1, 32), (993, 512), (65, 144), (128, 160)])
@pytest.mark.parametrize("swizzled", [False, True])
def test_mxfp8_single_bitexact(shape, swizzled):
    q = MXFP8Quantizer(E4M3, swizzled_scales=swizzled)
    x = _rand(shape[0] * shape[1]).view(shape)
    ref = lpmoe.quantize(x, q)
    got = lpmoe.quantize(x.cuda(), q)
    for f in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv"):
        a, b = getattr(ref, f), getattr(got, f)
        assert a.shape == b.shape, f
        assert torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()), f
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(lpmoe.dequantize(ref, dt), lpmoe.dequantize(got, dt).cpu())


@requires_cuda
@pytest.mark.parametrize("kind", ["single", "same", "first"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_quantize_bitexact(kind, swizzled, dtype):
    q = NVFP4Quantizer(swizzled_scales=swizzled)
    if kind == "single":
        x = _rand(992 * 512, dtype).view(992, 512)
        x[5, 7] = 300.0
        x[600:616, 0:16] = 1e-9  # tiny block next to a large amax: scale underflow trap
        ref, got = lpmoe.quantize(x, q), lpmoe.quantize(x.cuda(), q)
        for f in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax"):
            assert torch.equal(getattr(ref, f).view(torch.uint8).cpu(), getattr(got, f).reshape(
                getattr(ref, f).shape).view(torch.uint8).cpu()), f
        assert torch.equal(lpmoe.dequantize(ref, torch.float32), lpmoe.dequantize(got, torch.float32).cpu())
        return
    if kind == "same":
        x, kw = _rand(3 * 64 * 96, dtype).view(192, 96), dict(num_tensors=3)
    else:
        splits = [0, 48, 128, 0, 16]
        x = _rand((sum(splits) + 32) * 96, dtype).view(-1, 96)
        kw = dict(num_tensors=5, first_dims=torch.tensor(splits))
    x.view(-1)[10] = float("nan")
    x.view(-1)[11] = float("inf") if kind == "same" else 0.0
    _set_negative_nan(x.view(-1), 12)  # the packed encode takes signs from the product (mx_numerics.cuh)
    ref, got = _quantize_both(x, kw, q)
    _compare_members(ref, got)
    yc, yg = lpmoe.group_dequantize(ref, torch.float32), lpmoe.group_dequantize(got, torch.float32)
    for a, b in zip(yc.split(), yg.split()):
        b = b.cpu()
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_e2m1_rounding_ties_bitexact(dtype):
    """Every E2M1 rounding threshold, exactly and one ulp to either side, both
    signs, zeros, a subnormal and NaN, scaled by exactly 1 in both directions
    (member amax 2688 and a 6.0 on the diagonal of every 16x16 block make
    every block scale 1), so the GPU's E2M1 rounding meets each tie."""
    itype = torch.int16 if dtype == torch.bfloat16 else torch.int32
    base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=dtype)
    bits = base.view(itype)
    probes = torch.cat([base, (bits + 1).view(dtype), (bits - 1).view(dtype),
                        torch.tensor([0.0, 1e-39, float("nan")], dtype=dtype)])
    probes = torch.cat([probes, -probes])
    x = probes.repeat(128 * 128 // probes.numel() + 1)[:128 * 128].view(128, 128).clone()
    blocks = x.view(8, 16, 8, 16)
    for i in range(16):
        blocks[:, i, :, i] = 6.0
    x[0, 0] = 2688.0  # member amax: S_enc = 2688 / amax = 1
    _set_negative_nan(x.view(-1), 1)  # `-probes` leaves bf16's NaN positive
    q = NVFP4Quantizer()
    ref, got = lpmoe.quantize(x, q), lpmoe.quantize(x.cuda(), q)
    assert float(ref.amax) == 2688.0
    for f in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax"):
        a, b = getattr(ref, f), getattr(got, f)
        assert torch.equal(a.view(torch.uint8).cpu(), b.reshape(a.shape).view(torch.uint8).cpu()), f


@requires_cuda
def test_empty_tensors_launch_nothing_and_capture():
    x = torch.empty(0, 128, device="cuda", dtype=torch.bfloat16)
    for q in (MXFP8Quantizer(), NVFP4Quantizer(), MXFP8Quantizer(swizzled_scales=True)):
        lpmoe.quantize(x, q)  # warm-up (allocations) outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            t = lpmoe.quantize(x, q)
            y = lpmoe.dequantize(t, torch.bfloat16)
        graph.replay()
        torch.cuda.synchronize()
        assert y.shape == (0, 128)


@requires_cuda
@pytest.mark.parametrize("q", [MXFP8Quantizer(swizzled_scales=True), NVFP4Quantizer()])
def test_graph_replay_new_splits_equals_eager(q):
    rows, k, n = 1024, 256, 4
    x = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
    fd = torch.empty(n, device="cuda", dtype=torch.int64)
    x.copy_(_rand(rows * k).view(rows, k))
    fd.copy_(torch.tensor([128, 256, 0, 512]))
    out = lpmoe.group_quantize(x, q, n, first_dims=fd)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out = lpmoe.group_quantize(x, q, n, first_dims=fd, output=out)
            g_deq = lpmoe.group_dequantize(g_out, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for splits in ([16, 32, 480, 496], [0, 0, 1024, 0]):
        x.copy_(_rand(rows * k).view(rows, k))
        fd.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        eager = lpmoe.group_quantize(x.clone(), q, n, first_dims=fd.clone())
        _compare_members(eager, g_out)
        e_deq = lpmoe.group_dequantize(eager, torch.bfloat16)
        for a, b in zip(e_deq.split(), g_deq.split()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("kind", ["first", "both"])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_swizzle_grouped_matches_swizzled_quantize(device, kind, fmt):
    if fmt == "nvfp4" and kind == "both":
        pytest.skip("NVFP4 groups are same-shape / varying-first")
    make = (lambda s: MXFP8Quantizer(E4M3, swizzled_scales=s)) if fmt == "mxfp8" else \
        (lambda s: NVFP4Quantizer(swizzled_scales=s))
    if fmt == "nvfp4":
        splits = [0, 48, 160, 16]
        x = _rand((sum(splits) + 16) * 96).view(-1, 96)
        kw = dict(num_tensors=4, first_dims=torch.tensor(splits))
    else:
        x, kw = _make_input(kind, torch.bfloat16, specials=False)
    kwd = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    compact = lpmoe.group_quantize(x.to(device), make(False), **kwd)
    direct = lpmoe.group_quantize(x.to(device), make(True), **kwd)
    swz = lpmoe.swizzle_scales(compact)
    assert swz.with_gemm_swizzled_scales
    _compare_members(direct, swz, ("scale_inv", "columnwise_scale_inv"))
    back = lpmoe.unswizzle_scales(swz)
    _compare_members(compact, back, ("scale_inv", "columnwise_scale_inv"))


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of 128"):
        lpmoe.group_quantize(torch.zeros(100, 256), MXFP8Quantizer(), 2, last_dims=torch.tensor([128, 128]))
    with pytest.raises(ValueError, match="multiple of 128"):
        lpmoe.group_quantize(torch.zeros(128 * 200), MXFP8Quantizer(), 2, first_dims=torch.tensor([128, 0]),
                             last_dims=torch.tensor([200, 0]))
    with pytest.raises(ValueError, match="multiple of 16"):
        lpmoe.group_quantize(torch.zeros(64, 32), NVFP4Quantizer(), 2, first_dims=torch.tensor([8, 56]))
    with pytest.raises(NotImplementedError, match="same-shape and varying-first"):
        lpmoe.group_quantize(torch.zeros(128, 256), NVFP4Quantizer(), 2, last_dims=torch.tensor([128, 128]))
    with pytest.raises(ValueError, match="multiple of 16"):
        lpmoe.group_quantize(torch.zeros(64, 40), MXFP8Quantizer(), 1)


def test_nvfp4_columnwise_only_keeps_amax_cpu():
    x = torch.randn(64, 32)
    g = lpmoe.group_quantize(x, NVFP4Quantizer(rowwise=False), 2, first_dims=torch.tensor([32, 32]))
    ref = [x[:32].abs().max(), x[32:].abs().max()]
    assert torch.equal(g.amax, torch.stack(ref)) and torch.equal(g.columnwise_amax, g.amax)


@requires_cuda
def test_gpu_validation_of_buffers():
    q = MXFP8Quantizer()
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    t = lpmoe.quantize(x, q)
    bad = lpmoe.reference.MXFP8Quantized(data=t.data, scale_inv=t.scale_inv[:, :2], columnwise_data=None,
                                         columnwise_scale_inv=None, fp8_dtype=E4M3, with_gemm_swizzled_scales=False)
    with pytest.raises(ValueError, match="scales must hold"):
        lpmoe.dequantize(bad, torch.bfloat16)
    out = lpmoe.group_quantize(x, q, 2)
    out.scale_inv = out.scale_inv.view(torch.int8)
    with pytest.raises(TypeError, match="scale_inv has dtype"):
        lpmoe.group_quantize(x, q, 2, output=out)
    # a misaligned output buffer is refused before any launch
    fq = lpmoe.Float8BlockQuantizer()
    o = GroupedTensor.empty(fq, 2, (256, 128), device="cuda")
    o.rowwise_data = torch.empty(256 * 128 + 1, dtype=torch.float8_e4m3fn, device="cuda")[1:]
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        lpmoe.group_quantize(x, fq, 2, output=o)


@requires_cuda
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_swizzle_grouped_no_sync_and_capturable(fmt):
    make = (lambda s: MXFP8Quantizer(E4M3, swizzled_scales=s)) if fmt == "mxfp8" else \
        (lambda s: NVFP4Quantizer(swizzled_scales=s))
    x = _rand(512 * 96).view(512, 96).cuda()
    fd = torch.tensor([0, 176, 16, 320], device="cuda")
    compact = lpmoe.group_quantize(x, make(False), 4, first_dims=fd)
    direct = lpmoe.group_quantize(x, make(True), 4, first_dims=fd)
    lpmoe.swizzle_scales(compact)  # warm-up outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            swz = lpmoe.swizzle_scales(compact)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph.replay()
    torch.cuda.synchronize()
    _compare_members(direct, swz, ("scale_inv", "columnwise_scale_inv"))
