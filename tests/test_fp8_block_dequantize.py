"""FP8 block dequantize kernels: which kernel reads which source, and their
bits against the CPU reference on every FP8 code.

The columnwise (transposed) source has three GPU readers
(csrc/fp8_block/dequant_columns.cuh): the staged tile (two token tiles per
CTA through shared memory) wherever every K row of a tile holds 128 token
bytes, whose bf16 / fp16 output leaves through TMA stores of whole token
tiles (a member's partial last tile, and every fp32 output, by 16-byte
stores), and the register tile elsewhere.  Each call's kernel is counted, so a
silent switch to another one fails here.
"""
import pytest
import torch

import lpmoe
from conftest import (assert_written_then_poisoned, capture_graph, launches_since, only, poison_, poison_allocator,
                      requires_cuda, same_bits)
from lpmoe import Float8BlockQuantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _launches():
    from lpmoe._ext import ext
    # (rows, columns staged with 16-byte stores, columns registers, columns staged with TMA stores)
    return ext().fp8_block_dequantize_kernel_launches()


ROWS, STAGED, REGISTERS, STAGED_TMA = range(4)


def _random_codes_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every byte value (NaN, inf for E5M2, subnormals, zeros of both signs)."""
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))


def _random_scales_(t: torch.Tensor, gen: torch.Generator) -> None:
    """Powers of two from subnormal (2^-130) to 2^20, and non-powers."""
    e = torch.randint(-130, 21, t.shape, generator=gen).float()
    m = 1 + torch.rand(t.shape, generator=gen) * (torch.rand(t.shape, generator=gen) < 0.5)
    t.copy_(torch.ldexp(m, e))


def _grouped_pair(splits, k, q, capacity_extra, seed):
    """The same FP8 group on the CPU and the GPU, its columnwise bytes and
    scales replaced by random codes (identical on both)."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(splits) + capacity_extra
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    fd = torch.tensor(splits)
    gc = lpmoe.group_quantize(x, q, len(splits), first_dims=fd)
    gg = lpmoe.group_quantize(x.cuda(), q, len(splits), first_dims=fd.cuda())
    for name, fill in (("columnwise_data", _random_codes_), ("columnwise_scale_inv", _random_scales_)):
        src = getattr(gc, name)
        fill(src, gen)
        getattr(gg, name).copy_(src)
    return gc, gg


@requires_cuda
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_group_dequantize_columns_staged_every_code(fp8, block_dim, out_dtype):
    # 19 token tiles (odd: the last chunk's second tile lies past the last
    # member); chunks whose two tiles belong to different members (1-row,
    # 127-row, empty members); a partial K tile (1040 = 8 x 128 + 16); a
    # capacity tail, whose output rows no kernel may write.
    splits = [0, 1, 127, 128, 129, 255, 0, 300, 1000, 3]
    k = 1040
    q = Float8BlockQuantizer(fp8, block_dim=block_dim, rowwise=False, columnwise=True)
    gc, gg = _grouped_pair(splits, k, q, capacity_extra=77, seed=11 + block_dim)
    poison_allocator()
    before = _launches()
    yg = lpmoe.group_dequantize(gg, out_dtype)
    torch.cuda.synchronize()
    # 16-bit outputs leave through TMA stores (whole token tiles) and 16-byte
    # stores (the members' partial last tiles); fp32 through 16-byte stores.
    kernel = STAGED if out_dtype == torch.float32 else STAGED_TMA
    assert launches_since(before, _launches()) == only(kernel, 4)
    yc = lpmoe.group_dequantize(gc, out_dtype)
    n = sum(splits) * k
    assert same_bits(yc.rowwise_data[:n], yg.rowwise_data[:n])
    # The same launch into a poisoned output of our own: the valid rows
    # equal, the capacity tail's bytes untouched (no TMA box reaches past a
    # member's rows).
    from lpmoe._ext import ext
    from lpmoe._op_utils import max_row_tiles
    rows = gg.logical_shape[0]
    out = poison_(torch.empty(rows * k, dtype=out_dtype, device="cuda"))
    before = _launches()
    ext().fp8_block_dequantize(gg.columnwise_data, gg.columnwise_scale_inv, True, True, fp8 == E5M2, block_dim,
                               rows, k, gg.padded_row_offsets, gg.num_tensors, out, max_row_tiles(gg))
    torch.cuda.synchronize()
    assert launches_since(before, _launches()) == only(kernel, 4)
    assert torch.equal(out[:n].view(torch.uint8), yg.rowwise_data[:n].view(torch.uint8))
    assert bool((out[n:].view(torch.uint8) == 0xA5).all())


@requires_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capacity_extra", [0, 77])
def test_gpu_group_dequantize_whole_tiles_through_tma_stores(out_dtype, capacity_extra):
    # Every member a whole number of token tiles (every tile leaves by a bulk
    # tensor store, none by 16-byte stores), chunks of two tiles from two
    # members, an empty member, a partial last K tile (272 = 2 x 128 + 16)
    # that the unit clips; the last whole tile right before a capacity tail
    # (whose bytes must stay as poisoned), or reaching the output's last row.
    splits = [256, 0, 128, 384, 128]
    k = 272
    q = Float8BlockQuantizer(E4M3, block_dim=1, rowwise=False, columnwise=True)
    gc, gg = _grouped_pair(splits, k, q, capacity_extra=capacity_extra, seed=3)
    from lpmoe._ext import ext
    from lpmoe._op_utils import max_row_tiles
    rows = gg.logical_shape[0]
    out = poison_(torch.empty(rows * k, dtype=out_dtype, device="cuda"))
    before = _launches()
    ext().fp8_block_dequantize(gg.columnwise_data, gg.columnwise_scale_inv, True, True, False, 1, rows, k,
                               gg.padded_row_offsets, gg.num_tensors, out, max_row_tiles(gg))
    torch.cuda.synchronize()
    assert launches_since(before, _launches()) == only(STAGED_TMA, 4)
    n = sum(splits) * k
    assert_written_then_poisoned(lpmoe.group_dequantize(gc, out_dtype).rowwise_data[:n], out, n)


@requires_cuda
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("shape,kernel", [((256, 1040), STAGED_TMA), ((128, 16), STAGED_TMA), ((993, 512), REGISTERS),
                                          ((65, 96), REGISTERS)])
def test_gpu_single_tensor_dequantize_columns_kernel_choice(shape, kernel, block_dim):
    # A single tensor's transposed copy is unpadded: whole 128-row tiles take
    # the staged tile, other row counts the register tile.
    gen = torch.Generator().manual_seed(5)
    q = Float8BlockQuantizer(E4M3, block_dim=block_dim)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    ref = lpmoe.quantize(x, q)
    _random_codes_(ref.columnwise_data, gen)
    _random_scales_(ref.columnwise_scale_inv, gen)
    cols = type(ref)(None, None, ref.columnwise_data, ref.columnwise_scale_inv, ref.fp8_dtype, ref.block_dim)
    cols_gpu = type(ref)(None, None, ref.columnwise_data.cuda(), ref.columnwise_scale_inv.cuda(), ref.fp8_dtype,
                         ref.block_dim)
    poison_allocator()
    before = _launches()
    got = lpmoe.dequantize(cols_gpu, torch.bfloat16)
    torch.cuda.synchronize()
    after = _launches()
    assert launches_since(before, after) == only(kernel, 4)
    assert same_bits(lpmoe.dequantize(cols, torch.bfloat16), got)


@requires_cuda
def test_gpu_group_dequantize_rows_counted():
    q = Float8BlockQuantizer(E4M3, block_dim=1, rowwise=True, columnwise=False)
    x = torch.randn(300, 256).to(torch.bfloat16)
    fd = torch.tensor([100, 0, 200])
    gg = lpmoe.group_quantize(x.cuda(), q, 3, first_dims=fd.cuda())
    before = _launches()
    lpmoe.group_dequantize(gg, torch.bfloat16)
    torch.cuda.synchronize()
    assert launches_since(before, _launches()) == only(ROWS, 4)


@requires_cuda
def test_gpu_group_dequantize_columns_staged_graph_replay_new_splits_no_sync():
    # The staged tile reads the member sizes on the device: capture once,
    # replay with new splits, equal to eager each time, no host sync.
    q = Float8BlockQuantizer(E4M3, block_dim=1, rowwise=False, columnwise=True)
    rows, k, n = 2048, 272, 4
    x = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
    fd = torch.empty(n, device="cuda", dtype=torch.int64)
    x.normal_()
    fd.copy_(torch.tensor([500, 0, 1000, 300]))

    def step():
        g = lpmoe.group_quantize(x, q, n, first_dims=fd)
        return g, lpmoe.group_dequantize(g, torch.bfloat16)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        before = _launches()
        graph, (_, y) = capture_graph(step)
        # the warm-up and the captured call, both the staged tile with TMA stores
        assert launches_since(before, _launches()) == (0, 0, 0, 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for splits in ([1, 127, 129, 1000], [0, 0, 0, 2000], [700, 700, 0, 1]):
        x.normal_()
        fd.copy_(torch.tensor(splits))
        graph.replay()
        torch.cuda.synchronize()
        eager = lpmoe.group_dequantize(lpmoe.group_quantize(x.clone(), q, n, first_dims=fd.clone()), torch.bfloat16)
        m = sum(splits) * k
        assert torch.equal(y.rowwise_data[:m].view(torch.int16), eager.rowwise_data[:m].view(torch.int16))
