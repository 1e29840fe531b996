"""MoE layer pieces on one GPU: token permutation against copy bandwidth,
the router against its memory floor, and the share of a full MoE layer
step spent outside the expert MLP.

    python benchmarks/bench_moe.py [--tokens 65536 --topk 8 --hidden 7168]

Bytes counted (the minimum any implementation moves):
  permute           read T*H, write T*k*H          (each token read once)
  unpermute         read T*k*H, write T*H
  unpermute+probs   the same (the probabilities are T*k*4 bytes)
  their backwards   the mirror images; unpermute's backward with probs also
                    reads the expert outputs for d probs (T*k*H more)
  router            read logits T*E*4, write probs + indices T*k*(4+8)
Each ratio divides achieved bandwidth (bytes / time) by the device copy
bandwidth measured in the same run.
"""
from __future__ import annotations

import importlib
import statistics

import torch

from _common import copy_bandwidth_gbs, median_ms, parser, write_summary

import lpmoe
from lpmoe.moe import kernels, permute_probs, routing_map, router_scores
from lpmoe.moe.routing_map import routing_map_torch
from lpmoe.recipe import Float8BlockScaling

rm_module = importlib.import_module("lpmoe.moe.routing_map")  # lpmoe.moe.routing_map is also a function's name


def graph_us(fn, reps=10):
    """GPU time of one fn() call without the host: ``reps`` calls captured in
    one CUDA graph, replays timed (the graph-safe path's cost)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return median_ms(g.replay, warmup=3, iters=15, reps=3) * 1e3 / reps


def _torch_router(logits, k):
    s = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(s, k, dim=-1)
    return top / top.sum(-1, keepdim=True), idx


def _indices(t, k, e, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(t, e, generator=g, device="cuda").topk(k, dim=-1).indices


def bench_permutation(t, k, h, copy_gbs, rows):
    e = 64
    idx = _indices(t, k, e)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    rm = routing_map(idx, e)
    probs = torch.rand(t, k, device="cuda")
    xg = kernels.scatter(x, rm.row_map, rm.num_rows, zero_from=rm.used_rows)[0]
    dy = torch.randn_like(x)
    tok, slots = t * h * 2, t * k * h * 2
    cases = [
        ("routing_map", lambda: routing_map(idx, e), None),
        ("permute", lambda: kernels.scatter(x, rm.row_map, rm.num_rows, zero_from=rm.used_rows), tok + slots),
        ("unpermute", lambda: kernels.gather(xg, rm.row_map), tok + slots),
        ("unpermute+probs", lambda: kernels.gather(xg, rm.row_map, scale=probs), tok + slots),
        ("unpermute+probs bwd", lambda: kernels.scatter(dy, rm.row_map, rm.num_rows, scale=probs,
                                                        zero_from=rm.used_rows, dot_with=xg), tok + 2 * slots),
        ("permute bwd", lambda: kernels.gather(xg, rm.row_map), tok + slots),
        ("permute_probs", lambda: permute_probs(probs, rm), None),
    ]
    out = []
    for name, fn, nbytes in cases:
        ms = statistics.median(median_ms(fn, warmup=3, iters=9, reps=5) for _ in range(3))
        if nbytes is None:
            print(f"  {name:22s} {ms * 1e3:9.1f} us")
            out.append((f"moe {name} T={t} k={k}", f"{ms * 1e3:.0f} us"))
        else:
            ratio = nbytes / ms / 1e6 / copy_gbs
            print(f"  {name:22s} {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  {ratio:.2f} of copy")
            out.append((f"moe {name} T={t} k={k} H={h}", f"{ratio:.2f} of copy"))
    rows += out


def bench_router(t, e, k, copy_gbs, rows):
    logits = torch.randn(t, e, device="cuda")
    floor_bytes = t * e * 4 + t * k * 12
    floor_us = floor_bytes / copy_gbs / 1e3
    for aux in (0.0, 0.01):
        ms = median_ms(lambda: router_scores(logits, k, "softmax", True, aux_loss_coeff=aux), warmup=3, iters=15)
        print(f"  router T={t} E={e} k={k} aux={aux}: {ms * 1e3:.1f} us, floor {floor_us:.1f} us "
              f"({ms * 1e3 / floor_us:.1f}x)")
        rows.append((f"router T={t} E={e} k={k} aux={aux}", f"{ms * 1e3 / floor_us:.1f}x floor"))
    # GPU time alone (CUDA graph replay): the fused kernel vs the same math as PyTorch ops
    fused = graph_us(lambda: router_scores(logits, k, "softmax", True, aux_loss_coeff=0.01, z_loss_coeff=1e-3))
    plain = graph_us(lambda: _torch_router(logits, k))
    print(f"  GPU time (graph replay): lpmoe router (fused kernel + losses) {fused:.1f} us = {fused / floor_us:.1f}x "
          f"floor; PyTorch softmax+topk+normalize {plain:.1f} us = {plain / floor_us:.1f}x floor")
    rows.append((f"router GPU time T={t} E={e} k={k}", f"{fused / floor_us:.1f}x floor (PyTorch ops "
                                                      f"{plain / floor_us:.1f}x)"))


def bench_layer(t, h, f, e, k, fp8, rows):
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(h, f, e, k, params_dtype=torch.bfloat16, aux_loss_coeff=0.01)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # the expert MLP alone, on the rows this routing produces
    with torch.no_grad():
        r = layer.router(x)
        rm = routing_map(r.indices, e)
        xg = kernels.scatter(x.detach(), rm.row_map, rm.num_rows, zero_from=rm.used_rows)[0].requires_grad_()
        pg = permute_probs(r.probs, rm)
    gy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    gyg = torch.randn(rm.num_rows, h, device="cuda", dtype=torch.bfloat16)

    def full():
        layer(x).backward(gy)

    def mlp():
        layer.experts(xg, rm.m_splits, probs=pg).backward(gyg)

    with lpmoe.autocast(enabled=fp8, recipe=Float8BlockScaling()):
        t_full, t_mlp = [], []
        for _ in range(3):  # interleaved
            t_full.append(median_ms(full, warmup=2, iters=7, reps=2))
            t_mlp.append(median_ms(mlp, warmup=2, iters=7, reps=2))
    a, b = statistics.median(t_full), statistics.median(t_mlp)
    tag = "fp8" if fp8 else "bf16"
    share = 1 - b / a
    print(f"  layer {tag} T={t} E={e} k={k}: step {a:.2f} ms (spread {min(t_full):.2f}-{max(t_full):.2f}), "
          f"expert MLP alone {b:.2f} ms -> {share * 100:.1f}% outside the MLP; "
          f"{t / a * 1e3:,.0f} tokens/s")
    rows.append((f"layer {tag} T={t} outside MLP", f"{share * 100:.1f}%"))


def bench_routing_map(t, k, rows):
    """The routing map kernels against the same map from PyTorch ops
    (routing_map_torch: stable sort, searchsorted, scatters): GPU time
    (graph replay) and eager time per call (host included)."""
    for e, capacity in ((64, None), (256, None), (64, 2 * t * k // 64)):
        idx = _indices(t, k, e)
        flat = idx.reshape(-1)
        ours = lambda: routing_map(idx, e, capacity)  # noqa: E731
        ref = lambda: routing_map_torch(flat, e, capacity, False)  # noqa: E731
        if not torch.equal(ours().row_map.view(-1), ref()[0]):
            raise SystemExit("routing map kernels differ from the PyTorch formulation")
        g_ours, g_ref, h_ours, h_ref = [], [], [], []
        for _ in range(3):  # interleaved rounds
            g_ours.append(graph_us(ours)); g_ref.append(graph_us(ref))
            h_ours.append(median_ms(ours, warmup=3, iters=20, reps=5) * 1e3)
            h_ref.append(median_ms(ref, warmup=3, iters=20, reps=5) * 1e3)
        go, gr, ho, hr = (statistics.median(v) for v in (g_ours, g_ref, h_ours, h_ref))
        cap = "" if capacity is None else f" capacity {capacity}"
        print(f"  routing_map T={t} k={k} E={e}{cap}: GPU {go:6.1f} us vs PyTorch ops {gr:6.1f} us ({gr / go:.1f}x); "
              f"eager {ho:6.1f} vs {hr:6.1f} us ({hr / ho:.1f}x)")
        rows.append((f"moe routing_map T={t} k={k} E={e}{cap}", f"GPU {go:.0f} us ({gr / go:.1f}x PyTorch ops), "
                     f"eager {ho:.0f} us ({hr / ho:.1f}x)"))


def bench_layer_routing(t, h, f, e, k, fp8, rows):
    """A launch-bound MoE layer step (eager fwd+bwd) with the routing map
    kernels against the same layer with the map from PyTorch ops (the
    fallback above KERNEL_MAX_EXPERTS), interleaved rounds."""
    torch.manual_seed(0)
    layer = lpmoe.moe.MoELayer(h, f, e, k, params_dtype=torch.bfloat16, single_grouped_parameter=True)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    limit = rm_module.KERNEL_MAX_EXPERTS

    def step(kernel):
        rm_module.KERNEL_MAX_EXPERTS = limit if kernel else 0
        try:
            layer(x).backward(gy)
        finally:
            rm_module.KERNEL_MAX_EXPERTS = limit

    with lpmoe.autocast(enabled=fp8, recipe=Float8BlockScaling()):
        res = {True: [], False: []}
        for _ in range(5):
            for kernel in (True, False):
                res[kernel].append(median_ms(lambda: step(kernel), warmup=3, iters=15, reps=3))
    a, b = statistics.median(res[True]), statistics.median(res[False])
    tag = "fp8" if fp8 else "bf16"
    print(f"  layer {tag} T={t} E={e} k={k} H={h} F={f}: step {a:.3f} ms with the routing map kernels, {b:.3f} ms "
          f"with PyTorch ops ({b / a:.3f}x; rounds {min(res[True]):.3f}-{max(res[True]):.3f} / "
          f"{min(res[False]):.3f}-{max(res[False]):.3f})")
    rows.append((f"layer {tag} T={t} E={e} routing map kernels vs PyTorch ops", f"{b / a:.3f}x step"))


def bench_gather_quantize(t, k, h, e, copy_gbs, rows):
    """FP8 expert input straight from the tokens (permute_quantize: inverse
    map + gathering quantize) against permute_rows then group_quantize
    (1x128 rows + per-expert transposed copy), GPU time by graph replay.
    Bytes counted for the fused op: the grouped rows read once (T*k*H*2)
    plus both FP8 copies and their scales written."""
    from lpmoe.moe import permute_quantize, permute_rows
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    rm = routing_map(_indices(t, k, e), e)
    q = lpmoe.Float8BlockQuantizer(torch.float8_e4m3fn, block_dim=1, rowwise=True, columnwise=True)
    fused = lambda: permute_quantize(x, rm, q)  # noqa: E731
    unfused = lambda: lpmoe.group_quantize(permute_rows(x, rm), q, num_tensors=e, first_dims=rm.m_splits)  # noqa: E731
    a, b = [], []
    for _ in range(3):
        a.append(graph_us(fused, reps=3)); b.append(graph_us(unfused, reps=3))
    fa, fb = statistics.median(a), statistics.median(b)
    n = t * k * h
    moved = n * 2 + 2 * n + 2 * (n // 128) * 4
    ratio = moved / (fa * 1e-6) / (copy_gbs * 1e9)
    print(f"  permute+quantize T={t} k={k} H={h} E={e}: fused {fa:.0f} us ({ratio:.2f} of copy), permute_rows + "
          f"group_quantize {fb:.0f} us ({fb / fa:.2f}x the fused; rounds {min(a):.0f}-{max(a):.0f} / "
          f"{min(b):.0f}-{max(b):.0f})")
    rows.append((f"permute_quantize T={t} k={k} H={h}", f"{fa:.0f} us, {ratio:.2f} of copy, {fb / fa:.2f}x unfused"))


def bench_layer_gather(t, h, f, e, k, rows, single=False):
    """FP8 MoE layer step (fwd+bwd) in three variants and BF16, interleaved rounds:
    "tokens" the experts' input quantized straight from the tokens
    (RoutedTokens, the layer's default); "rows" the same layer with the bf16
    rows permuted first (RoutedTokens.can_quantize switched off: the MLP then
    makes the rows, the path before); "keep" as "tokens" with
    save_original_input=True (no FP8 copy of the rows kept for the backward;
    gathered again for fc1's wgrad); "bf16" the same layer without a
    recipe.  Eager and graph-replay (GPU) time, what
    the forward leaves alive for the backward (output included), and the
    peaks of the forward alone and of the whole step above their start."""
    from lpmoe.moe import RoutedTokens
    torch.manual_seed(0)
    layers = {}
    for keep in (False, True):
        torch.manual_seed(0)
        layers[keep] = lpmoe.moe.MoELayer(h, f, e, k, params_dtype=torch.bfloat16, single_grouped_parameter=single,
                                          save_original_input=keep)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    gathers = RoutedTokens.can_quantize
    variants = ("tokens", "rows", "keep", "bf16")

    def forward(v):
        if v == "bf16":  # the same layer without a recipe
            with lpmoe.autocast(enabled=False):
                return layers[False](x)
        # "rows": RoutedTokens refuses every quantizer, so the MLP permutes first
        RoutedTokens.can_quantize = gathers if v != "rows" else (lambda self, q: False)
        try:
            return layers[v == "keep"](x)
        finally:
            RoutedTokens.can_quantize = gathers

    def step(v):
        forward(v).backward(gy)

    def memory(v):
        """GiB: (alive after the forward, forward peak, step peak), each
        above its start; gradients exist (as after a first step)."""
        step(v)
        out = []
        for what in ("alive", "forward", "step"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if what == "step":
                step(v)
            elif what == "forward":
                forward(v)  # (the output dies here; the peak counts it)
            else:
                held = [forward(v)]  # the output and what its graph keeps for the backward
                torch.cuda.synchronize()
                out.append((torch.cuda.memory_allocated() - base) / 2 ** 30)
                held.clear()
                continue
            torch.cuda.synchronize()
            out.append((torch.cuda.max_memory_allocated() - base) / 2 ** 30)
        return out

    with lpmoe.autocast(recipe=Float8BlockScaling()):
        eager = {v: [] for v in variants}
        gpu = {v: [] for v in variants}
        for _ in range(4):
            for v in variants:
                eager[v].append(median_ms(lambda: step(v), warmup=2, iters=7, reps=2))
        for _ in range(3):  # device time alone: the step captured in a CUDA graph (graph-safe layer)
            for v in variants:
                gpu[v].append(graph_us(lambda: step(v), reps=1) / 1e3)
        mem = {v: memory(v) for v in variants}
    med = {v: (statistics.median(eager[v]), statistics.median(gpu[v])) for v in variants}
    print(f"  layer fp8 T={t} E={e} k={k} H={h} F={f}{' stacked' if single else ''} "
          f"(ms eager [rounds] / GPU; GiB alive after forward / forward peak / step peak):")
    for v in variants:
        a, g = med[v]
        print(f"    {v:6s} {a:8.3f} [{min(eager[v]):.3f}-{max(eager[v]):.3f}] / {g:8.3f}   "
              f"{mem[v][0]:.2f} / {mem[v][1]:.2f} / {mem[v][2]:.2f}"
              + ("" if v in ("rows", "bf16") else f"   vs rows: {med['rows'][0] / a:.3f}x eager, "
                 f"{med['rows'][1] / g:.3f}x GPU; vs bf16: {med['bf16'][1] / g:.3f}x GPU, step peak "
                 f"{mem[v][2] / mem['bf16'][2]:.2f}x"))
    rows.append((f"layer fp8 T={t} E={e} tokens / keep vs rows permuted first",
                 f"GPU {med['rows'][1] / med['tokens'][1]:.3f}x / {med['rows'][1] / med['keep'][1]:.3f}x; "
                 f"alive after fwd {mem['tokens'][0]:.2f} / {mem['keep'][0]:.2f} vs {mem['rows'][0]:.2f} GiB"))


def bench_gather_rows(args, copy_gbs, rows):
    print("FP8 expert input quantized straight from the tokens:")
    for t in (8192, 32768):
        bench_gather_quantize(t, args.topk, args.hidden, 64, copy_gbs, rows)
    print("  MoE layer, launch-bound (4k tokens, 64 experts, top-8, H 2048, F 768) and DeepSeek-V3 shapes:")
    bench_layer_gather(4096, 2048, 768, 64, 8, rows, single=True)
    bench_layer_gather(8192, args.hidden, 2048, 64, args.topk, rows)


def main():
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--gather-only", action="store_true",
                   help="only the FP8-input-from-tokens rows (and the device copy)")
    args = p.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"device copy: {copy_gbs:.0f} GB/s")
    rows = [("device copy", f"{copy_gbs:.0f} GB/s")]
    if args.gather_only:
        bench_gather_rows(args, copy_gbs, rows)
        write_summary(args.summary, rows)
        return
    print("routing map:")
    for t in (args.tokens, 4096):
        bench_routing_map(t, args.topk, rows)
    print("permutation:")
    bench_permutation(args.tokens, args.topk, args.hidden, copy_gbs, rows)
    if not args.quick:
        bench_permutation(4096, args.topk, args.hidden, copy_gbs, rows)
    print("router:")
    bench_router(args.tokens, 64, args.topk, copy_gbs, rows)
    print("MoE layer at a launch-bound size (4k tokens, 64 experts, top-8, H 2048, F 768):")
    for fp8 in (True, False):
        bench_layer_routing(4096, 2048, 768, 64, 8, fp8, rows)
    bench_gather_rows(args, copy_gbs, rows)
    print("MoE layer (DeepSeek-V3 expert shapes, 64 experts, one GPU):")
    for fp8 in (True, False):
        bench_layer(8192, args.hidden, 2048, 64, 8, fp8, rows)
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
