"""A complete MoE layer (lpmoe.moe.MoELayer: router, permutation, expert
MLP, un-permutation) trained on a toy regression, on one device or expert-
parallel over torch.distributed.

    python examples/moe_layer.py [--device cpu|cuda] [--fp8] [--graphs]
    torchrun --nproc_per_node 2 examples/moe_layer.py --ep [--capacity-factor 1.25] [--dispatch-fp8]

With --ep every rank routes its own tokens and owns num_experts / world
experts (NCCL on GPUs, gloo on CPUs).  Without --capacity-factor the
exchange sizes are read on the host each step (exact); with it every size
is static (graph-safe).  --graphs captures the single-device step with
torch.cuda.make_graphed_callables (routing changes every replay).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--fp8", action="store_true", help="Float8BlockScaling experts (Hopper)")
    p.add_argument("--graphs", action="store_true", help="capture the step in CUDA graphs (single device)")
    p.add_argument("--ep", action="store_true", help="expert parallelism over the torchrun world")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--dispatch-fp8", action="store_true")
    args = p.parse_args(argv)

    group, rank = None, 0
    device = torch.device(args.device)
    if args.ep:
        import torch.distributed as dist
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank = dist.get_rank()
        if args.device == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        group = dist.group.WORLD
    torch.manual_seed(0)  # identical initial weights on every rank
    dtype = torch.bfloat16
    layer = lpmoe.moe.MoELayer(args.hidden, args.ffn, args.experts, args.top_k, ep_group=group,
                               aux_loss_coeff=1e-2, capacity_factor=args.capacity_factor,
                               dispatch_fp8=args.dispatch_fp8, params_dtype=dtype, device=device)
    target = torch.nn.Linear(args.hidden, args.hidden, bias=False, device=device, dtype=dtype)
    opt = torch.optim.Adam(layer.parameters(), lr=args.lr)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    step_fn = layer
    def recipe():
        return lpmoe.autocast(enabled=args.fp8, recipe=Float8BlockScaling())

    if args.graphs:
        with recipe():
            step_fn = torch.cuda.make_graphed_callables(layer, (x,))
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    losses, t0 = [], None
    for step in range(args.steps):
        if step == 5 and device.type == "cuda":
            torch.cuda.synchronize()
        if step == 5:
            t0 = time.perf_counter()
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=gen, device=device, dtype=dtype))
            want = torch.tanh(target(x))
        with recipe():
            y = step_fn(x)
        loss = (y.float() - want.float()).square().mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / max(1, args.steps - 5)
    if rank == 0:
        mode = f"EP={torch.distributed.get_world_size() if args.ep else 1}"
        print(f"MoELayer {mode} on {device.type}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
              f"{args.tokens / dt:,.0f} tokens/s per rank (fwd+bwd+Adam), "
              f"dropped {int(layer.tokens_dropped) if layer.tokens_dropped is not None else 0}")
    if args.ep:
        torch.distributed.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
