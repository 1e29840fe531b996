"""The fused AdamW + FP8 128x128 weight quantization step (csrc/optim,
lpmoe.optim.kernels, the op lpmoe::adamw_fp8_block_step): the reference's
arithmetic against torch.optim.AdamW, and the kernel bit for bit against
the reference followed by lpmoe's quantizer (edge shapes, many experts,
special values, formats; fp32 weights, and bf16 / fp16 weights with fp32
masters), outputs poisoned first; errors; opcheck."""
import pytest
import torch
from torch.library import opcheck

import lpmoe
from _optim_common import BF16, Q2D, devices
from conftest import poison_, requires_cuda
from lpmoe.library import specs
from lpmoe.optim.kernels import QUANTIZED_BUFFERS
from lpmoe.reference.optim import adamw_scalars, adamw_step_


# ------------------------------------------------------------ reference math
def test_reference_follows_torch_adamw():
    """Our fixed op order is torch.optim.AdamW up to rounding (torch's own
    single-tensor, foreach and fused implementations differ as much)."""
    torch.manual_seed(0)
    p = torch.randn(64, 48)
    q = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([q], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        g = torch.randn_like(p)
        q.grad = g.clone()
        opt.step()
        adamw_step_(p, g, m, v, adamw_scalars(1e-2, 0.8, 0.95, 1e-6, 0.1, step))
    torch.testing.assert_close(p, q.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(v, opt.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_scalars_are_fp32_values():
    s = adamw_scalars(3e-4, 0.9, 0.95, 1e-8, 0.1, 7)
    for x in s:
        assert torch.tensor(x, dtype=torch.float32).item() == x
    assert s.step_size == pytest.approx(3e-4 / (1 - 0.9 ** 7), rel=1e-7)


# --------------------------------------------------------------- the op
def _members(g, n, k, device, seed=0, dtype=torch.float32):
    """(params, grads, masters, exp_avgs, exp_avg_sqs); 16-bit params: their
    masters are the fp32 values, the params those rounded (as after a step)."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda scale: [(torch.randn(n, k, generator=gen) * scale).to(device) for _ in range(g)]  # noqa: E731
    params, grads, m = mk(0.05), mk(1e-3), mk(1e-4)
    v = [(t * t * 10).to(device) for t in mk(1e-3)]
    if dtype == torch.float32:
        return params, grads, [], m, v
    return [t.to(dtype) for t in params], [t.to(dtype) for t in grads], params, m, v


def _out_buffers(params, q):
    g = len(params)
    n, k = params[0].shape
    made = lpmoe.group_quantize(torch.stack(params).view(g * n, k), q, num_tensors=g)
    return made, [poison_(getattr(made, b)) for b in QUANTIZED_BUFFERS]


def _expected(params, grads, w, m, v, s, q):
    """Reference step on copies (of the fp32 params, or of the masters then
    rounded into the 16-bit params: torch's round to nearest even), then
    lpmoe's quantizer on the params."""
    params, w, m, v = ([t.clone() for t in ts] for ts in (params, w, m, v))
    for i, (g, a, b) in enumerate(zip(grads, m, v)):
        if w:
            adamw_step_(w[i], g.float(), a, b, s)
            params[i].copy_(w[i])
        else:
            adamw_step_(params[i], g, a, b, s)
    g = len(params)
    n, k = params[0].shape
    return params, w, m, v, lpmoe.group_quantize(torch.stack(params).view(g * n, k), q, num_tensors=g)


def _run_op(params, grads, w, m, v, s, q):
    made, out = _out_buffers(params, q)
    lpmoe.library.routing.OPS["adamw_fp8_block_step"](params, grads, w, m, v, s, q, out)
    return made


def _bits(t):
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def _assert_step_exact(shape, device, edit=None, q=Q2D, dtype=torch.float32, s=None):
    params, grads, w, m, v = _members(*shape, device, dtype=dtype)
    if edit is not None:
        edit(w or params, grads, m, v)
    for p in params if w else ():
        poison_(p)  # the step writes every 16-bit param from its master
    s = s or adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 3)
    want_p, want_w, want_m, want_v, want_q = _expected(params, grads, w, m, v, s, q)
    got_q = _run_op(params, grads, w, m, v, s, q)
    for got, want in ((params, want_p), (w, want_w), (m, want_m), (v, want_v)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(_bits(a), _bits(b))
    for b in QUANTIZED_BUFFERS:
        assert torch.equal(getattr(got_q, b).view(torch.uint8), getattr(want_q, b).view(torch.uint8)), b


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16_master", "fp16_master"])
@pytest.mark.parametrize("shape", [(1, 128, 128), (3, 200, 336), (2, 1, 16)], ids=str)
def test_fused_step_is_reference_then_quantize(device, shape, dtype):
    _assert_step_exact(shape, device, dtype=dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("shape", [(70, 16, 32), (130, 129, 144)], ids=str)
def test_fused_step_gpu_many_members(shape, dtype):
    """More members than one launch's pointer tables (64) hold."""
    before = lpmoe.optim.kernels.fused_launches()
    _assert_step_exact(shape, "cuda", dtype=dtype)
    assert lpmoe.optim.kernels.fused_launches() - before == -(-shape[0] // 64)


def _special_values(params, grads, m, v):
    grads[0][0, :16] = 0.0
    grads[0][1, 0] = float("nan")
    grads[0][2, 5] = float("inf")
    grads[0][3, :] = 1e30
    params[0][4, :] = 0.0
    params[0][5, 7] = 1e-41  # subnormal
    v[0][6, :] = 0.0
    m[0][6, :] = 0.0


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16_master", "fp16_master"])
def test_fused_step_special_values(device, dtype):
    _assert_step_exact((2, 160, 128), device, edit=_special_values, dtype=dtype)


def _rounding_ties(params, grads, m, v):
    """Masters whose update lands on or near a bf16 / fp16 rounding tie and
    beyond fp16's range: the params' rounding is tested where it matters."""
    grads[0].zero_()
    m[0].zero_()
    v[0].fill_(1.0)
    params[0][0, :] = 1.0 + 2.0 ** -8 + torch.arange(params[0].shape[1]) * 2.0 ** -20  # bf16 ties and near
    params[0][1, :] = 1.0 + 2.0 ** -11 + torch.arange(params[0].shape[1]) * 2.0 ** -23  # fp16 ties and near
    params[0][2, :] = 70000.0  # above fp16's largest finite value: inf


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=["bf16_master", "fp16_master"])
def test_fused_step_rounds_masters_to_nearest_even(device, dtype):
    no_decay = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.0, 3)  # zero update: the masters stay on the ties
    _assert_step_exact((1, 128, 128), device, edit=_rounding_ties, dtype=dtype, s=no_decay)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_master"])
@pytest.mark.parametrize("q", [lpmoe.Float8BlockQuantizer(block_dim=2, fp8_dtype=torch.float8_e5m2),
                               lpmoe.Float8BlockQuantizer(block_dim=2, pow2_scales=False, amax_epsilon=1e-3)],
                         ids=["e5m2", "fp32_scales"])
def test_fused_step_gpu_formats(q, dtype):
    _assert_step_exact((2, 256, 384), "cuda", q=q, dtype=dtype)


@pytest.mark.parametrize("device", devices())
def test_fused_step_rejects_bad_input(device):
    """Python's checks (CPU, and GPU calls with validation) and the
    binding's (GPU calls without it) name the argument."""
    params, grads, w, m, v = _members(2, 32, 32, device)
    s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    _, out = _out_buffers(params, Q2D)
    step = lpmoe.library.routing.OPS["adamw_fp8_block_step"]
    for validate in ((True, False) if device == "cuda" else (True,)):
        err = (TypeError, RuntimeError) if not validate else TypeError
        with pytest.raises(err, match=r"grads\[1\]` must be|grads\[1\] must be a float32"):
            step(params, [grads[0], grads[1].to(BF16)], w, m, v, s, Q2D, out, validate=validate)
        with pytest.raises((ValueError, RuntimeError), match="exp_avgs has 1 tensors|same length"):
            step(params, grads, w, m[:1], v, s, Q2D, out, validate=validate)
        with pytest.raises((ValueError, RuntimeError), match="take no masters|float32 parameters take no"):
            step(params, grads, [p.clone() for p in params], m, v, s, Q2D, out, validate=validate)
        low = [p.to(BF16) for p in params]
        with pytest.raises((ValueError, RuntimeError), match="one float32 master"):
            step(low, [g.to(BF16) for g in grads], [], m, v, s, Q2D, out, validate=validate)
        with pytest.raises((TypeError, RuntimeError), match=r"masters\[0\]` must be|masters\[0\] must be"):
            step(low, [g.to(BF16) for g in grads], [p.to(BF16) for p in params], m, v, s, Q2D, out,
                 validate=validate)
    with pytest.raises(ValueError, match="multiple of 16"):
        bad = [t[:, :24].contiguous() for t in params]
        step(bad, bad, [], bad, bad, s, Q2D, out)
    with pytest.raises(ValueError, match="128x128"):
        step(params, grads, w, m, v, s, lpmoe.Float8BlockQuantizer(), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_master"])
def test_opcheck_adamw_fp8_block_step(dtype):
    from lpmoe.library.optim_ops import _step
    params, grads, w, m, v = _members(2, 32, 32, "cpu", dtype=dtype)
    _, out = _out_buffers(params, Q2D)
    s = adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    opcheck(_step, (params, grads, w, m, v, list(s), specs.encode(Q2D), out),
            test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
