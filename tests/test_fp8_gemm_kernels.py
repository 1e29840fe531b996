"""lpmoe's own FP8 block-scaled grouped kernel (csrc/fp8_gemm, fprop/dgrad):
every tile width and the CUTLASS fallback against the fp64 product of the
dequantized operands, on operands whose scales vary per row, per 128-column
chunk and per 128x128 weight block (a wrong scale pick cannot hide), with
fuzzed group sizes; call counters prove which kernel ran; the heuristic's
choices are each exercised through the automatic path; graph replay with new
routing; no host syncs."""
import pytest
import torch

import lpmoe
from lpmoe import Float8BlockQuantizer
from lpmoe.gemm import CALLS, fp8_kernel_config, fp8_kernel_key, reference_grouped_gemm
from lpmoe.gemm.operands import parse_operands

from conftest import FP8_GEMM_SPLITS, assert_replays_match_eager, requires_cuda

Q1 = Float8BlockQuantizer(block_dim=1)
Q2 = Float8BlockQuantizer(block_dim=2)
WIDTHS = (128, 160, 192)
CONFIGS = [(w, c) for w in WIDTHS for c in (1, 2)] + [(-1, 0)]

SPLITS = FP8_GEMM_SPLITS
DIMS = {"aligned": (256, 384), "partial": (400, 272), "wide": (1024, 528)}


def _scaled_case(splits, k, n, seed, tail=5):
    """FP8 operands with strongly varying block magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    rows, g = sum(splits) + tail, len(splits)
    chunk_k, chunk_n = -(-k // 128), -(-n // 128)

    def spread(*shape):  # magnitudes 2^-4 .. 2^4
        return torch.exp2(torch.randint(-4, 5, shape, generator=gen).float())

    x = torch.randn(rows, k, generator=gen) * spread(rows, 1) * spread(1, chunk_k).repeat_interleave(128, 1)[:, :k]
    dy = torch.randn(rows, n, generator=gen) * spread(rows, 1) * spread(1, chunk_n).repeat_interleave(128, 1)[:, :n]
    wb = spread(g, chunk_n, chunk_k).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    w = torch.randn(g, n, k, generator=gen) * 0.05 * wb
    first = torch.tensor(splits, dtype=torch.int64, device="cuda")
    xg = lpmoe.group_quantize(x.bfloat16().cuda(), Q1, num_tensors=g, first_dims=first)
    dyg = lpmoe.group_quantize(dy.bfloat16().cuda(), Q1, num_tensors=g, first_dims=first)
    wg = lpmoe.group_quantize(w.bfloat16().cuda().view(g * n, k), Q2, num_tensors=g)
    return {"fprop": (xg, wg), "dgrad": (dyg, wg)}


def _check(out, a, b, kind, splits):
    ref = reference_grouped_gemm(parse_operands(a, b, kind, splits), None, False, None, torch.float64)
    used = sum(splits)
    got, ref = out[:used].double(), ref[:used]
    err = (got - ref).abs()
    # bf16 output rounding (2^-9 relative) plus the FP8 tensor-core
    # accumulator between promotions; the row-mean term covers cancellation
    # (rows differ in magnitude by up to 2^8).
    bound = 1e-2 * ref.abs() + 1e-2 * ref.abs().mean(dim=1, keepdim=True)
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"
    assert torch.isnan(out[used:].float()).all()  # caller's tail untouched


@requires_cuda
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
@pytest.mark.parametrize("split_name", list(SPLITS))
@pytest.mark.parametrize("dims", list(DIMS))
def test_gpu_every_config_matches_reference(config, kind, split_name, dims):
    k, n = DIMS[dims]
    splits = SPLITS[split_name]
    a, b = _scaled_case(splits, k, n, seed=len(splits) + k)[kind]
    cols = n if kind == "fprop" else k
    out = torch.full((a.logical_shape[0], cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    key = fp8_kernel_key(*config)
    before = CALLS.get(key, 0)
    with fp8_kernel_config(*config):
        lpmoe.grouped_gemm(a, b, kind=kind, out=out, backend="grouped")
    assert CALLS[key] == before + 1
    _check(out, a, b, kind, splits)


@requires_cuda
def test_gpu_all_widths_agree_closely():
    """Same sums in the same K order: the widths differ only in tiling, so
    their outputs agree to the bf16 rounding of the result."""
    splits = [300, 0, 77, 512]
    a, b = _scaled_case(splits, 768, 1024, seed=3)["fprop"]
    outs = []
    for config in CONFIGS[:-1]:
        with fp8_kernel_config(*config):
            outs.append(lpmoe.grouped_gemm(a, b, kind="fprop", backend="grouped").float())
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def _choices(sm_count):
    """First (rows, groups, cols) on which the heuristic picks each
    configuration."""
    from lpmoe._ext import ext
    found = {}
    for g in (16, 32, 64):
        for per_group in (32, 64, 128, 256, 4096):
            for cols in (256, 384, 512, 640, 768, 1024, 1280, 1536):
                found.setdefault(tuple(ext().fp8_block_scaled_choice(per_group * g, g, cols, sm_count)),
                                 (per_group * g, g, cols))
    return found


def test_heuristic_choices_and_validation():
    from lpmoe._ext import ext
    found = _choices(132)
    # every width; cluster 1 on groups of <= 128 rows on average, cluster 2
    # (weight-tile multicast) on larger ones; the CUTLASS kernel is never the
    # heuristic's pick (the binding falls back to it where lpmoe's cannot run)
    assert set(found) == {(w, c) for w in (128, 160, 192) for c in (1, 2)}, sorted(found)
    for (w, c), (rows, g, _) in found.items():
        assert (c == 2) == (rows > 128 * g)
    assert tuple(ext().fp8_block_scaled_choice(8 * 4096, 8, 4096, 132)) == (192, 2)  # the anchor shape
    with pytest.raises(RuntimeError, match="num_groups >= 1"):
        ext().fp8_block_scaled_choice(128, 0, 128, 132)


@requires_cuda
def test_gpu_heuristic_choices_run_through_auto():
    """Shapes on which the heuristic picks each width; the automatic path
    must run exactly that kernel and be right."""
    found = _choices(torch.cuda.get_device_properties(0).multi_processor_count)
    assert {c for _, c in found} == {1, 2} and len(found) > 2
    for config, (rows, g, cols) in sorted(found.items()):
        splits = [rows // g] * g
        splits[0] -= 3
        splits[1] += 3
        a, b = _scaled_case(splits, 256, cols, seed=config[0], tail=0)["fprop"]
        out = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
        key = fp8_kernel_key(*config)
        before = CALLS.get(key, 0)
        lpmoe.grouped_gemm(a, b, kind="fprop", out=out)
        assert CALLS[key] == before + 1
        _check(out, a, b, "fprop", splits)


def test_forced_config_errors_clearly():
    for bad in ((96, 0), (128, 4), (0, 3)):
        with pytest.raises(ValueError, match="fp8_kernel_config: width must be"):
            with fp8_kernel_config(*bad):
                pass
    with pytest.raises(TypeError, match="width must be an int"):
        with fp8_kernel_config("wide"):
            pass


def test_binding_rejects_unknown_config_before_any_work():
    """The C++ layer checks a pinned configuration first (CPU operands: the
    configuration error must come before the device checks)."""
    from lpmoe._ext import ext
    a = torch.zeros(16, dtype=torch.uint8)
    offs = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"config \(width 96, cluster 0\)"):
        ext().grouped_gemm_cutlass(0, 2, a, None, a, None, 0, None, 0, a, offs, 2, 16, 16, 0.0, a, a, 96, 0, False)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        ext().grouped_gemm_cutlass(0, 2, a, None, a, None, 0, None, 0, a, offs, 2, 16, 16, 0.0, a, a, 192, 2, False)


@requires_cuda
@pytest.mark.parametrize("config", CONFIGS[:-1])
def test_gpu_graph_replay_new_routing_and_no_sync(config):
    g, k, n, rows = 5, 512, 640, 1200
    x = torch.randn(rows, k, device="cuda").bfloat16()
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    w = (torch.randn(g * n, k, device="cuda") * 0.05).bfloat16()
    m = torch.tensor([240] * 5, device="cuda")

    def step():
        xg = lpmoe.group_quantize(x, Q1, num_tensors=g, first_dims=m)
        dyg = lpmoe.group_quantize(dy, Q1, num_tensors=g, first_dims=m)
        wg = lpmoe.group_quantize(w, Q2, num_tensors=g)
        with fp8_kernel_config(*config):
            return (lpmoe.grouped_gemm(xg, wg, kind="fprop", backend="grouped"),
                    lpmoe.grouped_gemm(dyg, wg, kind="dgrad", backend="grouped"))

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        key = fp8_kernel_key(*config)
        before = CALLS.get(key, 0)
        step()
        assert CALLS[key] == before + 2
    finally:
        torch.cuda.set_sync_debug_mode(0)
    routings = ([0, 1, 1198, 0, 1], [129, 127, 0, 900, 44], [1200, 0, 0, 0, 0])
    assert_replays_match_eager(step, m, routings, (x, dy))
