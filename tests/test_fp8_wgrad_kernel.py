"""lpmoe's own FP8 block-scaled wgrad kernel (csrc/fp8_gemm/wgrad*):
every tile width and cluster, and the CUTLASS fallback, against the fp64
product of the dequantized columnwise operands, whose scales vary per token
row and per 128-column chunk (a wrong row or column scale cannot hide); fp32
and bf16 outputs, fresh and accumulated; fuzzed member sizes (0, 1, 127,
129, skewed); call counters prove which kernel ran; graph replay with new
routing; no host syncs."""
import pytest
import torch

import lpmoe
from lpmoe import Float8BlockQuantizer
from lpmoe.gemm import CALLS, fp8_kernel_key, fp8_wgrad_kernel_config, reference_grouped_gemm
from lpmoe.gemm.operands import parse_operands

from conftest import FP8_GEMM_SPLITS, assert_replays_match_eager, capture_graph, requires_cuda

Q1 = Float8BlockQuantizer(block_dim=1)
CONFIGS = [(w, c) for w in (128, 192) for c in (1, 2)] + [(-1, 0)]

SPLITS = FP8_GEMM_SPLITS
# (N, K) = (dy's columns, x's columns); "partial" leaves partial row and
# column tiles, "odd_rows" an odd number of 128-row tiles (a cluster's
# second CTA past N).
DIMS = {"aligned": (256, 384), "partial": (400, 272), "odd_rows": (384, 528)}


def _case(splits, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(splits)

    def spread(*shape):  # magnitudes 2^-4 .. 2^4
        return torch.exp2(torch.randint(-4, 5, shape, generator=gen).float())

    def tokens(cols):
        chunks = -(-cols // 128)
        return (torch.randn(rows, cols, generator=gen) * spread(rows, 1)
                * spread(1, chunks).repeat_interleave(128, 1)[:, :cols])

    first = torch.tensor(splits, dtype=torch.int64, device="cuda")
    dy, x = tokens(n).bfloat16().cuda(), tokens(k).bfloat16().cuda()
    dyg = lpmoe.group_quantize(dy, Q1, num_tensors=len(splits), first_dims=first)
    xg = lpmoe.group_quantize(x, Q1, num_tensors=len(splits), first_dims=first)
    return dyg, xg, dy, x


def _reference(dyg, xg, dy, x, splits):
    p = parse_operands(dyg, xg, "wgrad", splits)
    ref = reference_grouped_gemm(p, None, False, None, torch.float64)
    # |dy|^T |x| (of the unquantized values, +10 % for the FP8 rounding)
    # bounds the accumulation error of each element
    dy, x = dy.double().abs(), x.double().abs()
    mag = torch.zeros_like(ref)
    r = 0
    for t, m in enumerate(splits):
        mag[t] = 1.1 * (dy[r:r + m].t() @ x[r:r + m])
        r += m
    return ref, mag


def _assert_close(got, want, mag, bf16):
    # FP8 tensor-core accumulation inside a 128-token block plus the fp32
    # promotion; bf16 adds its output rounding (2^-9 relative).
    bound = 2e-3 * mag + (2.0 ** -8 if bf16 else 1e-6) * want.abs()
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


@requires_cuda
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("split_name", list(SPLITS))
@pytest.mark.parametrize("dims", list(DIMS))
@pytest.mark.parametrize("out", ["fp32", "bf16", "fp32_acc", "bf16_acc"])
def test_gpu_every_wgrad_config_matches_reference(config, split_name, dims, out):
    n, k = DIMS[dims]
    splits = SPLITS[split_name]
    dyg, xg, dy, x = _case(splits, n, k, seed=len(splits) + n)
    ref, mag = _reference(dyg, xg, dy, x, splits)
    bf16 = out.startswith("bf16")
    dtype = torch.bfloat16 if bf16 else torch.float32
    acc = out.endswith("_acc")
    g = len(splits)
    base = (torch.randn(g, n, k, device="cuda") * ref.abs().mean().item()).to(dtype)
    d = base.clone() if acc else torch.full((g, n, k), float("nan"), dtype=dtype, device="cuda")
    key = fp8_kernel_key(*config, kind="wgrad")
    before, tma_before = CALLS.get(key, 0), CALLS.get("fp8_wgrad_bf16_tma_store", 0)
    with fp8_wgrad_kernel_config(*config):
        lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=acc, backend="grouped")
    assert CALLS[key] == before + 1
    # Fresh bf16 output leaves lpmoe's kernel through its TMA-store strips
    # (rows past N and columns past K clipped by the map); accumulation and
    # fp32 take the other epilogues.
    tma = out == "bf16" and config[0] > 0
    assert CALLS.get("fp8_wgrad_bf16_tma_store", 0) == tma_before + int(tma)
    for t, m in enumerate(splits):
        if m == 0:  # empty member: zeros, or the accumulator untouched
            assert torch.equal(d[t], base[t]) if acc else bool((d[t] == 0).all())
    start = base.double() if acc else 0.0
    _assert_close(d, ref + start, mag + (base.double().abs() * 2.0 ** -8 if acc else 0.0), bf16)


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_wgrad_configs_agree_bitwise(out_dtype):
    """The same per-element sums in the same token order: widths and clusters
    differ only in tiling, so their outputs (fp32, and bf16 rounded once from
    them) are identical."""
    splits = [300, 0, 77, 512]
    dyg, xg, _, _ = _case(splits, 512, 640, seed=5)
    outs = []
    for config in CONFIGS[:-1]:
        with fp8_wgrad_kernel_config(*config):
            outs.append(lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=out_dtype, backend="grouped"))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@requires_cuda
def test_gpu_wgrad_two_kblock_tiles_many_per_cta():
    """Members of 256 tokens give tiles of 2 K-blocks with the math
    warpgroups half a tile apart (lead 1), dozens of tiles per CTA: the case
    where a ring that does not restart each tile at stage 0 let warpgroup 0
    reach a later tile's lead arrival early and hung (stop 55's continuous
    ring, docs/grouped-mlp-notes.md).  Every configuration, fresh fp32 and
    accumulated, agrees bitwise.  A kernel that breaks the lead invariant
    hangs here rather than failing (checked on the H100: the continuous-ring
    build hung in this test until killed after 45 s)."""
    splits = [256] * 31 + [512]
    dyg, xg, _, _ = _case(splits, 1024, 2048, seed=31)
    old = torch.randn(len(splits), 1024, 2048, device="cuda")
    fresh, acc = [], []
    for config in CONFIGS[:-1]:
        with fp8_wgrad_kernel_config(*config):
            fresh.append(lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped"))
            d = old.clone()
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=True, backend="grouped")
            acc.append(d)
    for f, a in zip(fresh, acc):
        assert torch.equal(f, fresh[0])
        assert torch.equal(a, old + fresh[0])


def _tile_counter(g):
    """The wgrad kernel's tile counter (csrc/fp8_gemm/tile_feed.cuh): in the
    wgrad workspace right after the 128-byte aligned per-member maps."""
    from lpmoe.gemm.workspaces import gemm_workspace, slot_for_kind
    ws = gemm_workspace(torch.device("cuda"), slot_for_kind("wgrad"))
    off = (-ws.data_ptr()) % 128 + 2 * g * 128
    return int(ws[off:off + 4].view(torch.int32).item())


@requires_cuda
@pytest.mark.parametrize("splits,dynamic", [
    ([4096] + [256] * 28 + [0, 1, 127], True),  # long member first, short ones, an empty and 1-token member
    ([512] * 32, True),
    ([2048] * 8, False),
    ([1025] * 8, True),  # the rule's edge: capacity 1025 + 127 = 1152 tokens per member
    ([1026] * 8, False),
], ids=["skewed", "uniform", "long", "edge_1025", "edge_1026"])
def test_gpu_wgrad_dynamic_tile_feed(splits, dynamic):
    """The main_grad kernels of cluster 1 take their tiles from a global
    counter where members average at most 1024 tokens (heuristics.h; 5-31
    tiles per CTA here; skewed: one long member's tiles, then short
    members', an empty one and a 1-token one): the counter ends at the tile
    count after every call (every CTA claims once per tile after its first,
    plus once past the end: this shows which kernel ran and that the map
    launch reset the counter), and the accumulated result equals the
    round-robin cluster-2 kernel's bitwise (a tile skipped would leave old
    values, one done twice would add twice).  Longer members, fresh outputs
    and cluster 2 keep the round-robin (the counter stays 0), and their
    NaN-poisoned outputs agree bitwise too."""
    g, n, k = len(splits), 1024, 2048
    dyg, xg, _, _ = _case(splits, n, k, seed=56)
    old = torch.randn(g, n, k, device="cuda")
    results = {}
    for config in ((192, 2), (128, 2), (192, 1), (128, 1)):
        tiles = -(-n // (128 * config[1])) * -(-k // config[0]) * g
        with fp8_wgrad_kernel_config(*config):
            for out in ("fp32", "bf16", "acc"):
                for _ in range(2):  # a second call starts the counter over
                    if out == "acc":
                        d = old.clone()
                    else:
                        d = torch.full((g, n, k), float("nan"), device="cuda",
                                       dtype=torch.float32 if out == "fp32" else torch.bfloat16)
                    lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=out == "acc", backend="grouped")
                    counted = dynamic and config[1] == 1 and out == "acc"
                    assert _tile_counter(g) == (tiles if counted else 0), (config, out)
                    if config != (192, 2):
                        assert torch.equal(d, results[(192, 2), out]), (config, out)
                results[config, out] = d
    assert not bool(results[(192, 2), "fp32"].isnan().any())
    assert torch.equal(results[(192, 2), "acc"], old + results[(192, 2), "fp32"])


@requires_cuda
def test_gpu_wgrad_dynamic_tile_feed_graph_replay():
    """The counter kernel in a CUDA graph with new routing per replay, ~21
    tiles per CTA: the captured map launch zeroes the counter on every
    replay (left at the last replay's end, it would hand out no tile past
    each CTA's first), so each replay's main_grad accumulation equals an
    eager call bitwise and the counter ends at the tile count."""
    g, n, k, rows = 32, 1024, 2048, 16384
    tiles = (n // 128) * -(-k // 192) * g
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    x = torch.randn(rows, k, device="cuda").bfloat16()
    m = torch.tensor([512] * g, device="cuda")
    base = torch.randn(g, n, k, device="cuda")
    main_grad = torch.empty_like(base)

    def step():
        dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=m)
        xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=m)
        main_grad.copy_(base)
        with fp8_wgrad_kernel_config(192, 1):
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=main_grad, accumulate=True, backend="grouped")
        return main_grad.clone()

    graph, static = capture_graph(step)
    for splits in ([512] * g, [8192] + [256] * (g - 1), [0, 1, 127] + [500] * (g - 3)):
        m.copy_(torch.tensor(splits))
        dy.copy_(torch.randn_like(dy))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _tile_counter(g) == tiles
        assert torch.equal(static, step())


@requires_cuda
@pytest.mark.parametrize("config", CONFIGS[:-1])
def test_gpu_wgrad_bf16_tma_store_is_the_fp32_result_rounded(config):
    """The TMA-store bf16 epilogue writes exactly the fp32 epilogue's values
    rounded to nearest once: many tiles per CTA, members of 0, 1, 127 and
    512 tokens, partial row and column tiles, 1000 mostly empty members
    (past the member table the width-192 kernel had before its strips)."""
    for splits, n, k in (([512, 0, 1, 127, 640, 0, 300] * 6, 400, 528), ([0] * 990 + [1, 127, 3, 0, 512] * 2, 128, 384)):
        dyg, xg, _, _ = _case(splits, n, k, seed=len(splits))
        key = fp8_kernel_key(*config, kind="wgrad")
        before, tma_before = CALLS.get(key, 0), CALLS.get("fp8_wgrad_bf16_tma_store", 0)
        with fp8_wgrad_kernel_config(*config):
            d32 = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")
            d16 = torch.full((len(splits), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d16, backend="grouped")
        assert CALLS[key] == before + 2 and CALLS["fp8_wgrad_bf16_tma_store"] == tma_before + 1
        assert torch.equal(d16, d32.to(torch.bfloat16))


@requires_cuda
@pytest.mark.parametrize("config", CONFIGS[:-1])
def test_gpu_wgrad_accumulation_is_one_fp32_add_bitwise(config):
    """Accumulating into fp32 gives exactly old + the fresh fp32 result (one
    fp32 add per element), on shapes with thousands of tiles per call:
    members of 0, 7 and 4096 tokens at DeepSeek-V3 fc1's N x K, and 32 of 512
    tokens with a partial last column tile.  The tolerance test above cannot
    see a K-block read with the next one's column scales (stop 54's race
    moved a few whole columns by ~1e-1 relative, every run somewhere else);
    this one fails on a single wrong bit.  Three calls, since a race may
    miss one.  Members of 384, 768 and 1152 tokens fill whole turns of the
    width-192 main_grad kernel's 3-stage ring, where the last K-block's
    stage is released after the walk with no padding slot before it.  (Its first shape is close to the one that went wrong in all
    16 unfenced width-192 cluster-1 runs of stop 54's probe; the test was
    written after that fix, and has passed on the H100 with the one that
    replaced it, the release one K-block later.)"""
    for splits, n, k in (([7, 0, 4096], 4096, 7168), ([512] * 32, 256, 2080), ([384, 768, 0, 1152, 130], 512, 2080)):
        dyg, xg, _, _ = _case(splits, n, k, seed=len(splits))
        with fp8_wgrad_kernel_config(*config):
            fresh = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")
            old = torch.randn(len(splits), n, k, device="cuda")
            want = old + fresh
            for _ in range(3):
                d = old.clone()
                lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=True, backend="grouped")
                assert torch.equal(d, want)


@requires_cuda
@pytest.mark.parametrize("acc", [False, True])
def test_gpu_wgrad_no_tokens_at_all(acc):
    """Zero token rows in every member: a fresh output becomes zeros, an
    accumulated one stays as it was, through lpmoe's kernel."""
    g, n, k = 3, 256, 384
    first = torch.zeros(g, dtype=torch.int64, device="cuda")
    dyg = lpmoe.group_quantize(torch.empty(0, n, device="cuda").bfloat16(), Q1, num_tensors=g, first_dims=first)
    xg = lpmoe.group_quantize(torch.empty(0, k, device="cuda").bfloat16(), Q1, num_tensors=g, first_dims=first)
    base = torch.randn(g, n, k, device="cuda")
    d = base.clone() if acc else torch.full((g, n, k), float("nan"), device="cuda")
    from lpmoe._ext import ext
    key = fp8_kernel_key(*ext().fp8_wgrad_choice(n, k), kind="wgrad")
    before = CALLS.get(key, 0)
    lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=acc, backend="grouped")
    assert CALLS[key] == before + 1
    assert torch.equal(d, base) if acc else bool((d == 0).all())


@requires_cuda
def test_gpu_wgrad_group_count_limits():
    """Past the width-192 member table (3311 groups) the automatic choice
    takes width 128 (7403); past that the CUTLASS kernel runs; a pinned width
    whose table is too small is refused clearly."""
    n, k = 128, 384  # the cost model prefers 192 here
    from lpmoe._ext import ext
    assert tuple(ext().fp8_wgrad_choice(n, k)) == (192, 1)
    for g, key in ((3400, fp8_kernel_key(128, 1, kind="wgrad")), (7500, "fp8_cutlass")):
        splits = [0] * g
        for t in range(0, g, g // 7):
            splits[t] = 3 + t % 130
        dyg, xg, dy, x = _case(splits, n, k, seed=g)
        before = CALLS.get(key, 0)
        d = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")
        assert CALLS[key] == before + 1
        used = [t for t, m in enumerate(splits) if m]
        ref, mag = _reference(dyg, xg, dy, x, splits)
        _assert_close(d[used], ref[used], mag[used], False)
        assert bool((d[[t for t, m in enumerate(splits) if not m]] == 0).all())
    with pytest.raises(ValueError, match=r"wgrad kernel config \(width 192, cluster 1\) does not exist in this build "
                                         r"for 3400 groups"):
        with fp8_wgrad_kernel_config(192, 1):
            dyg, xg, _, _ = _case([1] * 3400, n, k, seed=1)
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")


@requires_cuda
def test_gpu_wgrad_main_grad_kernels_group_limit():
    """The main_grad (fp32 accumulate) kernels stage a warp's whole fp32
    strip, which leaves their width-192 member table 1567 groups (3311 for
    the others): at 1600 groups fresh output still runs width 192,
    accumulation takes width 128 and adds exactly the fresh result, and
    pinning width 192 for it is refused clearly."""
    n, k, g = 128, 384, 1600
    splits = [0] * g
    for t in range(0, g, g // 7):
        splits[t] = 3 + t % 130
    dyg, xg, _, _ = _case(splits, n, k, seed=g)
    k192, k128 = fp8_kernel_key(192, 1, kind="wgrad"), fp8_kernel_key(128, 1, kind="wgrad")
    before = CALLS.get(k192, 0)
    fresh = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")
    assert CALLS[k192] == before + 1
    old = torch.randn(g, n, k, device="cuda")
    d = old.clone()
    before = CALLS.get(k128, 0)
    lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=True, backend="grouped")
    assert CALLS[k128] == before + 1
    assert torch.equal(d, old + fresh)
    with pytest.raises(ValueError, match=r"wgrad kernel config \(width 192, cluster 1\) does not exist in this build "
                                         r"for 1600 groups"):
        with fp8_wgrad_kernel_config(192, 1):
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=old.clone(), accumulate=True, backend="grouped")
    # Pinning only the cluster leaves the width to the kernel's choice.
    d = old.clone()
    before = CALLS.get(k128, 0)
    with fp8_wgrad_kernel_config(0, 1):
        lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=d, accumulate=True, backend="grouped")
    assert CALLS[k128] == before + 1
    assert torch.equal(d, old + fresh)


def test_wgrad_heuristic_choices():
    from lpmoe._ext import ext
    # cluster 1 everywhere (ahead of cluster 2 on 8-group shapes, within noise elsewhere);
    # the width by the cost model over K
    assert tuple(ext().fp8_wgrad_choice(4096, 7168)) == (192, 1)  # DeepSeek-V3 fc1
    assert tuple(ext().fp8_wgrad_choice(7168, 2048)) == (192, 1)  # fc2
    assert tuple(ext().fp8_wgrad_choice(128, 1024)) == (128, 1)  # 8 x 128 columns beat 6 x 192
    assert tuple(ext().fp8_wgrad_choice(1536, 256)) == (128, 1)
    with pytest.raises(RuntimeError, match="n >= 1 and k >= 1"):
        ext().fp8_wgrad_choice(0, 128)


def test_wgrad_forced_config_errors_clearly():
    for bad in ((160, 0), (128, 3)):
        with pytest.raises(ValueError, match="fp8_wgrad_kernel_config: width must be"):
            with fp8_wgrad_kernel_config(*bad):
                pass
    from lpmoe._ext import ext
    a = torch.zeros(16, dtype=torch.uint8)
    offs = torch.zeros(3, dtype=torch.long)
    # a width only the fprop/dgrad kernel has is refused for wgrad (kind 2) before any device check
    with pytest.raises(ValueError, match=r"FP8 wgrad kernel config \(width 160, cluster 1\)"):
        ext().grouped_gemm_cutlass(2, 2, a, None, a, None, 0, None, 0, a, offs, 2, 16, 16, 0.0, a, a, 160, 1, False)


@requires_cuda
@pytest.mark.parametrize("config", [(128, 1), (192, 2), (0, 0)])
def test_gpu_wgrad_graph_replay_new_routing_and_no_sync(config):
    g, n, k, rows = 5, 384, 512, 1200
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    x = torch.randn(rows, k, device="cuda").bfloat16()
    m = torch.tensor([240] * 5, device="cuda")
    main_grad = torch.zeros(g, n, k, device="cuda")

    def step():
        dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=m)
        xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=m)
        with fp8_wgrad_kernel_config(*config):
            fresh = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.float32, backend="grouped")
            bf = lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out_dtype=torch.bfloat16, backend="grouped")
            main_grad.zero_()
            lpmoe.grouped_gemm(dyg, xg, kind="wgrad", out=main_grad, accumulate=True, backend="grouped")
        return fresh, bf, main_grad.clone()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        from lpmoe._ext import ext
        key = fp8_kernel_key(*(config if config[0] else ext().fp8_wgrad_choice(n, k)), kind="wgrad")
        before = CALLS.get(key, 0)
        step()
        assert CALLS[key] == before + 3
    finally:
        torch.cuda.set_sync_debug_mode(0)
    routings = ([0, 1, 1198, 0, 1], [129, 127, 0, 900, 44], [1200, 0, 0, 0, 0])
    _, static = assert_replays_match_eager(step, m, routings, (x, dy))
    splits = routings[-1]
    dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=m)
    xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=m)
    ref, mag = _reference(dyg, xg, dy, x, splits)
    _assert_close(static[0], ref, mag, False)
    _assert_close(static[2], ref, mag, False)
