"""``save_original_input`` (GroupedLinear, GroupedMLP, MoELayer; TE's option):
under FP8 block scaling the layer keeps its input itself (or the routed
tokens) for the backward instead of the input's transposed FP8 copy, and
quantizes that copy again before the weight-gradient GEMM.  The bits are the
same; what is kept per token row drops by H + H/32 bytes."""
import pytest
import torch

import lpmoe
from conftest import requires_cuda, saved_storages
from lpmoe.functional import LayerParams, grouped_mlp
from lpmoe.functional.saved import held_bytes
from lpmoe.moe import RoutedTokens, permute_probs, routing_map
from lpmoe.moe import routed_tokens
from lpmoe.recipe import Float8BlockScaling

H, FFN, G = 256, 128, 3


def _mlp(keep: bool, device="cpu", g=G, h=H, f=FFN):
    torch.manual_seed(0)
    return lpmoe.GroupedMLP(g, h, f, params_dtype=torch.bfloat16, device=device, save_original_input=keep)


def _node(y):
    node = y.grad_fn
    while not hasattr(node, "held"):
        node = node.next_functions[0][0]
    return node


def _kept_bytes(fn):
    """(bytes of the distinct storages autograd saves + what the MLP holds, output)."""
    y, seen = saved_storages(fn)
    return sum(seen.values()) + held_bytes(_node(y)), y


def _step(mlp, x, splits, p, recipe, dy_seed=5):
    for t in [x, p] + list(mlp.parameters()):
        t.grad = None
    with lpmoe.autocast(enabled=recipe is not None, recipe=recipe):
        y = mlp(x, splits, probs=p)
    g = torch.Generator().manual_seed(dy_seed)
    y.backward(torch.randn(y.shape, generator=g).to(y.device, y.dtype))
    return [y.detach().clone(), x.grad.clone(), p.grad.clone()] + [w.grad.clone() for w in mlp.parameters()]


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), None], ids=["fp8", "bf16"])
def test_same_bits_with_and_without(recipe):
    x = torch.randn(200, H, dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(200, requires_grad=True)
    splits = [70, 0, 129]
    a = _step(_mlp(True), x, splits, p, recipe)
    b = _step(_mlp(False), x, splits, p, recipe)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), i


def test_grouped_linear_same_bits_and_keeps_the_input():
    torch.manual_seed(1)
    layers = [lpmoe.GroupedLinear(G, H, 64, params_dtype=torch.bfloat16, device="cpu", save_original_input=keep)
              for keep in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(150, H, dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for layer in layers:
        x.grad = None
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y, storages = saved_storages(lambda: layer(x, [50, 50, 50]))
        # the caller's x itself is saved only when asked
        assert (x.untyped_storage().data_ptr() in storages) == layer.save_original_input
        y.float().square().sum().backward()
        outs.append([y.detach(), x.grad.clone()] + [w.grad.clone() for w in layer.weights])
    for u, v in zip(*outs):
        assert torch.equal(u, v)


def test_kept_bytes_per_token_cpu():
    """FP8 keeps per token row: x's transposed copy (H + H/32) by default; with
    the option x itself (2H bf16, the caller's tensor: no new memory), then
    a's transposed copy (F + F/32), h (2 * 2F) and probs (4)."""
    def kept(mlp, tokens):
        x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
        p = torch.rand(tokens, requires_grad=True)

        def run():
            with lpmoe.autocast(recipe=Float8BlockScaling()):
                return mlp(x, [tokens // 2, 0, tokens // 2], probs=p)
        return _kept_bytes(run)[0]

    for keep, own_x in ((False, H + H / 32), (True, 2 * H)):
        mlp = _mlp(keep)
        per_token = (kept(mlp, 512) - kept(mlp, 256)) / 256
        assert per_token == own_x + (FFN + FFN / 32) + 2 * (2 * FFN) + 4, keep


def test_routed_tokens_keep_the_tokens_cpu():
    """With RoutedTokens the MLP saves the tokens (save_for_backward) and
    holds their map for fc1's wgrad, no FP8 copy of the rows; the transposed
    copy is gathered again in the backward (a second gather-quantize), same
    bits."""
    t, k, e = 90, 2, G
    x = torch.randn(t, H, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    rm = routing_map(idx, e)
    probs = torch.rand(t, k, requires_grad=True)
    res = {}
    for keep in (True, False):
        mlp = _mlp(keep)
        for q in [x, probs] + list(mlp.parameters()):
            q.grad = None
        before = routed_tokens.CALLS["reference_permute_quantize"]
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y, storages = saved_storages(lambda: mlp(RoutedTokens(x, rm), None, probs=permute_probs(probs, rm)))
        node = _node(y)
        # kept: the tokens through save_for_backward (hooks see them), the map beside; no FP8 copy held
        assert (x.untyped_storage().data_ptr() in storages) == keep
        assert node.x1_from_source == keep and (node.held["x1"] is None) == keep
        y.backward(torch.ones_like(y))
        assert routed_tokens.CALLS["reference_permute_quantize"] - before == (2 if keep else 1)
        res[keep] = [y.detach(), x.grad.clone(), probs.grad.clone()] + [w.grad.clone() for w in mlp.parameters()]
    for u, v in zip(res[True], res[False]):
        assert torch.equal(u, v)


def test_inplace_change_of_a_kept_input_is_an_error():
    """Keeping x itself means autograd checks it was not modified in place
    before the backward (as in TransformerEngine); the FP8 copy does not."""
    for keep in (True, False):
        torch.manual_seed(0)
        layer = lpmoe.GroupedLinear(G, H, 64, params_dtype=torch.bfloat16, device="cpu", save_original_input=keep)
        inp = torch.randn(60, H, dtype=torch.bfloat16, requires_grad=True)
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y = layer(inp, [20, 20, 20])
        with torch.no_grad():
            inp.mul_(2)
        if keep:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.float().sum().backward()
        else:
            y.float().sum().backward()


def test_rows_made_in_the_call_are_not_kept_cpu(monkeypatch):
    """Routed tokens that fall back to rows (here: the gathering path
    refused) make the rows inside the call: keeping them would cost more
    than the FP8 copy, so fc1 keeps the copy even with the option on."""
    t, k, e = 64, 2, G
    x = torch.randn(t, H, dtype=torch.bfloat16, requires_grad=True)
    rm = routing_map(torch.stack([torch.randperm(e)[:k] for _ in range(t)]), e)

    def kept(keep):
        mlp = _mlp(keep)

        def run():
            with lpmoe.autocast(recipe=Float8BlockScaling()):
                return mlp(RoutedTokens(x, rm), None)
        return _kept_bytes(run)[0]
    monkeypatch.setattr(RoutedTokens, "can_quantize", lambda self, q: False)
    assert kept(True) == kept(False)


def test_moe_layer_option_reaches_only_the_routed_tokens():
    layer = lpmoe.moe.MoELayer(128, 64, 4, 2, device="cpu", params_dtype=torch.bfloat16, save_original_input=True)
    assert layer.save_original_input and not layer.experts.linear_fc1.save_original_input
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(getattr(args[0], "save_original", None)))
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        layer(torch.randn(10, 128, dtype=torch.bfloat16))
    assert seen == [True]


def test_ops_grouped_linear_passes_the_option_and_sequential_keeps_fc2_unfused():
    from lpmoe.functional import mlp as mlp_mod
    torch.manual_seed(0)
    lin = lpmoe.ops.GroupedLinear(G, H, 64, params_dtype=torch.bfloat16, device="cpu", save_original_input=True)
    x = torch.randn(30, H, dtype=torch.bfloat16, requires_grad=True)
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        _, storages = saved_storages(lambda: lin(x, [10, 10, 10]))
    assert x.untyped_storage().data_ptr() in storages
    seq = lpmoe.ops.Sequential(lpmoe.ops.GroupedLinear(G, H, 2 * FFN, params_dtype=torch.bfloat16, device="cpu"),
                               lpmoe.ops.SwiGLU(),
                               lpmoe.ops.GroupedLinear(G, FFN, H, params_dtype=torch.bfloat16, device="cpu",
                                                       save_original_input=True))
    before = mlp_mod.CALLS["grouped_mlp"]
    with lpmoe.autocast(recipe=Float8BlockScaling()):
        seq(x, [10, 10, 10])
    assert mlp_mod.CALLS["grouped_mlp"] == before  # fc2 keeps its input: the chain runs unfused


def test_option_is_checked():
    with pytest.raises(TypeError, match="save_original_input"):
        lpmoe.GroupedLinear(2, 128, 128, device="cpu", save_original_input=1)
    w = [torch.randn(64, 128) for _ in range(2)]
    with pytest.raises(TypeError, match="save_original_input"):
        lpmoe.functional.grouped_linear(torch.randn(4, 128), [2, 2], w, save_original_input="yes")
    with pytest.raises(TypeError, match="fc1.save_original_input"):
        grouped_mlp(torch.randn(4, 128), [2, 2], LayerParams(w, save_original_input=None),
                    LayerParams([torch.randn(128, 32) for _ in range(2)]))
    with pytest.raises(ValueError, match="fc2.save_original_input"):
        grouped_mlp(torch.randn(4, 128), [2, 2], LayerParams(w),
                    LayerParams([torch.randn(128, 32) for _ in range(2)], save_original_input=True))
    with pytest.raises(TypeError, match="save_original_input"):
        lpmoe.moe.MoELayer(128, 64, 4, 2, device="cpu", save_original_input="yes")


# ----------------------------------------------------------------------- GPU
@requires_cuda
def test_gpu_same_bits_and_less_memory_per_token():
    """Bytes kept per token row (saved storages + what the MLP holds,
    counted exactly) drop by x's transposed copy, H + H/32, for the
    caller's x (2H, already alive); the device allocator agrees within its
    block granularity; outputs and gradients are the same bits."""
    h_, f_, g_ = 1024, 512, 8
    recipe = Float8BlockScaling()
    res, kept, alive = {}, {}, {}
    for keep in (True, False):
        mlp = _mlp(keep, "cuda", g_, h_, f_)
        k_, a_ = [], []
        for tokens in (4096, 8192):
            x = torch.randn(tokens, h_, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            splits = torch.full((g_,), tokens // g_, device="cuda")

            def run():
                with lpmoe.autocast(recipe=recipe):
                    return mlp(x, splits)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            nbytes, y = _kept_bytes(run)
            torch.cuda.synchronize()
            a_.append(torch.cuda.memory_allocated() - base)
            k_.append(nbytes)
            mlp.zero_grad(set_to_none=True)
            y.backward(torch.ones_like(y))
            res[(keep, tokens)] = [y.detach(), x.grad] + [w.grad.clone() for w in mlp.parameters()]
            del y
        kept[keep] = (k_[1] - k_[0]) / 4096
        alive[keep] = (a_[1] - a_[0]) / 4096
    for tokens in (4096, 8192):
        for u, v in zip(res[(True, tokens)], res[(False, tokens)]):
            assert torch.equal(u, v)
    assert kept[False] - kept[True] == (h_ + h_ / 32) - 2 * h_
    assert alive[False] - alive[True] == pytest.approx(h_ + h_ / 32, rel=0.15)


@requires_cuda
def test_gpu_grouped_linear_uneven_splits_same_bits():
    """GroupedLinear on the GPU with the option on and off: uneven members
    (empty, single rows, 128 +- 1), a capacity tail and a partial 128-column
    tile (K 208); outputs, input and weight gradients bitwise."""
    torch.manual_seed(0)
    layers = [lpmoe.GroupedLinear(5, 208, 96, params_dtype=torch.bfloat16, device="cuda", save_original_input=keep)
              for keep in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    splits = torch.tensor([0, 1, 127, 129, 40], device="cuda")
    x = torch.randn(320, 208, dtype=torch.bfloat16, device="cuda", requires_grad=True)  # 23 tail rows
    dy = torch.randn(320, 96, dtype=torch.bfloat16, device="cuda")
    outs = []
    for layer in layers:
        x.grad = None
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y = layer(x, splits)
        y.backward(dy)
        outs.append([y.detach(), x.grad.clone()] + [w.grad.clone() for w in layer.weights])
    for i, (u, v) in enumerate(zip(*outs)):
        assert torch.equal(u, v), i


@requires_cuda
def test_gpu_routed_tokens_keep_the_tokens_graph_and_bits():
    """The MoE layer with save_original_input: same bits as without, the
    gathering quantize ran twice per step, and a captured step replays with
    new routing under sync-debug error."""
    from conftest import capture_graph
    h_, f_, e, k, t = 256, 128, 8, 2, 512
    recipe = Float8BlockScaling()
    layers = []
    for keep in (True, False):
        torch.manual_seed(0)
        layers.append(lpmoe.moe.MoELayer(h_, f_, e, k, device="cuda", params_dtype=torch.bfloat16,
                                         save_original_input=keep))
    x = torch.randn(t, h_, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(layer):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with lpmoe.autocast(recipe=recipe):
            y = layer(x)
        y.backward(torch.ones_like(y))
        return (y.detach(), x.grad) + tuple(p.grad for p in layer.parameters())

    before = routed_tokens.CALLS["kernel_permute_quantize"]
    a = step(layers[0])
    # fc1's input, its transposed copy again for wgrad, fc2's output gradient in two passes
    assert routed_tokens.CALLS["kernel_permute_quantize"] - before == 4
    b = step(layers[1])
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, static = capture_graph(lambda: step(layers[0]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.data.copy_(torch.randn_like(x))  # new tokens: new routing
        graph.replay()
        want = step(layers[1])
        for u, v in zip(static, want):
            assert torch.equal(u, v)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_compiled_layer_keeps_its_input_cpu(kind, monkeypatch):
    """Under torch.compile the layer op saves x itself (an op input, by
    reference) instead of its transposed FP8 copy; same bits as eager."""
    from test_moe_routed_compile import saved_x_entries
    torch.manual_seed(1)
    if kind == "mlp":
        layer = _mlp(True)
    else:
        layer = lpmoe.GroupedLinear(G, H, FFN, params_dtype=torch.bfloat16, device="cpu", save_original_input=True)
    x = torch.randn(96, H, dtype=torch.bfloat16)
    splits = torch.tensor([32, 0, 64])
    gy = torch.randn(96, H if kind == "mlp" else FFN, dtype=torch.bfloat16)

    def step(fn):
        xi = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        with lpmoe.autocast(recipe=Float8BlockScaling()):
            y = fn(xi, splits)
        y.backward(gy)
        return [y.detach(), xi.grad] + [p.grad.clone() for p in layer.parameters()]
    want = step(layer)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = []
    assert saved_x_entries(monkeypatch, lambda: got.extend(step(compiled))) == [("t", ("in", "x"))]
    for i, (u, v) in enumerate(zip(got, want)):
        assert torch.equal(u, v), i
