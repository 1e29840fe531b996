"""The sigmoid table of the bf16 SwiGLU kernels (csrc/activation/sigmoid_table.cuh,
heuristics.cu): its band against the spec on every bf16 value (CPU), both
kernel variants bit-exact on grouped cases and partial column tiles (GPU).
The every-16-bit-input and the graph-replay tests of tests/test_activation.py
run both variants too."""
import re
from pathlib import Path

import pytest
import torch

import lpmoe
from conftest import requires_cuda
from lpmoe.activation import Activation, kernels
from lpmoe.quantizers import Float8BlockQuantizer
from lpmoe.reference import activation as R
from test_activation import (E4M3, GPU_SPLITS, _assert_same_fp8, _poisoned_empty, _ref_quantized, _splits_case,
                             _table_expected, rand_h, same_bits)

def _table_bound(name):
    src = (Path(__file__).resolve().parents[1] / "csrc/activation/sigmoid_table.cuh").read_text()
    return int(re.search(rf"constexpr uint32_t {name} = (0x[0-9A-Fa-f]+);", src).group(1), 16)


def test_sigmoid_table_band_matches_the_spec_on_every_bf16():
    """The bf16 SwiGLU kernels look the sigmoid up in a table over the
    magnitudes [kLo, kHi] and clamp every other gate to the band's ends
    (csrc/activation/sigmoid_table.cuh).  That is exact only if the spec's
    sigmoid is 0.5 at and below kLo (either sign), and 1 (positive) or 0
    (negative) at and above kHi, +-inf included; and the band is no wider
    than it must be."""
    lo, hi = _table_bound("kLo"), _table_bound("kHi")
    bits = torch.arange(1 << 16, dtype=torch.int32)
    g = bits.to(torch.int16).view(torch.bfloat16).float()
    s = R.sigmoid_lp(g)
    mag, neg, nan = bits & 0x7FFF, bits >= 0x8000, torch.isnan(g)
    assert bool((s[(mag <= lo) & ~nan] == 0.5).all())
    assert bool((s[(mag >= hi) & ~neg & ~nan] == 1.0).all())
    assert bool((s[(mag >= hi) & neg & ~nan] == 0.0).all())
    assert float(s[lo + 1]) != 0.5 and float(s[0x8000 | (hi - 1)]) != 0.0  # tight on both ends


@requires_cuda
@pytest.mark.parametrize("splits,f", GPU_SPLITS)
@pytest.mark.parametrize("table", [None, False, True])
def test_gpu_swiglu_sigmoid_table_variants_bitexact(monkeypatch, splits, f, table):
    """The FP8 SwiGLU forward and backward with the sigmoid table forced off,
    on, and as the device decides (csrc/activation/heuristics.cu): the same
    bits as the reference on member sizes 0, 1, 127, 129 and capacity tails,
    and the launch counter says which variant ran."""
    _poisoned_empty(monkeypatch)
    monkeypatch.setattr(kernels, "SIGMOID_TABLE", table)
    h, sp, rows = _splits_case(splits, f, "swiglu")
    da = rand_h(rows, f, seed=5)
    p = torch.rand(rows)
    q = Float8BlockQuantizer(E4M3, block_dim=1)
    spec = Activation("swiglu")
    launches = kernels.sigmoid_table_launches()
    fw = kernels.forward(h.cuda(), spec, p.cuda(), sp.cuda(), write_hp=False, quantizer=q)
    bw = kernels.backward(da.cuda(), h.cuda(), spec, p.cuda(), sp.cuda(), dh_quantizer=q, dbias=True)
    expected = _table_expected("swiglu", torch.bfloat16, table)
    assert kernels.sigmoid_table_launches() - launches == (2 if expected else 0)
    _assert_same_fp8(_ref_quantized(R.activation_forward(h, "swiglu", p), q, sp)[0], fw.quantized)
    rdh, _, rdp = R.activation_backward(da, h, "swiglu", p)
    _assert_same_fp8(_ref_quantized(rdh, q, sp)[0], bw.dh_quantized)
    used = sum(splits)
    assert same_bits(bw.dprobs[:used], rdp[:used]) == 0
    _, dbias = lpmoe.group_quantize_dbias(rdh.cuda(), q, len(splits), first_dims=sp.cuda())
    assert torch.equal(bw.dbias.view(torch.int16), dbias.view(torch.int16))


@requires_cuda
def test_gpu_sigmoid_table_device_figure():
    """The figure the heuristic reads comes from the device (the H200 machine
    reports 18.4 bytes per SM cycle; an H100 SXM ~12.8 on paper); 0 would
    mean the attribute queries failed and the table is never taken."""
    figure = lpmoe._ext.ext().activation_dram_bytes_per_sm_cycle(torch.cuda.current_device())
    assert figure > 1.0, figure
    with pytest.raises(Exception, match="device"):
        lpmoe._ext.ext().activation_dram_bytes_per_sm_cycle(-1)


@requires_cuda
@pytest.mark.parametrize("table", [False, True])
def test_gpu_sigmoid_table_partial_column_tile(table, monkeypatch):
    """F % 128 != 0 (a partial last column tile, zero-filled past F) with the
    table forced off and on: high-precision forward and FP8 forward as the
    reference."""
    _poisoned_empty(monkeypatch)
    monkeypatch.setattr(kernels, "SIGMOID_TABLE", table)
    splits, f = [300, 0, 517], 272
    h, sp, rows = _splits_case(splits, f, "swiglu")
    p = torch.rand(rows)
    spec = Activation("swiglu")
    q = Float8BlockQuantizer(E4M3, block_dim=1)
    launches = kernels.sigmoid_table_launches()
    hp = kernels.forward(h.cuda(), spec, p.cuda(), None, write_hp=True).hp
    fw = kernels.forward(h.cuda(), spec, p.cuda(), sp.cuda(), write_hp=False, quantizer=q)
    assert kernels.sigmoid_table_launches() - launches == (2 if table else 0)
    ra = R.activation_forward(h, "swiglu", p)
    assert same_bits(hp, ra) == 0
    _assert_same_fp8(_ref_quantized(ra, q, sp)[0], fw.quantized)
