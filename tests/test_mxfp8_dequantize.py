"""The MXFP8 dequantize's two kernels (csrc/mxfp8/dequant_tile.cuh): which
one a call takes (launch counters, so a silent fallback fails), and the
TMA-store tiles bit-exact against the CPU reference with a poisoned output
whose capacity tail must stay untouched."""
import pytest
import torch

import lpmoe
from conftest import (assert_written_then_poisoned, launches_since, only, poison_, poison_allocator, requires_cuda,
                      same_bits)
from lpmoe import MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
STORES, TMA = range(2)


def _launches():
    from lpmoe._ext import ext
    return ext().mxfp8_dequantize_kernel_launches()  # (16-byte stores, TMA-store tiles)


def _quantized_pair(x, q, **kw):
    """(CPU, GPU) group_quantize of x with the same random scale bytes
    (every value, 0 / 254 / 255 included) in the direction q writes."""
    ref = lpmoe.group_quantize(x, q, **kw)
    got = lpmoe.group_quantize(x.cuda(), q, **{k: (v.cuda() if isinstance(v, torch.Tensor) else v)
                                               for k, v in kw.items()})
    name = "scale_inv" if q.rowwise else "columnwise_scale_inv"
    sc = torch.randint(0, 256, (getattr(ref, name).numel(),), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(5))
    sc[:3] = torch.tensor([0, 254, 255], dtype=torch.uint8)
    getattr(ref, name).copy_(sc)
    getattr(got, name).copy_(sc.cuda())
    return ref, got


@requires_cuda
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capacity_extra", [0, 77])
def test_gpu_whole_tiles_through_tma_stores(columnwise, fp8, out_dtype, capacity_extra):
    # Members of whole 128-row tiles (bulk tensor stores) and partial last
    # tiles (16-byte stores, which must not spill into the next member), an
    # empty member, a partial last K tile (272 = 2 x 128 + 16) that the unit
    # clips, and a capacity tail whose poisoned bytes must survive.
    splits = [256, 0, 93, 128, 384, 1]
    k = 272
    rows = sum(splits) + capacity_extra
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, k, generator=g) * torch.exp(2 * torch.randn(rows, k, generator=g))).to(torch.bfloat16)
    q = MXFP8Quantizer(fp8, rowwise=not columnwise, columnwise=columnwise, swizzled_scales=True)
    ref, got = _quantized_pair(x, q, num_tensors=len(splits), first_dims=torch.tensor(splits))
    from lpmoe import mx_ops
    from lpmoe._ext import ext
    data = got.columnwise_data if columnwise else got.rowwise_data
    scale = got.columnwise_scale_inv if columnwise else got.scale_inv
    out = poison_(torch.empty(rows * k, dtype=out_dtype, device="cuda"))
    before = _launches()
    ext().mxfp8_dequantize(data, scale, columnwise, True, fp8 == E5M2, *mx_ops._members(got), rows, k, out,
                           mx_ops._num_tiles(got))
    torch.cuda.synchronize()
    assert launches_since(before, _launches()) == only(TMA, 2)
    n = sum(splits) * k
    assert_written_then_poisoned(lpmoe.group_dequantize(ref, out_dtype).rowwise_data[:n], out, n)


@requires_cuda
@pytest.mark.parametrize("kind,out_dtype,kernel", [
    ("first", torch.bfloat16, TMA), ("first", torch.float16, TMA), ("first", torch.float32, STORES),
    ("single", torch.bfloat16, TMA), ("both", torch.bfloat16, STORES), ("last", torch.float16, STORES)])
def test_gpu_kernel_choice(kind, out_dtype, kernel):
    # 16-bit outputs of the rows layout (common K) take the TMA-store tiles;
    # fp32 outputs (a 64 KB tile) and members of varying K (no one matrix
    # for a tensor map) keep the 16-byte stores.  Same bits either way; the
    # allocator's free blocks hold 0xFF (NaN) bytes, so an element left
    # unwritten differs from the reference.
    poison_allocator()
    q = MXFP8Quantizer(E4M3, swizzled_scales=False)
    x = torch.randn(384, 256).to(torch.bfloat16)
    if kind == "single":
        ref, got = lpmoe.quantize(x, q), lpmoe.quantize(x.cuda(), q)
        before = _launches()
        y = lpmoe.dequantize(got, out_dtype)
        torch.cuda.synchronize()
        assert launches_since(before, _launches()) == only(kernel, 2)
        assert same_bits(lpmoe.dequantize(ref, out_dtype), y)
        return
    kw = {"first": dict(num_tensors=3, first_dims=torch.tensor([128, 200, 56])),
          "both": dict(num_tensors=2, first_dims=torch.tensor([128, 256]), last_dims=torch.tensor([256, 128])),
          "last": dict(num_tensors=2, last_dims=torch.tensor([128, 128]))}[kind]
    if kind == "both":
        x = torch.randn(128 * 256 + 256 * 128).to(torch.bfloat16)
    ref, got = _quantized_pair(x, q, **kw)
    before = _launches()
    y = lpmoe.group_dequantize(got, out_dtype)
    torch.cuda.synchronize()
    assert launches_since(before, _launches()) == only(kernel, 2)
    for a, b in zip(lpmoe.group_dequantize(ref, out_dtype).split(), y.split()):
        assert same_bits(a, b)
