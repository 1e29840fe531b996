"""lpmoe.grouped_gemm: validation and reference (CPU), both GPU backends
against the fp64 product of the dequantized operands, empty groups, caller
outputs, persistent workspaces, no host syncs, CUDA graph capture/replay."""
import contextlib

import pytest
import torch

import lpmoe
from lpmoe import Float8BlockQuantizer, GroupedTensor
from lpmoe.gemm import CALLS, gemm_workspace, reference_grouped_gemm, setup_workspace
from lpmoe.gemm.operands import parse_operands

from conftest import assert_replays_match_eager, requires_cuda

Q1 = Float8BlockQuantizer(block_dim=1)
Q2 = Float8BlockQuantizer(block_dim=2)


def tokens(x, splits):
    g = len(splits)
    first = torch.tensor(splits, dtype=torch.int64, device=x.device)
    return GroupedTensor(num_tensors=g, logical_shape=tuple(x.shape), dtype=x.dtype, rowwise_data=x.view(-1),
                         first_dims=first)


def make_case(splits, k, n, dtype, device, fp8, tail=0, seed=0):
    """(a, b) operands of each kind, plus the high-precision tensors."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(splits) + tail
    g = len(splits)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(device)
    dy = torch.randn(rows, n, generator=gen).to(dtype).to(device)
    w = (torch.randn(g, n, k, generator=gen) * 0.05).to(dtype).to(device)
    first = torch.tensor(splits, dtype=torch.int64, device=device)
    if fp8:
        xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=first)
        dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=first)
        wg = lpmoe.group_quantize(w.view(g * n, k), Q2, num_tensors=g)
    else:
        xg, dyg, wg = tokens(x, splits), tokens(dy, splits), w
    return {"fprop": (xg, wg), "dgrad": (dyg, wg), "wgrad": (dyg, xg)}, (x, dy, w)


def rel_err(out, ref):
    ref = ref.double()
    den = ref.norm()
    return float((out.double() - ref).norm() / (den if den > 0 else 1.0))


# ------------------------------------------------------------------ CPU
def test_reference_matches_per_member_loops_bf16():
    splits = [3, 0, 17, 9]
    ops, (x, dy, w) = make_case(splits, 32, 48, torch.float32, "cpu", fp8=False, tail=5)
    y = lpmoe.grouped_gemm(*ops["fprop"], kind="fprop")
    dx = lpmoe.grouped_gemm(*ops["dgrad"], kind="dgrad")
    dw = lpmoe.grouped_gemm(*ops["wgrad"], kind="wgrad")
    r = 0
    for t, m in enumerate(splits):
        torch.testing.assert_close(y[r:r + m], x[r:r + m] @ w[t].t())
        torch.testing.assert_close(dx[r:r + m], dy[r:r + m] @ w[t])
        torch.testing.assert_close(dw[t], dy[r:r + m].t() @ x[r:r + m])
        r += m
    assert torch.all(y[r:] == 0) and torch.all(dx[r:] == 0)  # fresh output: tail zeroed
    assert torch.all(dw[1] == 0)


def test_reference_fp8_uses_the_dequantized_copy_the_gemm_reads():
    splits = [130, 0, 7]
    ops, (x, dy, w) = make_case(splits, 256, 128, torch.bfloat16, "cpu", fp8=True)
    # wgrad reads the columnwise (token-blocked) copies.
    a, b = ops["wgrad"]
    dw = lpmoe.grouped_gemm(a, b, kind="wgrad", out_dtype=torch.float32)
    assert dw.dtype == torch.float32 and dw.shape == (3, 128, 256)
    ref = dy[:130].double().t() @ x[:130].double()
    assert rel_err(dw[0], ref) < 0.06  # FP8 quantization error only
    assert torch.all(dw[1] == 0)


def test_reference_bias_and_accumulate():
    splits = [4, 6]
    ops, (x, dy, w) = make_case(splits, 16, 32, torch.float32, "cpu", fp8=False)
    bias = torch.randn(2, 32)
    y = lpmoe.grouped_gemm(*ops["fprop"], kind="fprop", bias=bias)
    torch.testing.assert_close(y[:4], x[:4] @ w[0].t() + bias[0])
    acc = torch.ones(2, 32, 16)
    lpmoe.grouped_gemm(*ops["wgrad"], kind="wgrad", out=acc, accumulate=True)
    torch.testing.assert_close(acc[1], 1 + dy[4:].t() @ x[4:])


@pytest.mark.parametrize("case", ["kind", "groups", "kdim", "fp8_mixed", "direction", "block_dim", "accum",
                                  "bias_kind", "out_shape", "backend", "cpu_backend", "wgrad_rows", "list"])
def test_clear_errors(case):
    ops, (x, dy, w) = make_case([4, 4], 128, 128, torch.bfloat16, "cpu", fp8=False)
    fops, _ = make_case([4, 4], 128, 128, torch.bfloat16, "cpu", fp8=True)
    a, b = ops["fprop"]
    with pytest.raises((ValueError, TypeError)) as e:
        if case == "kind":
            lpmoe.grouped_gemm(a, b, kind="forward")
        elif case == "groups":
            lpmoe.grouped_gemm(a, b[:1], kind="fprop")
        elif case == "kdim":
            lpmoe.grouped_gemm(a, torch.zeros(2, 128, 64, dtype=torch.bfloat16), kind="fprop")
        elif case == "fp8_mixed":
            lpmoe.grouped_gemm(fops["fprop"][0], b, kind="fprop")
        elif case == "direction":
            xq = lpmoe.group_quantize(x, Q1.copy(columnwise=False), num_tensors=2,
                                      first_dims=torch.tensor([4, 4]))
            lpmoe.grouped_gemm(fops["wgrad"][0], xq, kind="wgrad")
        elif case == "block_dim":
            lpmoe.grouped_gemm(fops["fprop"][0], fops["fprop"][0], kind="fprop")
        elif case == "accum":
            lpmoe.grouped_gemm(a, b, kind="fprop", accumulate=True, out=torch.zeros(8, 128))
        elif case == "bias_kind":
            lpmoe.grouped_gemm(*ops["dgrad"], kind="dgrad", bias=torch.zeros(2, 128))
        elif case == "out_shape":
            lpmoe.grouped_gemm(a, b, kind="fprop", out=torch.zeros(7, 128, dtype=torch.bfloat16))
        elif case == "backend":
            lpmoe.grouped_gemm(a, b, kind="fprop", backend="fast")
        elif case == "cpu_backend":
            lpmoe.grouped_gemm(a, b, kind="fprop", backend="grouped")
        elif case == "wgrad_rows":
            lpmoe.grouped_gemm(ops["wgrad"][0], tokens(x[:6].contiguous(), [3, 3]), kind="wgrad")
        elif case == "list":
            lpmoe.grouped_gemm(a, [w[0], w[1][:, :64]], kind="fprop")
    msg = str(e.value)
    assert len(msg) > 20  # names what was expected


def test_stacked_weights_are_not_wrapped(monkeypatch):
    """(G, N, K) weight tensors go to the kernels as they are: no grouped
    wrapper, hence no offsets computation per call (a launch and its host
    time on the GPU), and the same products as a list of the same weights."""
    ops, (x, dy, w) = make_case([5, 0, 11], 32, 48, torch.float32, "cpu", fp8=False, tail=2)
    launches = []
    real = GroupedTensor._launch_offsets
    monkeypatch.setattr(GroupedTensor, "_launch_offsets", lambda self, *a: launches.append(1) or real(self, *a))
    for kind in ("fprop", "dgrad"):
        a, b = ops[kind]
        p = parse_operands(a, b, kind)
        assert p.b_stacked is b and p.b_grouped is None and p.b_list is None
        y = lpmoe.grouped_gemm(a, b, kind=kind)
        y_list = lpmoe.grouped_gemm(a, list(b), kind=kind)
        assert torch.equal(y, y_list)
    assert not launches


def test_parse_roles():
    ops, _ = make_case([4, 4], 128, 256, torch.bfloat16, "cpu", fp8=True)
    p = parse_operands(*ops["dgrad"], "dgrad")
    assert (p.n, p.k, p.num_groups, p.fp8) == (256, 128, 2, True)


# ------------------------------------------------------------------ GPU
SPLITS = {
    "mixed": [0, 5, 130, 127, 256, 1, 0, 64],
    "uniform": [128] * 8,
    "skewed": [900, 4, 0, 36],
    "one": [300],
    "g64": [(i * 37) % 97 for i in range(64)],
    "odd_dims": [3, 130, 0, 61],
}
SPLITS_4 = {  # cuBLASLt FP8 needs multiples of 4
    "mixed": [0, 4, 132, 128, 256, 8, 0, 64],
    "uniform": [128] * 8,
    "skewed": [900, 4, 0, 36],
    "one": [300],
    "g64": [(i * 36) % 96 for i in range(64)],
    "odd_dims": [4, 132, 0, 60],
}


def _tol(out_dtype):
    return 5e-3 if out_dtype != torch.float32 else 1e-3


@requires_cuda
@pytest.mark.parametrize("backend", ["grouped", "cublas"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("split_name", list(SPLITS))
def test_gpu_matches_reference(backend, fmt, kind, split_name):
    splits = (SPLITS_4 if (fmt == "fp8" and backend == "cublas") else SPLITS)[split_name]
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    # odd_dims: K and N multiples of 16 but not of 128 (partial K-blocks and
    # partial 128x128 weight-scale blocks)
    k, n = {"g64": (128, 256), "odd_dims": (400, 272)}.get(split_name, (256, 384))
    ops, _ = make_case(splits, k, n, dtype, "cuda", fp8=fmt == "fp8", tail=3)
    a, b = ops[kind]
    out_dtype = torch.float32 if kind == "wgrad" else dtype
    shape = (len(splits), n, k) if kind == "wgrad" else (a.logical_shape[0], n if kind == "fprop" else k)
    out = torch.full(shape, float("nan"), dtype=out_dtype, device="cuda")  # poisoned
    m_splits = splits if backend == "cublas" else None
    before = dict(CALLS)
    res = lpmoe.grouped_gemm(a, b, kind=kind, out=out, backend=backend, m_splits=m_splits)
    assert res.data_ptr() == out.data_ptr()
    if backend == "grouped" and fmt != "fp8":
        # 64-row tiles for fprop/dgrad of groups averaging <= 128 rows (the
        # "mixed", "g64" and "odd_dims" splits here), else 128-row tiles
        small = kind != "wgrad" and a.logical_shape[0] <= 128 * len(splits)
        ran = "16bit_rows64" if small else "16bit_rows128"
        assert CALLS[ran] == before[ran] + 1
    p = parse_operands(a, b, kind, splits)
    ref = reference_grouped_gemm(p, None, False, None, torch.float64)
    if kind == "wgrad":
        assert rel_err(res, ref) <= _tol(out_dtype)
        for t, m in enumerate(splits):
            if m == 0:
                assert torch.all(res[t] == 0)
    else:
        used = sum(splits)
        assert rel_err(res[:used], ref[:used]) <= _tol(out_dtype)
        assert torch.isnan(res[used:].float()).all()  # caller's tail untouched


@requires_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_wgrad_accumulate_and_empty_groups(fmt):
    splits = [0, 200, 0, 56]
    ops, _ = make_case(splits, 128, 256, torch.bfloat16, "cuda", fp8=fmt == "fp8")
    a, b = ops["wgrad"]
    base = torch.randn(4, 256, 128, device="cuda")
    acc = base.clone()
    lpmoe.grouped_gemm(a, b, kind="wgrad", out=acc, accumulate=True, backend="grouped")
    p = parse_operands(a, b, "wgrad", splits)
    ref = reference_grouped_gemm(p, None, False, None, torch.float64)
    assert torch.equal(acc[0], base[0]) and torch.equal(acc[2], base[2])  # empty: untouched
    assert rel_err(acc - base, ref) < 1e-3
    fresh = lpmoe.grouped_gemm(a, b, kind="wgrad", out=torch.full_like(base, float("nan")), backend="grouped")
    assert torch.all(fresh[0] == 0) and torch.all(fresh[2] == 0)  # empty: zeros
    bf = lpmoe.grouped_gemm(a, b, kind="wgrad", out=torch.full(base.shape, float("nan"), dtype=torch.bfloat16,
                                                                 device="cuda"), backend="grouped")
    assert bf.dtype == torch.bfloat16 and rel_err(bf, ref) < 5e-3  # bf16 written by the kernel
    assert torch.all(bf[0] == 0) and torch.all(bf[2] == 0)
    acc_bf = base.bfloat16()
    lpmoe.grouped_gemm(a, b, kind="wgrad", out=acc_bf, accumulate=True, backend="grouped")
    assert torch.equal(acc_bf[0], base[0].bfloat16())
    assert rel_err(acc_bf.double() - base.bfloat16().double(), ref) < 2e-2  # bf16 accumulator rounding


@requires_cuda
def test_gpu_fprop_bias_list_weights_and_fresh_tail():
    splits = [5, 0, 133]
    ops, (x, dy, w) = make_case(splits, 128, 256, torch.bfloat16, "cuda", fp8=False, tail=9)
    a, _ = ops["fprop"]
    bias = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    y = lpmoe.grouped_gemm(a, [w[i] for i in range(3)], kind="fprop", bias=bias, backend="grouped")
    y2 = lpmoe.grouped_gemm(a, w, kind="fprop", bias=list(bias), backend="cublas", m_splits=splits)
    r = 0
    for t, m in enumerate(splits):
        ref = x[r:r + m].double() @ w[t].double().t() + bias[t].double()
        if m:
            assert rel_err(y[r:r + m], ref) < 5e-3 and rel_err(y2[r:r + m], ref) < 5e-3
        r += m
    assert torch.all(y[r:] == 0) and torch.all(y2[r:] == 0)


@requires_cuda
@pytest.mark.parametrize("fmt, config", [("bf16", None), ("fp16", None), ("fp8", (-1, 0)), ("fp8", (128, 1)),
                                         ("fp8", (192, 2))])
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
@pytest.mark.parametrize("splits, tail", [([0, 5, 130, 1], 3), ([64] * 6, 700), ([40, 60], 0), ([0, 0], 9)])
def test_gpu_fresh_output_tail_zeroed_by_the_gemm_launch(fmt, config, kind, splits, tail):
    """A fresh output's capacity tail is zeroed by the grouped GEMM's own
    launches (the argument builder's extra blocks; a tail launch inside the
    binding for lpmoe's FP8 kernel), not by the separate row-epilogue call
    (counted); the output memory is poisoned first through the allocator.
    With a bias the row epilogue still runs once and does both."""
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    k, n = 256, 384
    ops, _ = make_case(splits, k, n, dtype, "cuda", fp8=fmt == "fp8", tail=tail)
    a, b = ops[kind]
    rows = a.logical_shape[0]
    used = sum(splits)
    p = parse_operands(a, b, kind, splits)
    ref = reference_grouped_gemm(p, None, False, None, torch.float64)
    pinned = lpmoe.gemm.fp8_kernel_config(*config) if config else contextlib.nullcontext()
    with pinned:
        lpmoe.grouped_gemm(a, b, kind=kind, backend="grouped")  # warm: workspaces, caches
        torch.cuda.synchronize()
        junk = torch.full((rows, n if kind == "fprop" else k), float("nan"), dtype=dtype, device="cuda")
        ptr = junk.data_ptr()
        del junk  # the caching allocator hands this block to the next same-size request
        before = dict(CALLS)
        res = lpmoe.grouped_gemm(a, b, kind=kind, backend="grouped")
    assert res.data_ptr() == ptr, "the output did not reuse the poisoned block"
    assert CALLS["row_epilogue"] == before["row_epilogue"]
    if config:
        key = lpmoe.gemm.fp8_kernel_key(*config)
        assert CALLS[key] == before.get(key, 0) + 1
    assert torch.all(res[used:] == 0)
    if used:
        assert rel_err(res[:used], ref[:used]) <= _tol(dtype)
    if kind == "fprop" and fmt == "bf16":  # a bias: the row epilogue adds it and zeroes the tail
        bias = torch.randn(len(splits), n, device="cuda", dtype=dtype)
        junk = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
        ptr = junk.data_ptr()
        del junk
        y = lpmoe.grouped_gemm(a, b, kind=kind, bias=bias, backend="grouped")
        assert y.data_ptr() == ptr and CALLS["row_epilogue"] == before["row_epilogue"] + 1
        assert torch.all(y[used:] == 0)
        rep = torch.repeat_interleave(bias.double(), torch.tensor(splits, device="cuda"), dim=0)
        if used:
            assert rel_err(y[:used], ref[:used] + rep) <= _tol(dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [256, 5])
def test_gpu_zero_tail_kernel(dtype, cols):
    """The row epilogue without a bias zeroes exactly the rows past sum(M_t)
    (16-byte stores when rows are 16-byte multiples, else element stores;
    cols=5 also starts the tail off 16-byte alignment) and nothing else."""
    from lpmoe._ext import ext
    for splits, total in (([3, 0, 70], 100), ([40, 60], 100), ([0, 0], 7), ([1], 4099)):
        g = GroupedTensor.from_dense(torch.zeros(total, cols, device="cuda", dtype=dtype),
                                     first_dims=torch.tensor(splits, device="cuda"))
        y = torch.full((total, cols), float("nan"), dtype=dtype, device="cuda")
        ext().grouped_row_epilogue(y, None, g.padded_row_offsets, len(splits), True)
        used = sum(splits)
        assert torch.isnan(y[:used]).all() and torch.all(y[used:] == 0)


@requires_cuda
def test_gpu_fp8_weight_scales_rebuilt_when_one_copy_is_missing():
    splits = [64, 192]
    ops, _ = make_case(splits, 256, 384, torch.bfloat16, "cuda", fp8=True)
    a, wg = ops["fprop"]
    full = lpmoe.grouped_gemm(a, wg, kind="fprop", backend="grouped")
    w_row = GroupedTensor(num_tensors=2, logical_shape=wg.logical_shape, dtype=wg.dtype,
                          quantizer=Q2.copy(columnwise=False), rowwise_data=wg.rowwise_data, scale_inv=wg.scale_inv)
    assert torch.equal(lpmoe.grouped_gemm(a, w_row, kind="fprop", backend="grouped"), full)


@requires_cuda
def test_gpu_workspaces_are_persistent():
    ops, _ = make_case([64, 64], 128, 128, torch.bfloat16, "cuda", fp8=False)
    dev = torch.device("cuda")
    ptrs = [gemm_workspace(dev, s).data_ptr() for s in (0, 1)] + [setup_workspace(dev, 2).data_ptr()]
    assert ptrs[0] != ptrs[1]  # dgrad and wgrad never share a workspace
    for kind in ("fprop", "dgrad", "wgrad"):
        lpmoe.grouped_gemm(*ops[kind], kind=kind, backend="grouped")
        lpmoe.grouped_gemm(*ops[kind], kind=kind, backend="cublas", m_splits=[64, 64])
    assert [gemm_workspace(dev, s).data_ptr() for s in (0, 1)] + [setup_workspace(dev, 2).data_ptr()] == ptrs


@requires_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_grouped_backend_has_no_host_sync(fmt):
    ops, _ = make_case([3, 0, 200, 61], 128, 256, torch.bfloat16, "cuda", fp8=fmt == "fp8")
    for kind in ("fprop", "dgrad", "wgrad"):  # warm: caches, workspaces, pointer tables
        lpmoe.grouped_gemm(*ops[kind], kind=kind)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        before = CALLS["grouped"]
        for kind in ("fprop", "dgrad", "wgrad"):
            lpmoe.grouped_gemm(*ops[kind], kind=kind)
        assert CALLS["grouped"] == before + 3  # auto took the grouped backend
    finally:
        torch.cuda.set_sync_debug_mode(0)


@requires_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_graph_replay_with_new_routing(fmt):
    g, k, n, rows = 4, 256, 384, 512
    fp8 = fmt == "fp8"
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    w = (torch.randn(g, n, k, device="cuda") * 0.05).bfloat16()
    m = torch.tensor([128, 128, 128, 128], device="cuda")

    def step():
        if fp8:
            xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=m)
            dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=m)
            wg = lpmoe.group_quantize(w.view(g * n, k), Q2, num_tensors=g)
        else:
            xg, dyg, wg = [GroupedTensor(num_tensors=g, logical_shape=tuple(t.shape), dtype=t.dtype,
                                         rowwise_data=t.view(-1), first_dims=m) for t in (x, dy)] + [w]
        y = lpmoe.grouped_gemm(xg, wg, kind="fprop")
        dx = lpmoe.grouped_gemm(dyg, wg, kind="dgrad")
        dw = lpmoe.grouped_gemm(dyg, xg, kind="wgrad")
        return y, dx, dw

    routings = ([0, 300, 12, 200], [512, 0, 0, 0], [100, 100, 100, 100])
    graph, static = assert_replays_match_eager(step, m, routings, (x, dy))
    # 200 replays of the captured dgrad+wgrad sequence stay bit-identical
    graph.replay()
    first = [t.clone() for t in static]
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, static))


@requires_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_cublas_fp32_output_is_tighter(fmt):
    splits = [64, 0, 128]
    ops, _ = make_case(splits, 256, 128, torch.bfloat16, "cuda", fp8=fmt == "fp8")
    a, b = ops["fprop"]
    y = lpmoe.grouped_gemm(a, b, kind="fprop", out_dtype=torch.float32, backend="cublas", m_splits=splits)
    ref = reference_grouped_gemm(parse_operands(a, b, "fprop", splits), None, False, None, torch.float64)
    # fp8: the tensor cores' FP8 accumulator is narrower than fp32 between
    # the 128-K promotions (measured 1.2e-4); bf16 products accumulate in fp32.
    assert y.dtype == torch.float32 and rel_err(y, ref) < (1e-3 if fmt == "fp8" else 1e-4)
    with pytest.raises(ValueError, match="grouped"):
        lpmoe.grouped_gemm(a, b, kind="fprop", out_dtype=torch.float32, backend="grouped")


def test_auto_backend_with_host_splits_choice():
    """Host splits: the cuBLASLt loop only for FP8 fprop/dgrad of groups
    averaging >= 2048 tokens (multiples of 4); FP8 wgrad stays grouped (lpmoe's
    kernel is at parity with the loop there); 16-bit and small groups grouped."""
    from types import SimpleNamespace
    from lpmoe.gemm.api import _cublas_is_faster

    def ops(kind, splits, fp8=True):
        return SimpleNamespace(kind=kind, m_splits=splits, fp8=fp8)

    big = [4096, 0, 2048]
    assert _cublas_is_faster(ops("fprop", big)) and _cublas_is_faster(ops("dgrad", big))
    assert not _cublas_is_faster(ops("wgrad", big))
    assert not _cublas_is_faster(ops("fprop", big, fp8=False))
    assert not _cublas_is_faster(ops("fprop", [1024, 1024]))
    assert not _cublas_is_faster(ops("fprop", [4098, 4096]))  # cuBLASLt FP8 needs multiples of 4
    assert not _cublas_is_faster(ops("fprop", None))
