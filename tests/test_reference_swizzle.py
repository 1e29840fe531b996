"""GEMM scale swizzle (formats.md §2.3)."""
import pytest
import torch

from lpmoe.reference.swizzle import swizzle_scales, swizzled_index, unswizzle_scales


def closed_formula(i, j, cols):
    return ((i // 128) * (cols // 4) + j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4


def test_swizzled_index_hand_values():
    assert swizzled_index(0, 0, 4) == 0
    assert swizzled_index(0, 1, 4) == 1
    assert swizzled_index(1, 0, 4) == 16
    assert swizzled_index(32, 0, 4) == 4
    assert swizzled_index(96, 3, 4) == 15
    assert swizzled_index(127, 3, 4) == 511
    assert swizzled_index(0, 4, 8) == 512
    assert swizzled_index(128, 0, 8) == 1024
    assert swizzled_index(129, 5, 8) == 1024 + 512 + 16 + 1


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (384, 12), (128, 16), (0, 4), (128, 0)])
def test_swizzle_matches_closed_formula_for_every_element(rows, cols):
    s = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)
    out = swizzle_scales(s)
    assert out.shape == (rows * cols,)
    i = torch.arange(rows).unsqueeze(1).expand(rows, cols)
    j = torch.arange(cols).unsqueeze(0).expand(rows, cols)
    idx = swizzled_index(i, j, cols)
    assert torch.equal(idx, closed_formula(i, j, cols))
    # a permutation, and entry (i, j) lands at swz(i, j)
    assert torch.equal(torch.sort(idx.reshape(-1)).values, torch.arange(rows * cols))
    assert torch.equal(out[idx.reshape(-1)], s.reshape(-1))
    assert torch.equal(unswizzle_scales(out, rows, cols), s)


def test_swizzle_keeps_bytes_for_e8m0_and_fp8():
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (256, 8), dtype=torch.uint8, generator=g)
    for t in (raw, raw.view(torch.float8_e4m3fn)):
        out = swizzle_scales(t)
        assert out.dtype == t.dtype
        back = unswizzle_scales(out, 256, 8)
        assert back.dtype == t.dtype
        assert torch.equal(back.view(torch.uint8), raw)
        assert out.view(torch.uint8)[closed_formula(129, 5, 8)].item() == raw[129, 5].item()


def test_swizzle_argument_validation():
    with pytest.raises(ValueError, match="s must be padded"):
        swizzle_scales(torch.zeros(127, 4))
    with pytest.raises(ValueError, match="s must be padded"):
        swizzle_scales(torch.zeros(128, 6))
    with pytest.raises(ValueError, match="s must be a 2-D"):
        swizzle_scales(torch.zeros(512))
    with pytest.raises(ValueError, match="flat has"):
        unswizzle_scales(torch.zeros(500), 128, 4)
    with pytest.raises(ValueError, match="padded"):
        unswizzle_scales(torch.zeros(520), 130, 4)
    with pytest.raises(ValueError, match="1-D"):
        unswizzle_scales(torch.zeros(128, 4), 128, 4)
