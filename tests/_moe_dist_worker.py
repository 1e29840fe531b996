"""Worker processes of the distributed MoE tests (tests/test_moe_layer.py).
Each runs one rank and raises on any mismatch (torch.multiprocessing.spawn
re-raises it in the test).  ``device="cpu"`` runs over gloo (CI);
``device="cuda"`` over NCCL, one GPU per rank."""
import os

import torch
import torch.distributed as dist

import lpmoe

H, F, E, K, T = 128, 32, 4, 2, 24


def _init(rank, world, port, device):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # NVLink multicast stays off on shared multi-GPU hosts (the machine's rule)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")


def _exit_passed():
    """End a rank that passed without running C++ static destructors: after
    an FSDP2 step over gloo (torch 2.14, CPU), about half of the exits
    aborted in them ("terminate called without an active exception", a
    joinable std::thread destroyed) after every check had passed and the
    process group was gone, failing the test at random.  A failing rank
    raises before it gets here, so spawn still reports failures."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _close(a, b, what, tol, relative=False):
    """fp32 (CPU): element-wise.  bf16 (GPU, where the sync-free grouped GEMMs
    take bf16), or ``relative``: relative to b's norm; the GEMMs' tiling
    differs between E and E/W experts, while a wrong routing or exchange is
    off by ~1.  (The FP8-wire modes scale rows by up to 2^6: their fp32
    gradients reach hundreds, where a different summation order alone moves
    an element past an absolute 2e-5.)"""
    if a.dtype == torch.float32 and not relative:
        if not torch.allclose(a, b, rtol=tol, atol=tol):
            raise AssertionError(f"{what}: max |diff| {(a - b).abs().max().item():.3g}")
        return
    rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    if not rel < tol:
        raise AssertionError(f"{what}: relative error {rel:.3g} (limit {tol})")


def _step(model, x, w):
    x = x.clone().requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    return y.detach(), x.grad


def _inputs(rank, dev, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + rank)
    return (torch.randn(T, H, generator=g).to(dev, dtype), torch.randn(T, H, generator=g).to(dev, dtype))


def _rows_as_on_the_wire(experts, args):
    """Forward pre-hook for the reference layer's experts: their input rows as
    the FP8 wire delivers them.  The wire quantizes each row on its own (1x128
    blocks), so the round trip on the grouped rows equals the one on the sent
    rows, whatever their order; the backward is straight through, as the
    wire's.  ``rt + (rows - rows.detach())`` is rt exactly, with rows' graph."""
    from lpmoe.functional.gathered_rows import GatheredRows
    from lpmoe.moe.wire import dequantize_rows, quantize_rows
    rows, splits = args[0], args[1]
    if isinstance(rows, GatheredRows):  # the one-process layer hands over its tokens and routing map
        rows, splits = rows.rows(), rows.m_splits
    rt = dequantize_rows(*quantize_rows(rows.detach()), rows.dtype)
    return (rt + (rows - rows.detach()), splits) + tuple(args[2:])


def expert_parallel(rank, world, port, mode, device="cpu"):
    """EP=world vs the whole layer on each rank's own tokens (mode: host,
    capacity, fp8 / fp8_capacity: FP8 rows on the wire of the exact /
    capacity path, or sync: the capacity path under
    set_sync_debug_mode('error'), GPU only)."""
    dev = _init(rank, world, port, device)
    dtype, tol = (torch.float32, 2e-5) if device == "cpu" else (torch.bfloat16, 1e-2)
    cf = 1.0 if mode in ("capacity", "fp8_capacity", "sync") else None
    fp8 = mode.startswith("fp8")
    full = lpmoe.moe.MoELayer(H, F, E, K, device=dev, params_dtype=dtype, capacity_factor=cf)
    ep = lpmoe.moe.MoELayer(H, F, E, K, ep_group=dist.group.WORLD, device=dev, params_dtype=dtype,
                            capacity_factor=cf, dispatch_fp8=fp8)
    ep.load_state_dict(full.state_dict())   # the single-GPU dict: each rank keeps its experts
    x, w = _inputs(rank, dev, 100, dtype)
    if fp8:
        # rows of very different magnitudes: a scale landing on the wrong row is off by up to 2^12
        g = torch.Generator().manual_seed(7 + rank)
        x = x * torch.pow(2.0, torch.randint(-6, 7, (T, 1), generator=g).to(dev, dtype))
        full.experts.register_forward_pre_hook(_rows_as_on_the_wire)
    y_ref, dx_ref = _step(full, x, w)
    if mode == "sync":   # warm (NCCL communicator, workspaces), then a step that must not sync
        _step(ep, x, w)
        ep.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        y_ep, dx_ep = _step(ep, x, w)
    finally:
        if mode == "sync":
            torch.cuda.set_sync_debug_mode("default")
    _close(y_ep, y_ref, "output", tol, fp8)
    _close(dx_ep, dx_ref, "input gradient", tol, fp8)
    _close(ep.router.weight.grad, full.router.weight.grad, "router gradient", tol, fp8)
    if cf is not None and int(ep.tokens_dropped) != int(full.tokens_dropped):
        raise AssertionError("dropped counts differ")
    # experts: the EP rank's gradient is the sum over every rank's tokens
    el = E // world
    for p in full.experts.parameters():
        dist.all_reduce(p.grad)   # every rank reduces every expert, in the same order
    for fc in ("linear_fc1", "linear_fc2"):
        for i in range(el):
            ref = getattr(full.experts, fc).get_parameter(f"weight{rank * el + i}").grad
            _close(getattr(ep.experts, fc).get_parameter(f"weight{i}").grad, ref, f"{fc} expert {i} gradient", tol,
                   fp8)
    # state dict in the single-GPU numbering; the ranks' dicts merge into it
    keys = [None] * world
    dist.all_gather_object(keys, sorted(ep.state_dict()))
    merged = set().union(*map(set, keys))
    if merged != set(full.state_dict()):
        raise AssertionError(f"merged EP state dict keys differ: {sorted(merged ^ set(full.state_dict()))}")
    dist.destroy_process_group()


def expert_parallel_fp8_experts(rank, world, port, device="cuda"):
    """EP=world vs EP=1 with Float8BlockScaling experts and bf16 parameters:
    the same FP8 GEMMs on the same rows, grouped differently."""
    from lpmoe.recipe import Float8BlockScaling
    dev = _init(rank, world, port, device)
    h, f, e = 256, 128, 8
    full = lpmoe.moe.MoELayer(h, f, e, K, device=dev, params_dtype=torch.bfloat16)
    ep = lpmoe.moe.MoELayer(h, f, e, K, ep_group=dist.group.WORLD, device=dev, params_dtype=torch.bfloat16)
    ep.load_state_dict(full.state_dict())
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(512, h, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(512, h, generator=g).to(dev, torch.bfloat16)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        y_ref, dx_ref = _step(full, x, w)
        y_ep, dx_ep = _step(ep, x, w)
    # forward rows see identical FP8 operands (1x128 blocks are per row): equal up to
    # the GEMM's accumulation order; backward within FP8 error
    for a, b, what, lim in ((y_ep, y_ref, "output", 1e-2), (dx_ep, dx_ref, "input gradient", 5e-2)):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        if not rel < lim:
            raise AssertionError(f"fp8 experts {what}: relative error {rel:.3g}")
    dist.destroy_process_group()


def expert_parallel_amp(rank, world, port, device="cpu"):
    """fp32 parameters under torch.autocast(bfloat16), FP8 experts, both
    exchanges (exact host splits and the capacity path): EP=world vs the
    whole layer on each rank's tokens, the router's and the experts' fp32
    gradients included (the exchange moves the layer's bf16 rows; each
    expert sees the same rows, grouped differently)."""
    from lpmoe.recipe import Float8BlockScaling
    dev = _init(rank, world, port, device)
    h, f, e = 256, 128, 4
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(64, h, generator=g).to(dev)   # an fp32 residual stream
    w = torch.randn(64, h, generator=g).to(dev)
    for cf in (None, 2.0):
        torch.manual_seed(0)
        full = lpmoe.moe.MoELayer(h, f, e, K, device=dev, params_dtype=torch.float32, capacity_factor=cf)
        ep = lpmoe.moe.MoELayer(h, f, e, K, ep_group=dist.group.WORLD, device=dev, params_dtype=torch.float32,
                                capacity_factor=cf)
        ep.load_state_dict(full.state_dict())
        with torch.autocast(dev.type, dtype=torch.bfloat16), lpmoe.autocast(recipe=Float8BlockScaling()):
            y_ref, dx_ref = _step(full, x, w)
            y_ep, dx_ep = _step(ep, x, w)
        for t in (y_ref, y_ep):
            if t.dtype != torch.bfloat16:
                raise AssertionError(f"output dtype {t.dtype}, expected bf16 (autocast's)")
        if dx_ep.dtype != torch.float32 or any(p.grad.dtype != torch.float32 for p in ep.parameters()):
            raise AssertionError("gradients of the fp32 input and parameters must be fp32")
        _close(y_ep, y_ref, "output", 1e-2, True)
        _close(dx_ep, dx_ref, "input gradient", 5e-2, True)
        _close(ep.router.weight.grad, full.router.weight.grad, "router gradient", 5e-2, True)
        el = e // world
        for p in full.experts.parameters():
            dist.all_reduce(p.grad)
        for fc in ("linear_fc1", "linear_fc2"):
            for i in range(el):
                ref = getattr(full.experts, fc).get_parameter(f"weight{rank * el + i}").grad
                _close(getattr(ep.experts, fc).get_parameter(f"weight{i}").grad, ref, f"{fc} expert {i} gradient",
                       5e-2, True)
    dist.destroy_process_group()


def data_parallel(rank, world, port, mode, device="cpu"):
    dev = _init(rank, world, port, device)
    dtype, tol = (torch.float32, 1e-4) if device == "cpu" else (torch.bfloat16, 2e-2)
    model = lpmoe.moe.MoELayer(H, F, E, K, device=dev, params_dtype=dtype, aux_loss_coeff=0.01)
    ref = lpmoe.moe.MoELayer(H, F, E, K, device=dev, params_dtype=dtype, aux_loss_coeff=0.01)
    ref.load_state_dict(model.state_dict())
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # an explicit mesh: FSDP2 would otherwise pick CUDA where a GPU exists
        wrapped = fully_shard(model, mesh=init_device_mesh(dev.type, (world,)))
    batches = [_inputs(r, dev, 200, dtype) for r in range(world)]
    x, w = batches[rank]
    y = wrapped(x)
    (y * w).sum().backward()       # DDP / FSDP2 average the ranks' gradients
    ref.aux_loss_scale = 1.0 / world
    for xr, wr in batches:         # single process: the mean of every rank's loss
        ((ref(xr) * wr).sum() / world).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        _close(grad, q.grad, f"{mode} gradient of {name}", tol)
    dist.destroy_process_group()
    _exit_passed()


def pending_collective_inputs(rank, world, port, device="cuda"):
    """Results of torch.distributed's functional collectives fed straight to
    lpmoe (pending AsyncCollectiveTensors, data pointer 0 until waited): every
    public entry point waits on them (lpmoe._async_inputs counts it), gives
    what the same call on plain tensors gives, and gradients flow back through
    the wait.  One rank is enough (NCCL on a GPU, gloo on CPU)."""
    from torch.distributed import _functional_collectives as funcol
    from lpmoe import _async_inputs
    from lpmoe.recipe import Float8BlockScaling
    dev = _init(rank, world, port, device)
    grp = dist.group.WORLD
    bf16 = torch.bfloat16

    def pending(t):
        out = funcol.all_to_all_single_autograd(t, None, None, grp)
        assert isinstance(out, funcol.AsyncCollectiveTensor)
        return out

    def check(what, got, want, waits):
        before = _async_inputs.CALLS["waited"]
        g = got()
        if _async_inputs.CALLS["waited"] - before < waits:
            raise AssertionError(f"{what}: {waits} pending inputs, {_async_inputs.CALLS['waited'] - before} waited")
        w = want()
        for a, b in zip(g if isinstance(g, tuple) else (g,), w if isinstance(w, tuple) else (w,)):
            if not torch.equal(a, b):
                raise AssertionError(f"{what}: result on pending inputs differs")

    x = torch.randn(256, 128, device=dev, dtype=bf16)
    splits = torch.tensor([100, 0, 56, 100], device=dev, dtype=torch.int64)
    probs = torch.rand(256, device=dev)
    dy = torch.randn(256, 128, device=dev, dtype=bf16)
    mlp = lpmoe.GroupedMLP(4, 128, 128, device=dev, params_dtype=bf16)
    recipes = [None, Float8BlockScaling()] if device == "cuda" else [None]
    for recipe in recipes:   # forward and backward, the gradients through the wait
        def step(pend):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            mlp.zero_grad()
            with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
                y = mlp(*((pending(xi), pending(splits)) if pend else (xi, splits)),
                        probs=pending(pi) if pend else pi)
            y.backward(dy)
            return (y.detach(), xi.grad, pi.grad) + tuple(p.grad.clone() for p in mlp.parameters())
        check(f"GroupedMLP {recipe}", lambda: step(True), lambda: step(False), 3)
    rm = lpmoe.moe.routing_map(torch.randint(0, 4, (256, 2), device=dev), 4)

    def perm(pend):
        xi = x.clone().requires_grad_()
        g = lpmoe.moe.permute_rows(pending(xi) if pend else xi, rm)
        y = lpmoe.moe.unpermute(pending(g) if pend else g, rm)
        y.backward(dy)
        return y.detach(), xi.grad
    check("permute_rows + unpermute", lambda: perm(True), lambda: perm(False), 2)
    q1 = lpmoe.Float8BlockQuantizer(block_dim=1)
    fields = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv")
    check("quantize", lambda: tuple(getattr(lpmoe.quantize(pending(x), q1), f) for f in fields),
          lambda: tuple(getattr(lpmoe.quantize(x, q1), f) for f in fields), 1)

    def members(gt):   # each member's own bytes: GPU padding between members is uninitialised
        return tuple(m[f].view(torch.uint8) for m in gt.split() for f in sorted(m) if isinstance(m[f], torch.Tensor))
    check("group_quantize", lambda: members(lpmoe.group_quantize(pending(x), q1, 4, first_dims=pending(splits))),
          lambda: members(lpmoe.group_quantize(x, q1, 4, first_dims=splits)), 2)
    w = [torch.randn(64, 128, device=dev, dtype=bf16) for _ in range(4)]
    a = lpmoe.GroupedTensor.from_dense(x, 4, first_dims=splits)
    check("grouped_gemm weights", lambda: lpmoe.grouped_gemm(a, [pending(t) for t in w], kind="fprop"),
          lambda: lpmoe.grouped_gemm(a, w, kind="fprop"), 4)
    h = torch.randn(256, 128, device=dev, dtype=bf16)
    check("activation", lambda: lpmoe.activation.activation(pending(h), "swiglu"),
          lambda: lpmoe.activation.activation(h, "swiglu"), 1)
    logits = torch.randn(256, 8, device=dev)
    check("router_scores", lambda: tuple(lpmoe.moe.router_scores(pending(logits), 2))[:2],
          lambda: tuple(lpmoe.moe.router_scores(logits, 2))[:2], 1)
    dist.destroy_process_group()
