"""The router's backward: its closed form in PyTorch ops
(router_kernel.backward_reference) against autograd over the forward's
formulas (CPU), and the kernel (lpmoe::router_backward) against both (GPU)."""
import pytest
import torch
from torch.library import opcheck

from conftest import poison_allocator, requires_cuda
from lpmoe.moe import router_kernel, router_scores


def _autograd(logits, idx, g_probs, g_lse, g_aff, sigmoid, normalize):
    """The formulation the kernel replaced: scores recomputed in fp32 and
    differentiated by autograd, the selection fixed by idx."""
    with torch.enable_grad():  # also when called from a backward (benchmarks swap it in)
        l = logits.detach().float().requires_grad_()
        s = torch.sigmoid(l) if sigmoid else torch.softmax(l, dim=-1)
        v = s.gather(1, idx)
        outs = [v / v.sum(-1, keepdim=True) if normalize else v, torch.logsumexp(l, dim=-1),
                (s / s.sum(-1, keepdim=True) if sigmoid else s).sum(0)]
        keep = [(o, g) for o, g in zip(outs, (g_probs, g_lse, g_aff)) if g is not None]
        if not keep:
            return torch.zeros_like(logits)
        torch.autograd.backward([o for o, _ in keep], [g for _, g in keep])
    return l.grad.to(logits.dtype)


def _case(t, e, k, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=g) * 2).to(dtype)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    gp, gl, ga = torch.randn(t, k, generator=g), torch.randn(t, generator=g), torch.randn(e, generator=g)
    return [x.to(device) for x in (logits, idx, gp, gl, ga)]


@pytest.mark.parametrize("sigmoid", [False, True])
def test_op_registration_cpu(sigmoid):
    logits, idx, gp, gl, ga = _case(12, 8, 3, torch.float32)
    opcheck(torch.ops.lpmoe.router_backward, (logits, idx, gp, gl, ga, sigmoid, True))
    opcheck(torch.ops.lpmoe.router_backward, (logits, idx, gp, None, None, sigmoid, False))
    before = dict(router_kernel.CALLS)
    got = torch.ops.lpmoe.router_backward(logits, idx, None, None, None, sigmoid, True)
    assert torch.equal(got, torch.zeros_like(logits))
    assert router_kernel.CALLS["torch_router_backward"] > before["torch_router_backward"]


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_reference_matches_autograd_cpu(sigmoid, normalize):
    for t, e, k in ((50, 8, 2), (40, 64, 8), (20, 3, 1), (0, 4, 2)):
        logits, idx, gp, gl, ga = _case(t, e, k, torch.float32, seed=e)
        for grads in ((gp, gl, ga), (gp, None, None), (None, gl, None), (None, None, ga), (None, None, None)):
            got = router_kernel.backward_reference(logits, idx, *grads, sigmoid, normalize)
            want = _autograd(logits, idx, *grads, sigmoid, normalize)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("t,e,k,dtype", [(1000, 64, 8, torch.float32), (1000, 256, 8, torch.bfloat16),
                                         (300, 3, 1, torch.float32), (300, 33, 3, torch.float16),
                                         (200, 512, 32, torch.float32), (1, 8, 2, torch.float32),
                                         (0, 16, 2, torch.float32)])
def test_gpu_kernel_matches_autograd(sigmoid, normalize, t, e, k, dtype):
    logits, idx, gp, gl, ga = _case(t, e, k, dtype, seed=t + e, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for grads in ((gp, gl, ga), (gp, None, None), (None, gl, None), (None, None, ga.expand(e)),
                  (gp, gl, torch.ones(1, device="cuda").expand(e))):
        poison_allocator()
        before = dict(router_kernel.CALLS)
        got = router_kernel._backward_impl(logits, idx, *grads, sigmoid, normalize)
        assert router_kernel.CALLS["fused_router_backward"] == before["fused_router_backward"] + 1
        assert got.dtype == logits.dtype and got.shape == logits.shape
        for want in (router_kernel.backward_reference(logits, idx, *grads, sigmoid, normalize),
                     _autograd(logits, idx, *grads, sigmoid, normalize)):
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (grads[0] is None, grads[1] is None)
        assert torch.equal(got, router_kernel._backward_impl(logits, idx, *grads, sigmoid, normalize))  # deterministic


@requires_cuda
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_gpu_router_scores_backward_runs_the_kernel_eager_and_compiled(score):
    torch.manual_seed(3)
    logits = torch.randn(512, 64, device="cuda")
    w = torch.randn(512, 8, device="cuda")

    def loss(l):
        out = router_scores(l, 8, score, True, aux_loss_coeff=0.01, z_loss_coeff=0.001)
        return (out.probs * w).sum() + out.aux_loss

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        l = logits.clone().requires_grad_()
        before = dict(router_kernel.CALLS)
        fn(l).backward()
        assert router_kernel.CALLS["fused_router_backward"] > before["fused_router_backward"]
        assert router_kernel.CALLS["torch_router_backward"] == before["torch_router_backward"]
        grads.append(l.grad)
    ref = logits.cpu().requires_grad_()
    loss_cpu = router_scores(ref, 8, score, True, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    ((loss_cpu.probs * w.cpu()).sum() + loss_cpu.aux_loss).backward()
    for g in grads:
        assert torch.allclose(g.cpu(), ref.grad, rtol=1e-5, atol=1e-6)
