"""Train a small MoE expert MLP with lpmoe on synthetic regression data.

    python examples/moe_mlp.py                       # GPU: FP8 block scaling
    python examples/moe_mlp.py --graphs              # GPU: step captured in a CUDA graph
    python examples/moe_mlp.py --device cpu          # CPU: reference GEMMs, fp32
    python examples/moe_mlp.py --recipe mxfp8        # emulated MXFP8 (also nvfp4)

The student is lpmoe.ops.Sequential(GroupedLinear -> SwiGLU -> GroupedLinear)
with one expert per row block.  Every step routes the tokens to experts at
random (new split sizes, same total, empty experts allowed) and regresses
onto a fixed random per-expert linear map (the teacher, an lpmoe.GroupedLinear
with the same routing), so each expert must learn its own map.  On a GPU the splits stay on the device (no host
sync), which is what lets ``--graphs`` replay one captured graph with new
routing every step.
"""
import argparse
import time

import torch

import lpmoe
from lpmoe.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling

RECIPES = {"none": None, "fp8_block": Float8BlockScaling, "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="default: fp8_block on GPU, none on CPU")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bf16 on GPU or with a recipe, fp32 otherwise")
    p.add_argument("--steps", type=int, default=None, help="default: 300 on GPU, 200 on CPU")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=None, help="default: 512 on GPU, 128 on CPU")
    p.add_argument("--ffn", type=int, default=None, help="default: 1024 on GPU, 128 on CPU")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step; default 8192 on GPU, 256 on CPU")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate; default 3e-3 on GPU, 1e-2 on CPU "
                   "(smaller model)")
    p.add_argument("--graphs", action="store_true", help="capture forward+backward in CUDA graphs (GPU only)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    if args.graphs and not gpu:
        p.error("--graphs needs a CUDA device")
    if args.recipe is None:
        args.recipe = "fp8_block" if gpu else "none"
    if args.dtype is None:
        args.dtype = "bf16" if gpu or args.recipe != "none" else "fp32"
    args.steps = args.steps if args.steps is not None else (300 if gpu else 200)
    args.hidden = args.hidden or (512 if gpu else 128)
    args.ffn = args.ffn or (1024 if gpu else 128)
    args.tokens = args.tokens or (8192 if gpu else 256)
    args.lr = args.lr if args.lr is not None else (3e-3 if gpu else 1e-2)
    if args.tokens % 16:
        p.error("--tokens must be a multiple of 16 (routing draws splits in 16-token units)")
    return args


def expert_mlp(args, dtype, device):
    return lpmoe.ops.Sequential(
        lpmoe.ops.GroupedLinear(args.experts, args.hidden, 2 * args.ffn, params_dtype=dtype, device=device),
        lpmoe.ops.SwiGLU(),
        lpmoe.ops.GroupedLinear(args.experts, args.ffn, args.hidden, params_dtype=dtype, device=device),
    )


def random_splits(tokens: int, experts: int, device, gen) -> torch.Tensor:
    """Random tokens per expert, summing to ``tokens``, computed on the device
    (no host sync).  Multiples of 16 so that every recipe (NVFP4) accepts them."""
    units = tokens // 16
    cuts = torch.randint(0, units + 1, (experts - 1,), device=device, generator=gen).sort().values
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    end = torch.full((1,), units, dtype=torch.int64, device=device)
    bounds = torch.cat([zero, cuts, end])
    return (bounds[1:] - bounds[:-1]) * 16


def main():
    args = parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    recipe_cls = RECIPES[args.recipe]
    recipe = recipe_cls() if recipe_cls is not None else None
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)

    # Teacher: one random linear map per expert, O(1) outputs (normal init with
    # std 1/sqrt(hidden), through init_method).
    std = args.hidden ** -0.5
    teacher = lpmoe.GroupedLinear(args.experts, args.hidden, args.hidden, bias=False, params_dtype=dtype,
                                  device=device, init_method=lambda w: torch.nn.init.normal_(w, std=std))
    teacher.requires_grad_(False)
    student = expert_mlp(args, dtype, device)
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)

    def batch():
        splits = random_splits(args.tokens, args.experts, device, gen)
        x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device, generator=gen)
        with torch.no_grad():
            target = teacher(x, splits)  # outside autocast: high precision
        return x, splits, target

    model = student
    if args.graphs:
        x0, s0, _ = batch()
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            model = torch.cuda.make_graphed_callables(student, (x0.requires_grad_(False), s0))

    print(f"lpmoe expert MLP: {args.experts} experts, hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens/step,"
          f" {dtype}, recipe {recipe!r}, device {device}{', CUDA graphs' if args.graphs else ''}")
    log_every = max(1, args.steps // 10)
    start, timed_tokens = None, 0
    for step in range(1, args.steps + 1):
        if step == 3:  # skip warm-up steps (allocations, workspaces) in the throughput figure
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, timed_tokens = time.perf_counter(), 0
        x, splits, target = batch()
        with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x, splits)
        loss = torch.nn.functional.mse_loss(y.float(), target.float())
        # set_to_none: with --graphs each backward hands over the graph's static
        # grad buffers; accumulating into them would double-count.
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if start is not None:
            timed_tokens += args.tokens
        if step == 1 or step % log_every == 0 or step == args.steps:
            # .item(): a host sync, only on the steps that print
            rel = (loss / target.float().square().mean()).item()
            print(f"step {step:5d}  loss {loss.item():.6f}  (relative to the target's power: {rel:.4f})")
    if device.type == "cuda":
        torch.cuda.synchronize()
    if start is not None:
        elapsed = time.perf_counter() - start
        print(f"throughput: {timed_tokens / elapsed:,.0f} tokens/s, whole training step incl. teacher and data "
              f"({elapsed:.2f} s for {timed_tokens} tokens)")


if __name__ == "__main__":
    main()
