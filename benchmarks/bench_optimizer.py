"""The optimizer step of expert weights with their FP8 copies, and whole
training steps, at DeepSeek-V3 expert shapes (fc1 7168 -> 2x2048, fc2 2048
-> 7168), side by side in one run.  Parameters: fp32 (default; PyTorch's
mixed precision: torch.autocast trains them in bf16), or with
``--params bf16`` bf16 parameters with fp32 master weights in every
optimizer (``master_weights=True``: Megatron's and TransformerEngine's
configuration; the optimizer steps the master and rounds it into the
parameter).

Optimizer step of both layers' expert weights (gradients given):
  lpmoe      lpmoe.optim.AdamW: one fused kernel per layer updates the
             weights and moments and writes the 128x128 FP8 copies
             (30 bytes per parameter)
  torch+q    torch.optim.AdamW (fused=True) and then the 128x128 FP8
             quantization of each layer's updated weights: what an FP8
             layer's step costs without lpmoe.optim (28 + 6 bytes; with
             bf16 parameters torch steps the masters, through
             lpmoe.optim.AdamW(master_weights=True) without
             fp8_weights_of: + the gradients widened to fp32 and the
             masters rounded into the parameters, 44 bytes)
  foreach+q  the same with torch's default (foreach) AdamW
  copy       the device copy's rate applied to lpmoe's 30 bytes: the floor

Training step (--steps; fwd + bwd + optimizer of lpmoe.GroupedMLP, SwiGLU
with router probabilities, graph-safe device splits, the input's gradient
computed as in a model; the two shapes above at
8 x 64k and 32 x 16k tokens, and 64 experts x 64 tokens of a 2048 -> 2x768
MLP, launch-bound, with per-expert and with stacked parameters):
  fp8+lpmoe  Float8BlockScaling, lpmoe.optim.AdamW (the forward reads the
             optimizer's FP8 weights)
  fp8+torch  Float8BlockScaling, torch.optim.AdamW(fused=True) (the forward
             quantizes the weights)
  bf16+torch no recipe, torch.optim.AdamW(fused=True)
(with --params bf16 the torch variants step fp32 masters as above).  With
--params bf16 the fwd + bwd alone is timed too, as the expert-MLP
benchmarks time it: fp8+lpmoe's forward reads the FP8 weights its last
optimizer step wrote, fp8+torch's quantizes them.

CUDA events after warm-up, medians of several samples (benchmarks/_common);
the training steps also print the peak memory allocated during one step.
"""
from __future__ import annotations

import gc
import statistics

import torch

import lpmoe
from lpmoe.functional.weights import stack_weights
from lpmoe.recipe import Float8BlockScaling

from _common import copy_bandwidth_gbs, median_ms, parser, splits_for, write_summary

HIDDEN, FFN = 7168, 2048
BF16 = torch.bfloat16
Q2D = lpmoe.Float8BlockQuantizer(block_dim=2)


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _adamw(params, model, fp8: bool, dtype, **kw):
    """The optimizer of a variant: lpmoe's (fp8: writing the FP8 weights of
    ``model``), or torch's AdamW; for 16-bit parameters both step fp32
    masters (torch's through lpmoe.optim.AdamW without fp8_weights_of)."""
    master = dtype != torch.float32
    if fp8 or master:
        return lpmoe.optim.AdamW(params, lr=kw.pop("lr"), master_weights=master,
                                 fp8_weights_of=model if fp8 else None, **kw)
    return torch.optim.AdamW(params, **kw)


def optimizer_case(g: int, copy_gbs: float, dtype):
    """ms of each optimizer variant over one MLP's expert weights."""
    mlp = lpmoe.GroupedMLP(g, HIDDEN, FFN, params_dtype=dtype, device="cuda")
    layers = (mlp.linear_fc1, mlp.linear_fc2)
    params = [p for lin in layers for p in lin.weights]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    for lin in layers:  # what an FP8 forward records (the recipe's weight format)
        lin.weight_cache.wanted = Q2D
    numel = sum(p.numel() for p in params)

    def quantize_all():
        for lin in layers:
            lpmoe.group_quantize(stack_weights(lin.weights), Q2D, num_tensors=len(lin.weights))

    res = {}
    opt = _adamw(params, mlp, True, dtype, lr=1e-4)
    res["lpmoe"] = median_ms(opt.step, warmup=3, iters=7, reps=3)
    before = lpmoe.optim.stats()["fused"]
    opt.step()
    assert lpmoe.optim.stats()["fused"] - before == 2, "the fused path did not run"
    del opt
    _free()
    for name, kw in (("torch+q", {"fused": True}), ("foreach+q", {"foreach": True})):
        topt = _adamw(params, mlp, False, dtype, lr=1e-4, **kw)

        def step():
            topt.step()
            quantize_all()
        res[name] = median_ms(step, warmup=3, iters=7, reps=3)
        del topt
        _free()
    res["copy"] = 30 * numel / copy_gbs / 1e6
    del mlp, params, layers
    _free()
    return numel, res


VARIANTS = (("fp8+lpmoe", Float8BlockScaling(), True), ("fp8+torch", Float8BlockScaling(), False),
            ("bf16+torch", None, False))


def _training_step(g, hidden, ffn, stacked, recipe, fused, x, splits, probs, dy, dtype, compiled=None):
    """(step function, fwd + bwd function, its model) of one variant
    (``compiled``: None, or the torch.compile mode of the model, fullgraph).
    Under "reduce-overhead" the lpmoe-optimizer variant calls its layers
    with is_first_microbatch=False, so the captured forward reads the
    weights the optimizer wrote (a captured default call quantizes)."""
    mlp = lpmoe.GroupedMLP(g, hidden, ffn, params_dtype=dtype, device="cuda", single_grouped_parameter=stacked)
    opt = _adamw(mlp.parameters(), mlp, fused, dtype, lr=1e-5, **({} if fused else {"fused": True}))
    mode = None if compiled in (None, "default") else compiled
    model = torch.compile(mlp, fullgraph=True, mode=mode) if compiled else mlp
    kw = {"is_first_microbatch": False} if fused and mode == "reduce-overhead" else {}

    def fwd_bwd():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)  # fresh gradients, as the MLP benchmarks time it
        x.grad = None
        with torch.autocast("cuda", dtype=BF16), lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x, splits, probs=probs, **kw)
        y.backward(dy)

    def step():
        fwd_bwd()
        opt.step()
    return step, fwd_bwd, mlp


def _peak_gib(step) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def training_case(g: int, tokens: int, hidden: int = HIDDEN, ffn: int = FFN, stacked: bool = False,
                  rounds: int = 5, dtype=torch.float32, fwd_bwd: bool = False, compiled=None):
    """{variant: (ms per fwd + bwd + optimizer step, peak GiB allocated in a
    step: parameters, gradients, optimizer state and FP8 weight caches
    included, each model alone)}.  Where the three models fit at once
    (< 40 GB of fp32 parameters, gradients and moments) their timings
    interleave over ``rounds`` rounds (median of the rounds' medians: a
    launch-bound step is noisy); otherwise one model at a time, one round.
    fwd_bwd: also {variant + " fwd+bwd": (ms, None)} of the fwd + bwd alone
    (no optimizer step in between, so fp8+lpmoe's forward keeps reading the
    FP8 weights of the last one)."""
    if compiled:  # six models per case: start each case under Dynamo's recompile limit
        torch._dynamo.reset()
    splits = torch.tensor(splits_for(g, tokens, False), device="cuda")
    # the experts' input needs its gradient (in a model: the permuted tokens), as in bench_grouped_mlp.py
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16, requires_grad=True)
    probs = torch.rand(tokens, device="cuda")
    dy = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    together = 3 * 16 * 3 * g * hidden * ffn < 40e9
    peaks, times = {}, {name: [] for name, _, _ in VARIANTS}
    if fwd_bwd:
        times.update({name + " fwd+bwd": [] for name, _, _ in VARIANTS})
    for name, recipe, fused in VARIANTS:  # one model at a time: peaks (and timings if they do not fit together)
        step, fb, mlp = _training_step(g, hidden, ffn, stacked, recipe, fused, x, splits, probs, dy, dtype,
                                       compiled)
        step()
        if fused and compiled != "reduce-overhead":  # the forward reads the optimizer's weights (replays: not counted)
            hits = mlp.linear_fc1.weight_cache.hits
            step()
            assert mlp.linear_fc1.weight_cache.hits == hits + 1, "the forward quantized its weights again"
        peaks[name] = _peak_gib(step)
        if not together:
            times[name].append(median_ms(step, warmup=3, iters=5, reps=3))
            if fwd_bwd:
                times[name + " fwd+bwd"].append(median_ms(fb, warmup=3, iters=5, reps=3))
        del step, fb, mlp
        _free()
    made = {}
    if together:
        made = {name: _training_step(g, hidden, ffn, stacked, recipe, fused, x, splits, probs, dy, dtype,
                                     compiled)[:2]
                for name, recipe, fused in VARIANTS}
        for _ in range(rounds):
            for name, (step, fb) in made.items():
                times[name].append(median_ms(step, warmup=2, iters=5, reps=3))
            if fwd_bwd:
                for name, (step, fb) in made.items():
                    times[name + " fwd+bwd"].append(median_ms(fb, warmup=2, iters=5, reps=3))
    out = {name: (statistics.median(times[name]), peaks.get(name)) for name in times}
    del made
    _free()
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--steps", action="store_true", help="also time whole training steps")
    p.add_argument("--params", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 parameters, or bf16 parameters with fp32 master weights")
    p.add_argument("--compile", nargs="?", const="default", choices=("default", "reduce-overhead"),
                   help="training steps of the models under torch.compile(fullgraph=True, mode=...); under "
                        "reduce-overhead the lpmoe-optimizer variant calls with is_first_microbatch=False")
    p.add_argument("--cases", default="0,1,2,3",
                   help="training cases to run: 0 8 x 64k, 1 32 x 16k, 2 launch-bound, 3 launch-bound stacked")
    args = p.parse_args()
    dtype = torch.float32 if args.params == "fp32" else BF16
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy {copy_gbs:.0f} GB/s  params {args.params}")
    rows = []
    for g in ((8,) if args.quick else (8, 32)):
        numel, r = optimizer_case(g, copy_gbs, dtype)
        cells = "  ".join(f"{k} {v:7.2f} ms" for k, v in r.items())
        print(f"optimizer g={g:3d} ({numel / 1e9:.2f} G params) | {cells} | torch+q / lpmoe "
              f"{r['torch+q'] / r['lpmoe']:4.2f}x, foreach+q / lpmoe {r['foreach+q'] / r['lpmoe']:4.2f}x, "
              f"lpmoe at {r['copy'] / r['lpmoe']:4.2f} of copy", flush=True)
        rows.append((f"optimizer g={g} torch+q/lpmoe | of copy",
                     f"{r['torch+q'] / r['lpmoe']:.2f}x | {r['copy'] / r['lpmoe']:.2f}"))
    if args.steps:
        # the two expert-MLP benchmark shapes, and the launch-bound one of
        # bench_compile.py (64 experts x 64 tokens, hidden 2048, ffn 768)
        cases = ((8, 65536, HIDDEN, FFN, False), (32, 16384, HIDDEN, FFN, False),
                 (64, 4096, 2048, 768, False), (64, 4096, 2048, 768, True))
        for g, tokens, hidden, ffn, stacked in (cases[int(i)] for i in args.cases.split(",")):
            r = training_case(g, tokens, hidden, ffn, stacked, dtype=dtype, fwd_bwd=dtype != torch.float32,
                              compiled=args.compile)
            cells = "  ".join(f"{k} {v[0]:7.2f} ms" + (f" {v[1]:5.1f} GiB" if v[1] is not None else "")
                              for k, v in r.items())
            t = {k: v[0] for k, v in r.items()}
            tag = f"g={g} tok={tokens}{' stacked' if stacked else ''}" + (
                f" compiled{'' if args.compile == 'default' else ' ' + args.compile}" if args.compile else "")
            print(f"train step {tag} | {cells} | fp8+torch / fp8+lpmoe "
                  f"{t['fp8+torch'] / t['fp8+lpmoe']:4.2f}x, bf16 / fp8+lpmoe {t['bf16+torch'] / t['fp8+lpmoe']:4.2f}x"
                  f", bf16 / fp8+torch {t['bf16+torch'] / t['fp8+torch']:4.2f}x", flush=True)
            rows.append((f"train step {tag} fp8+torch/fp8+lpmoe | bf16/fp8+lpmoe",
                         f"{t['fp8+torch'] / t['fp8+lpmoe']:.2f}x | {t['bf16+torch'] / t['fp8+lpmoe']:.2f}x"))
            if "fp8+lpmoe fwd+bwd" in t:
                fb = {k[:-8]: v for k, v in t.items() if k.endswith(" fwd+bwd")}
                print(f"  fwd+bwd alone | bf16 / fp8+lpmoe {fb['bf16+torch'] / fb['fp8+lpmoe']:4.2f}x, "
                      f"bf16 / fp8+torch {fb['bf16+torch'] / fb['fp8+torch']:4.2f}x", flush=True)
                rows.append((f"fwd+bwd {tag} bf16/fp8+lpmoe | bf16/fp8+torch",
                             f"{fb['bf16+torch'] / fb['fp8+lpmoe']:.2f}x | {fb['bf16+torch'] / fb['fp8+torch']:.2f}x"))
    write_summary(args.summary, rows)


if __name__ == "__main__":
    main()
