"""Worker processes of the distributed MoE tests (tests/test_moe_layer.py):
each runs one rank over the gloo backend on CPU tensors and raises on any
mismatch (torch.multiprocessing.spawn re-raises it in the test)."""
import os

import torch
import torch.distributed as dist

import lpmoe

H, F, E, K, T = 128, 32, 4, 2, 24


def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank


def _close(a, b, what, tol=2e-5):
    if not torch.allclose(a, b, rtol=tol, atol=tol):
        raise AssertionError(f"{what}: max |diff| {(a - b).abs().max().item():.3g}")


def _step(model, x, w):
    x = x.clone().requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    return y.detach(), x.grad


def expert_parallel(rank, world, port, mode):
    _init(rank, world, port)
    cf = 1.0 if mode == "capacity" else None
    fp8 = mode == "fp8"
    full = lpmoe.moe.MoELayer(H, F, E, K, device="cpu", params_dtype=torch.float32, capacity_factor=cf)
    ep = lpmoe.moe.MoELayer(H, F, E, K, ep_group=dist.group.WORLD, device="cpu", params_dtype=torch.float32,
                            capacity_factor=cf, dispatch_fp8=fp8)
    ep.load_state_dict(full.state_dict())   # the single-GPU dict: each rank keeps its experts
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(T, H, generator=g)
    y_ref, dx_ref = _step(full, x, w)
    y_ep, dx_ep = _step(ep, x, w)
    if fp8:  # FP8 rows on the wire: forward within FP8 error, gradients straight through
        rel = (y_ep - y_ref).norm() / y_ref.norm()
        if not rel < 0.08:
            raise AssertionError(f"fp8 dispatch: relative error {rel:.3g}")
        return dist.destroy_process_group()
    _close(y_ep, y_ref, "output")
    _close(dx_ep, dx_ref, "input gradient")
    _close(ep.router.weight.grad, full.router.weight.grad, "router gradient")
    if cf is not None and int(ep.tokens_dropped) != int(full.tokens_dropped):
        raise AssertionError("dropped counts differ")
    # experts: the EP rank's gradient is the sum over every rank's tokens
    el = E // world
    for p in full.experts.parameters():
        dist.all_reduce(p.grad)   # every rank reduces every expert, in the same order
    for fc in ("linear_fc1", "linear_fc2"):
        for i in range(el):
            ref = getattr(full.experts, fc).get_parameter(f"weight{rank * el + i}").grad
            _close(getattr(ep.experts, fc).get_parameter(f"weight{i}").grad, ref, f"{fc} expert {i} gradient")
    # state dict in the single-GPU numbering; the ranks' dicts merge into it
    keys = [None] * world
    dist.all_gather_object(keys, sorted(ep.state_dict()))
    merged = set().union(*map(set, keys))
    if merged != set(full.state_dict()):
        raise AssertionError(f"merged EP state dict keys differ: {sorted(merged ^ set(full.state_dict()))}")
    dist.destroy_process_group()


def data_parallel(rank, world, port, mode):
    _init(rank, world, port)
    model = lpmoe.moe.MoELayer(H, F, E, K, device="cpu", params_dtype=torch.float32, aux_loss_coeff=0.01)
    ref = lpmoe.moe.MoELayer(H, F, E, K, device="cpu", params_dtype=torch.float32, aux_loss_coeff=0.01)
    ref.load_state_dict(model.state_dict())
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # a CPU mesh: FSDP2 would otherwise pick CUDA where a GPU exists
        wrapped = fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    batches = []
    for r in range(world):
        g = torch.Generator().manual_seed(200 + r)
        batches.append((torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)))
    x, w = batches[rank]
    y = wrapped(x)
    (y * w).sum().backward()       # DDP / FSDP2 average the ranks' gradients
    ref.aux_loss_scale = 1.0 / world
    for xr, wr in batches:         # single process: the mean of every rank's loss
        ((ref(xr) * wr).sum() / world).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        _close(grad, q.grad, f"{mode} gradient of {name}", tol=1e-4)
    dist.destroy_process_group()
