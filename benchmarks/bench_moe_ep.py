"""Expert parallelism across GPUs: tokens/s of a MoELayer forward+backward at
EP=1 (each GPU holds every expert and routes its own tokens) and at EP=W
(each GPU holds E/W experts, tokens move by NCCL all-to-all), at the same
per-GPU batch, and the all-to-all's share of the EP step.

    torchrun --nproc_per_node 2 benchmarks/bench_moe_ep.py [--tokens 8192] [--rounds 3]

Configurations, timed interleaved in every round (median over rounds of the
per-round medians; a step's time is the slowest rank's):
  EP=1                  the single-GPU layer, run on every GPU independently
  EP=W exact            host-split all-to-all (one host sync per step)
  EP=W capacity c       graph-safe equal splits, c = --capacity-factor
  ... +fp8 wire         FP8 rows on the dispatch (about half the bytes)
each with bf16 experts and with Float8BlockScaling experts.

Speed-up = (W * T / t_EP) / (T / t_EP1): weak scaling, W is perfect (W
independent single-GPU replicas would score W too); the target is >= 1.7
at W=2.  All-to-all share: the time of NCCL kernels in a profiled EP step
divided by that step's time (the kernels include the wait for the slower
rank), the ranks' mean and max; beside it the all-to-all bandwidth measured
alone.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

import lpmoe
from _common import events_ms
from lpmoe.recipe import Float8BlockScaling


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per GPU")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5, help="timed samples per configuration and round")
    p.add_argument("--recipes", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    p.add_argument("--summary", default=None)
    return p.parse_args()


def _step(layer, x, dy):
    x.grad = None
    layer(x).backward(dy)


def _together_ms(fn, reps):
    """Mean ms of ``reps`` back-to-back calls (CUDA events), started on every
    rank at once (barrier, then an idle device)."""
    dist.barrier()
    torch.cuda.synchronize()
    return events_ms(fn, reps)


def _time_ms(fn, iters, reps=2):
    """Median over ``iters`` samples of :func:`_together_ms`; the slowest
    rank's median is the step's time."""
    fn()
    times = [_together_ms(fn, reps) for _ in range(iters)]
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _nccl_share(fn, steps=3):
    """(mean, max) over ranks of the fraction of a profiled step spent in the
    exchange's NCCL kernels (device activity only; the kernels include the
    wait for the slower rank).  The ranks start the profiled steps together;
    the barrier's own all-reduce kernel is not counted."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_ms = _together_ms(fn, steps)
    us = sum(e.device_time_total for e in prof.key_averages()
             if "nccl" in e.key.lower() and "allreduce" not in e.key.lower())
    share = torch.tensor([us / 1e3 / steps / step_ms], device="cuda")
    shares = [torch.zeros_like(share) for _ in range(dist.get_world_size())]
    dist.all_gather(shares, share)
    shares = [float(s) for s in shares]
    return sum(shares) / len(shares), max(shares)


def _alltoall_gbs(nbytes, world):
    """Bandwidth of one all_to_all_single of ``nbytes`` per rank (bytes that
    leave the rank, (W-1)/W of them, per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dist.all_to_all_single(dst, src), iters=10, reps=5)
    return nbytes * (world - 1) / world / ms / 1e6, ms


def main():
    args = _args()
    if "WORLD_SIZE" not in os.environ or torch.cuda.device_count() < 2:
        print("bench_moe_ep: needs torchrun --nproc_per_node >= 2 on >= 2 GPUs; skipped")
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast stays off (shared hosts)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    h, f, e, k = args.hidden, args.ffn, args.experts, args.top_k
    torch.manual_seed(0)
    kw = dict(aux_loss_coeff=1e-2, params_dtype=torch.bfloat16, device=dev)
    one = lpmoe.moe.MoELayer(h, f, e, k, **kw)
    ep = lpmoe.moe.MoELayer(h, f, e, k, ep_group=dist.group.WORLD, **kw)
    ep.load_state_dict(one.state_dict())
    ep_modes = [("exact", None, False), (f"capacity {args.capacity_factor}", args.capacity_factor, False),
                (f"capacity {args.capacity_factor} +fp8 wire", args.capacity_factor, True)]
    summary = []
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} x {torch.cuda.get_device_name()}; H {h}, F {f}, E {e}, k {k}; "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    for t in args.tokens:
        g = torch.Generator(device=dev).manual_seed(1 + rank)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        for recipe in args.recipes:
            fp8 = recipe == "fp8"

            def run(layer, cf=None, wire=False):
                def fn():
                    layer.capacity_factor, layer.dispatch_fp8 = cf, wire
                    with lpmoe.autocast(enabled=fp8, recipe=Float8BlockScaling()):
                        _step(layer, x, dy)
                return fn
            cases = [("EP=1", run(one))] + [(f"EP={world} {n}", run(ep, cf, wire)) for n, cf, wire in ep_modes]
            samples = {name: [] for name, _ in cases}
            for _ in range(args.rounds):
                for name, fn in cases:
                    samples[name].append(_time_ms(fn, args.iters))
            base = statistics.median(samples["EP=1"])
            for name, fn in cases:
                ms = statistics.median(samples[name])
                spread = (max(samples[name]) - min(samples[name])) / ms
                n_gpu = 1 if name == "EP=1" else world
                tps = t * n_gpu / ms * 1e3
                speedup = tps / (t / base * 1e3)
                mean, top = _nccl_share(fn) if name != "EP=1" else (0.0, 0.0)
                say(f"T/GPU {t:6d} {recipe:4s} {name:32s} {ms:8.2f} ms (±{spread / 2:.0%})  "
                    f"{tps:12,.0f} tokens/s  x{speedup:.2f} of one GPU  all-to-all {mean:.0%} of the step "
                    f"(ranks' mean; max {top:.0%})")
                if name != "EP=1":
                    summary.append((f"moe EP={world} {recipe} T{t} {name.split(' ', 1)[1]}",
                                    f"x{speedup:.2f} of one GPU; all-to-all {mean:.0%}"))
        # bytes each rank sends per dispatch at exact routing: T*k rows, (W-1)/W leave the GPU
        nbytes = t * k * h * 2
        gbs, ms = _alltoall_gbs(nbytes, world)
        say(f"all_to_all_single of {nbytes / 2**20:.0f} MiB per rank (T*k*H bf16): {ms:.2f} ms, "
            f"{gbs:.0f} GB/s leaving each GPU; a step has 4 such exchanges (dispatch, combine, "
            f"and their backwards): {4 * ms:.1f} ms of transfer at bf16")
    if rank == 0 and args.summary:
        with open(args.summary, "w") as fh:
            for name, value in summary:
                fh.write(f"{name}|{value}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
