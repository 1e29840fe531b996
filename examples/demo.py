"""lpmoe demo: a grouped tensor of uneven expert splits, quantized in every
format and dequantized, with the error of each.

    python examples/demo.py [--device cuda|cpu]

On a GPU every format runs lpmoe's CUDA kernels (graph-safe, no host sync;
MXFP8 and NVFP4 in software on Hopper); on CPU the bit-exact pure-PyTorch
reference runs with the same API.
"""
import argparse

import torch

import lpmoe
from lpmoe import Float8BlockQuantizer, GroupedTensor, MXFP8Quantizer, NVFP4Quantizer


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)

    splits = [256, 0, 384, 128, 512]           # tokens routed to each expert (one expert got none)
    hidden = 512
    x = torch.randn(sum(splits) + 64, hidden, dtype=torch.bfloat16, device=dev)  # 64-row capacity tail
    first_dims = torch.tensor(splits, device=dev)
    g = GroupedTensor.from_dense(x, first_dims=first_dims)
    print(f"{g}\n  tensor_offsets = {g.tensor_offsets.tolist()}")

    formats = [
        ("FP8 block 1x128 (E4M3)", Float8BlockQuantizer("e4m3", block_dim=1)),
        ("FP8 block 128x128 (E4M3)", Float8BlockQuantizer("e4m3", block_dim=2)),
        ("MXFP8 (E4M3, E8M0/32)", MXFP8Quantizer("e4m3")),
        ("NVFP4 (E2M1, E4M3/16)", NVFP4Quantizer()),
    ]
    print(f"{'format':28s} {'path':10s} {'rel. error':>10s}")
    for name, q in formats:
        on_gpu = dev.type == "cuda"
        src = g
        qg = lpmoe.group_quantize(src, q)
        y = lpmoe.group_dequantize(qg, torch.float32)
        errs = [rel_err(b, a) for a, b in zip(src.split(), y.split()) if a.numel()]
        path = "kernel" if on_gpu else "reference"
        print(f"{name:28s} {path:10s} {max(errs):10.4f}")


if __name__ == "__main__":
    main()
