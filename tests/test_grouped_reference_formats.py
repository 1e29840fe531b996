"""Grouped reference layouts of MXFP8 and NVFP4 (CPU): every member's buffers
are that member's single-tensor buffers, concatenated in member order."""
import pytest
import torch

import lpmoe
from lpmoe import GroupedTensor, MXFP8Quantizer, NVFP4Quantizer
from lpmoe.reference import quantize_mxfp8, quantize_nvfp4


def _u8(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("splits,k", [([128, 0, 256], 160), ([32, 96, 0, 17], 64)])
def test_mxfp8_grouped_reference_is_concatenation(splits, k, swizzled):
    q = MXFP8Quantizer("e4m3", swizzled_scales=swizzled)
    x = torch.randn(sum(splits) + 9, k) * 3  # 9-row capacity tail
    g = lpmoe.group_quantize(x, q, len(splits), first_dims=torch.tensor(splits))
    assert g.with_gemm_swizzled_scales == swizzled
    row = 0
    for m, view in zip(splits, g.split()):
        if m:
            ref = quantize_mxfp8(x[row:row + m], torch.float8_e4m3fn, True, True, swizzled)
            for a, b in (("rowwise_data", ref.data), ("scale_inv", ref.scale_inv),
                         ("columnwise_data", ref.columnwise_data), ("columnwise_scale_inv", ref.columnwise_scale_inv)):
                assert torch.equal(_u8(view[a]), _u8(b)), a
        row += m


def test_nvfp4_grouped_reference_is_concatenation():
    q = NVFP4Quantizer()
    splits = [32, 0, 64]
    x = torch.randn(96, 64)
    x[40, 3] = 100.0  # a member-local amax: each member has its own global scale
    g = lpmoe.group_quantize(x, q, 3, first_dims=torch.tensor(splits))
    row = 0
    for m, view in zip(splits, g.split()):
        if m:
            ref = quantize_nvfp4(x[row:row + m])
            assert torch.equal(view["amax"], ref.amax)
            for a, b in (("rowwise_data", ref.data), ("scale_inv", ref.scale_inv),
                         ("columnwise_data", ref.columnwise_data), ("columnwise_scale_inv", ref.columnwise_scale_inv)):
                assert torch.equal(_u8(view[a]), _u8(b)), a
        row += m
    y = lpmoe.group_dequantize(g, torch.float32)
    assert [tuple(t.shape) for t in y.split()] == [(32, 64), (0, 64), (64, 64)]
