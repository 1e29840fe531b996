import pytest
import torch

from conftest import requires_cuda
from lpmoe import Float8BlockQuantizer, GroupedTensor, MXFP8Quantizer, NVFP4Quantizer, ShapeKind
from lpmoe.grouped_layout import capacity_sizes, member_sizes


def test_from_dense_varying_first_wraps_without_copy():
    x = torch.randn(10, 32)
    fd = torch.tensor([3, 0, 5], dtype=torch.int32)
    g = GroupedTensor.from_dense(x, first_dims=fd)
    assert g.shape_kind is ShapeKind.VARYING_FIRST
    assert g.rowwise_data.data_ptr() == x.data_ptr()
    assert g.first_dims.dtype == torch.int64 and g.last_dims is None
    assert g.tensor_offsets.tolist() == [0, 96, 96, 256]
    assert g.padded_row_offsets.tolist() == [[0, 3, 3, 8], [0, 4, 4, 12], [0, 64, 64, 128], [0, 128, 128, 256],
                                            [0, 512, 512, 1024]]
    parts = g.split()
    assert [tuple(p.shape) for p in parts] == [(3, 32), (0, 32), (5, 32)]
    assert torch.equal(parts[2], x[3:8])
    assert g.logical_shape == (10, 32)  # rows 8, 9 are capacity tail


def test_same_shape():
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    g = GroupedTensor.from_dense(x, num_tensors=3)
    assert g.shape_kind is ShapeKind.SAME_SHAPE
    assert g.tensor_offsets.tolist() == [0, 64, 128, 192]
    assert g.member_shapes() == [(4, 16)] * 3
    with pytest.raises(ValueError, match="not divisible"):
        GroupedTensor.from_dense(torch.randn(10, 16), num_tensors=3)


def test_from_tensors_all_kinds():
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    g = GroupedTensor.from_tensors([a, b])
    assert g.shape_kind is ShapeKind.VARYING_FIRST and g.logical_shape == (5, 4)
    c = torch.randn(2, 6)
    g = GroupedTensor.from_tensors([a, c])
    assert g.shape_kind is ShapeKind.VARYING_LAST and g.logical_shape == (2, 10)
    assert g.tensor_offsets.tolist() == [0, 8, 20]
    assert [tuple(t.shape) for t in g.split()] == [(2, 4), (2, 6)]
    assert torch.equal(g.split()[1], c)
    d = torch.randn(5, 3)
    g = GroupedTensor.from_tensors([a, d, torch.randn(0, 7)])
    assert g.shape_kind is ShapeKind.VARYING_BOTH and g.logical_shape == (1, 23)
    assert g.tensor_offsets.tolist() == [0, 8, 23, 23]
    assert torch.equal(g.split()[1], d)
    g = GroupedTensor.from_tensors([a, a.clone()])
    assert g.shape_kind is ShapeKind.SAME_SHAPE


def test_many_groups_and_large_totals():
    fd = torch.full((128,), 3, dtype=torch.int64)
    g = GroupedTensor.from_dense(torch.zeros(384, 8), first_dims=fd)
    assert g.tensor_offsets[-1].item() == 384 * 8
    # Offsets beyond 2**31 elements: metadata only (no data of that size).
    huge = torch.zeros(1, dtype=torch.bfloat16).expand(2**33)  # 2^33 elements, no memory
    big = GroupedTensor(num_tensors=2, logical_shape=(2**21, 4096), dtype=torch.bfloat16, rowwise_data=huge,
                        first_dims=torch.tensor([2**20, 2**20]))
    assert big.tensor_offsets.tolist() == [0, 2**32, 2**33]


@pytest.mark.parametrize("bad, err, match", [
    (dict(first_dims=torch.tensor([1.0, 2.0])), TypeError, "int32 or int64"),
    (dict(first_dims=torch.tensor([1, 2, 3])), ValueError, "num_tensors=2"),
    (dict(first_dims=torch.tensor([[1, 2]])), ValueError, "1-D"),
    (dict(first_dims=torch.tensor([1, -2])), ValueError, "non-negative"),
    (dict(first_dims=torch.tensor([4, 4])), ValueError, "exceeds"),
    (dict(tensor_offsets=torch.tensor([0, 1])), ValueError, "num_tensors\\+1"),
    (dict(tensor_offsets=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, "int64"),
    (dict(num_tensors=0), ValueError, "positive"),
    (dict(logical_shape=(6,)), ValueError, "2-D"),
    (dict(dtype=torch.int8), TypeError, "high-precision"),
    (dict(rowwise_data=torch.zeros(23)), ValueError, "needs 24"),
    (dict(rowwise_data=torch.zeros(24, dtype=torch.float16)), TypeError, "group's dtype"),
])
def test_validation_errors(bad, err, match):
    kwargs = dict(num_tensors=2, logical_shape=(6, 4), dtype=torch.float32, rowwise_data=torch.zeros(24),
                  first_dims=torch.tensor([2, 3]))
    kwargs.update(bad)
    with pytest.raises(err, match=match):
        GroupedTensor(**kwargs)


def test_from_dense_errors():
    with pytest.raises(ValueError, match="2-D"):
        GroupedTensor.from_dense(torch.zeros(4), num_tensors=1)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        GroupedTensor.from_dense(torch.zeros(4, 4, dtype=torch.int32), num_tensors=1)
    with pytest.raises(ValueError, match="contiguous"):
        GroupedTensor.from_dense(torch.zeros(4, 4).t(), num_tensors=1)
    with pytest.raises(ValueError, match="num_tensors or first_dims"):
        GroupedTensor.from_dense(torch.zeros(4, 4))


def test_member_sizes_follow_quantizer_shapes():
    q = Float8BlockQuantizer(block_dim=1)
    s = member_sizes(q, 129, 144)
    assert s["rowwise_data"] == 129 * 144
    assert s["columnwise_data"] == 144 * 256  # tokens padded to 128
    assert s["scale_inv"] == 2 * 132 and s["columnwise_scale_inv"] == 2 * 144
    q2 = Float8BlockQuantizer(block_dim=2)
    s = member_sizes(q2, 129, 144)
    assert s["scale_inv"] == 2 * 4 and s["columnwise_scale_inv"] == 2 * 4
    m = member_sizes(MXFP8Quantizer(), 64, 160)
    assert m["scale_inv"] == 128 * 8 and m["columnwise_scale_inv"] == 4 * 256
    f = member_sizes(NVFP4Quantizer(), 32, 64)
    assert f["rowwise_data"] == 32 * 32 and f["columnwise_data"] == 64 * 16 and f["amax"] == 1


@pytest.mark.parametrize("q", [Float8BlockQuantizer(block_dim=1), Float8BlockQuantizer(block_dim=2),
                               MXFP8Quantizer(), NVFP4Quantizer()])
def test_capacity_bounds_any_split(q):
    # The varying-first capacity must hold the concatenated member layouts of
    # any split; check adversarial splits (many tiny members, empties).
    n, rows, k = 5, 160, 256
    cap = capacity_sizes(q, n, rows, k, uniform=False)
    for splits in ([16] * 5, [0, 0, 0, 0, 160], [144, 16, 0, 0, 0], [32, 32, 32, 32, 32]):
        tot = {}
        for m in splits:
            for b, v in member_sizes(q, m, k).items():
                tot[b] = tot.get(b, 0) + v
        for b, v in tot.items():
            assert v <= cap[b], (b, splits)


def test_empty_allocates_for_quantizer():
    q = Float8BlockQuantizer(block_dim=1, columnwise=False)
    g = GroupedTensor.empty(q, 4, (512, 256), first_dims=torch.tensor([100, 0, 300, 12]), device="cpu")
    assert g.columnwise_data is None and g.rowwise_data.dtype == torch.float8_e4m3fn
    assert g.scale_inv.dtype == torch.float32
    views = g.split()
    assert views[0]["rowwise_data"].shape == (100, 256) and views[0]["scale_inv"].shape == (2, 100)
    assert views[3]["scale_inv"].shape == (2, 12)


@requires_cuda
def test_gpu_offsets_no_sync():
    x = torch.randn(1000, 128, device="cuda", dtype=torch.bfloat16)
    fd = torch.tensor([100, 0, 513, 7], device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g = GroupedTensor.from_dense(x, first_dims=fd)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert g.tensor_offsets.cpu().tolist() == [0, 12800, 12800, 78464, 79360]
    assert g.padded_row_offsets.cpu().tolist()[3] == [0, 128, 128, 768, 896]
    g.check_device_metadata()
    bad = GroupedTensor.from_dense(x, first_dims=torch.tensor([900, 200], device="cuda"))
    with pytest.raises(ValueError, match="exceeds"):
        bad.check_device_metadata()


def test_caller_padded_row_offsets_are_recomputed():
    # Derived metadata cannot be injected: kernels index buffers with it.
    bogus = torch.full((5, 3), 10**6, dtype=torch.int64)
    g = GroupedTensor(num_tensors=2, logical_shape=(6, 4), dtype=torch.float32, rowwise_data=torch.zeros(24),
                      first_dims=torch.tensor([2, 3]), padded_row_offsets=bogus)
    assert g.padded_row_offsets.tolist()[0] == [0, 2, 5]


def test_quantized_buffers_checked():
    q = Float8BlockQuantizer()
    fd = torch.tensor([100, 28])
    good = GroupedTensor.empty(q, 2, (128, 256), first_dims=fd, device="cpu")
    with pytest.raises(TypeError, match="scale_inv has dtype"):
        GroupedTensor(num_tensors=2, logical_shape=(128, 256), dtype=torch.bfloat16, quantizer=q,
                      rowwise_data=good.rowwise_data, scale_inv=good.scale_inv.view(torch.uint8), first_dims=fd)
    with pytest.raises(ValueError, match="columnwise_data holds"):
        GroupedTensor(num_tensors=2, logical_shape=(128, 256), dtype=torch.bfloat16, quantizer=q,
                      columnwise_data=good.columnwise_data[:100], first_dims=fd)


def test_from_tensors_all_empty_members_of_different_width():
    g = GroupedTensor.from_tensors([torch.zeros(0, 3), torch.zeros(0, 5)])
    assert g.shape_kind is ShapeKind.VARYING_LAST and g.logical_shape == (0, 8)


def _count_offset_launches(monkeypatch):
    calls = []
    launch = GroupedTensor._launch_offsets

    def counted(self, *args):
        calls.append(self.logical_shape)
        return launch(self, *args)
    monkeypatch.setattr(GroupedTensor, "_launch_offsets", counted)
    return calls


def test_sharing_offsets_scope(monkeypatch):
    from lpmoe.grouped_tensor import sharing_offsets
    calls = _count_offset_launches(monkeypatch)
    dims = torch.tensor([3, 0, 5])
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    a, b = GroupedTensor.from_dense(x, first_dims=dims), GroupedTensor.from_dense(y, first_dims=dims)
    assert len(calls) == 2 and a.tensor_offsets is not b.tensor_offsets  # outside a scope: one launch each
    with sharing_offsets():
        c, d = GroupedTensor.from_dense(x, first_dims=dims), GroupedTensor.from_dense(y, first_dims=dims)
        # another width: the same row offsets, its element offsets derived from them (no offsets launch)
        e = GroupedTensor.from_dense(torch.randn(10, 6), first_dims=dims)
        e2 = GroupedTensor.from_dense(torch.randn(10, 6), first_dims=dims)
        mine = torch.tensor([0, 21, 21, 56])  # caller-given element offsets are kept as given
        given = GroupedTensor(num_tensors=3, logical_shape=(10, 7), dtype=torch.float32,
                              rowwise_data=torch.randn(70), first_dims=dims, tensor_offsets=mine)
        f = GroupedTensor.from_dense(x, first_dims=dims.clone())  # other dims object: not assumed equal
        h = GroupedTensor.from_dense(torch.randn(9, 4), first_dims=dims)  # other rows (capacity): its own
        with sharing_offsets():  # an inner scope starts empty
            g = GroupedTensor.from_dense(x, first_dims=dims)
    assert len(calls) == 2 + 4
    assert c.tensor_offsets is d.tensor_offsets and c.padded_row_offsets is d.padded_row_offsets
    assert c.offsets_status is d.offsets_status
    assert e.padded_row_offsets is c.padded_row_offsets and e.offsets_status is c.offsets_status
    for other in (e, f, g, h):
        assert other.tensor_offsets is not c.tensor_offsets
    assert torch.equal(c.tensor_offsets, a.tensor_offsets) and torch.equal(c.padded_row_offsets, a.padded_row_offsets)
    assert torch.equal(e.tensor_offsets, torch.tensor([0, 18, 18, 48]))
    assert e.tensor_offsets.dtype == torch.int64 and e.tensor_offsets.is_contiguous()
    assert e2.tensor_offsets is e.tensor_offsets  # derived once per width in the scope
    assert given.tensor_offsets is mine and given.padded_row_offsets is c.padded_row_offsets
    GroupedTensor.from_dense(x, first_dims=dims)
    assert len(calls) == 7  # the scope is gone


def test_mlp_call_shares_offsets(monkeypatch):
    """A GroupedMLP forward and backward each compute the offsets of their
    routing once (bf16, CPU: x and dy are H wide; the activation and its
    gradient, F wide, derive theirs from the same row offsets); the stacked
    bf16 weights go to the GEMMs as plain tensors and need none."""
    import lpmoe
    torch.manual_seed(0)
    mlp = lpmoe.GroupedMLP(3, 32, 16, device="cpu", single_grouped_parameter=True)
    x = torch.randn(20, 32, requires_grad=True)
    calls = _count_offset_launches(monkeypatch)
    y = mlp(x, torch.tensor([7, 0, 13]))
    assert calls == [(20, 32)]
    calls.clear()
    y.sum().backward()
    assert calls == [(20, 32)]  # dy; a's transposed width derives


def _count_inits(monkeypatch):
    calls = []
    real = GroupedTensor.__init__

    def counting(self, **kw):
        calls.append(kw.get("quantizer"))
        real(self, **kw)
    monkeypatch.setattr(GroupedTensor, "__init__", counting)
    return calls


@pytest.mark.parametrize("columnwise", [False, True])
def test_direction_view_is_a_trusted_copy_of_one_side(monkeypatch, columnwise):
    """A direction view keeps one side's buffers and every piece of metadata
    of its (validated) source, built without the checking constructor."""
    import lpmoe
    x = torch.randn(300, 256, dtype=torch.bfloat16)
    g = lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=1), num_tensors=3,
                             first_dims=torch.tensor([100, 0, 200]))
    calls = _count_inits(monkeypatch)
    v = g.direction_view(columnwise)
    assert calls == []
    kept = ("columnwise_data", "columnwise_scale_inv") if columnwise else ("rowwise_data", "scale_inv")
    dropped = ("rowwise_data", "scale_inv") if columnwise else ("columnwise_data", "columnwise_scale_inv")
    for f in kept + ("first_dims", "tensor_offsets", "padded_row_offsets", "amax"):
        assert getattr(v, f) is getattr(g, f), f
    assert all(getattr(v, f) is None for f in dropped)
    assert (v.num_tensors, v.logical_shape, v.dtype) == (g.num_tensors, g.logical_shape, g.dtype)
    assert v.quantizer == g.quantizer.copy(rowwise=not columnwise, columnwise=columnwise)
    assert v.offsets_status is g.offsets_status
    for mv, mg in zip(v.split(), g.split()):  # the members' views of the kept side are the same
        for k in kept:  # (an empty member has no views)
            a, b = mv[k], mg[k]
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                            b.view(torch.uint8) if b.element_size() == 1 else b)
        assert all(mv.get(k) is None for k in dropped)


@requires_cuda
def test_fp8_quantize_output_is_built_trusted_gpu(monkeypatch):
    """group_quantize on the GPU builds its input group (checked) and its
    output through the trusted path (buffers sized from the layout, the
    input's metadata): one checking construction per call."""
    import lpmoe
    x = torch.randn(300, 256, dtype=torch.bfloat16, device="cuda")
    first = torch.tensor([100, 0, 200], device="cuda")
    ref = lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=1), num_tensors=3, first_dims=first)
    calls = _count_inits(monkeypatch)
    out = lpmoe.group_quantize(x, Float8BlockQuantizer(block_dim=1), num_tensors=3, first_dims=first)
    assert calls == [None]  # the high-precision input group only
    for f in ("rowwise_data", "scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert getattr(out, f).shape == getattr(ref, f).shape and getattr(out, f).dtype == getattr(ref, f).dtype
    assert out.tensor_offsets is not None and out.padded_row_offsets is not None
    for f in ("rowwise_data", "columnwise_data"):  # the same bits through the dequantize of either side
        a = lpmoe.group_dequantize(out.direction_view(f == "columnwise_data"))
        b = lpmoe.group_dequantize(ref.direction_view(f == "columnwise_data"))
        assert torch.equal(a.rowwise_data[:300 * 256], b.rowwise_data[:300 * 256])


def test_direction_view_can_keep_the_other_scales():
    """A transposed-only view of FP8 128x128 weights that keeps the rowwise
    scales (what the FP8 backward saves: its dgrad GEMM reads them) holds no
    rowwise data, and the GEMM's weight operand takes those scales as they
    are instead of rebuilding them from the columnwise ones."""
    import lpmoe
    from lpmoe.gemm.operands import parse_operands
    from lpmoe.gemm.weight_operands import fp8_weight_operand
    w = torch.randn(3 * 256, 384, dtype=torch.bfloat16)
    g = lpmoe.group_quantize(w, Float8BlockQuantizer(block_dim=2), num_tensors=3)
    v = g.direction_view(columnwise=True, keep_other_scales=True)
    assert v.rowwise_data is None and v.scale_inv is g.scale_inv
    assert v.columnwise_data is g.columnwise_data and v.columnwise_scale_inv is g.columnwise_scale_inv
    plain = g.direction_view(columnwise=True)
    dy = lpmoe.group_quantize(torch.randn(40, 256, dtype=torch.bfloat16), Float8BlockQuantizer(block_dim=1),
                              num_tensors=3, first_dims=torch.tensor([10, 0, 30]))
    kept = fp8_weight_operand(parse_operands(dy, v, "dgrad"), "rowwise")
    rebuilt = fp8_weight_operand(parse_operands(dy, plain, "dgrad"), "rowwise")
    assert kept[2] is g.scale_inv and rebuilt[2] is not g.scale_inv
    assert kept[3] == rebuilt[3] and torch.equal(kept[2], rebuilt[2])  # the same numbers either way


def test_fp8_backward_saves_weights_with_their_rowwise_scales():
    from lpmoe.functional.weights import WeightSource
    from lpmoe.policy import Needs, Tokens, policy_for
    from lpmoe.recipe import Float8BlockScaling
    pol = policy_for(Float8BlockScaling())
    x = torch.randn(20, 256, dtype=torch.bfloat16)
    ws = WeightSource(torch.randn(2, 128, 256, dtype=torch.bfloat16), None, None, True)
    fw = pol.forward(Tokens(hp=x), ws, _Splits(torch.tensor([5, 15])), Needs(dgrad=True, wgrad=True, dbias=False))
    assert fw.saved_w.rowwise_data is None and fw.saved_w.scale_inv is fw.w.scale_inv
    assert fw.saved_w.columnwise_data is fw.w.columnwise_data


class _Splits:
    def __init__(self, device_splits):
        self.device, self.num = device_splits, device_splits.numel()


@pytest.mark.parametrize("seed", range(20))
def test_element_offsets_are_row_offsets_times_width(seed):
    """What sharing row offsets across widths rests on: for token-row groups
    the kernel's element offsets equal its align-1 row offsets times the
    width, capacity truncation and negative (inconsistent) splits included,
    and the status does not depend on the width.  (The CPU arithmetic is the
    kernel's: tests/test_grouped_offsets.py compares them on the GPU.)"""
    from lpmoe.grouped_layout import PADDED_ROW_ALIGNS
    from lpmoe.grouped_offsets import offsets_bulk, offsets_pitch
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    splits = torch.randint(-3, 40, (n,), generator=g)
    rows = int(torch.randint(0, 120, (1,), generator=g))
    pitch = offsets_pitch(n)
    aligns = [1] + list(PADDED_ROW_ALIGNS)
    results = {}
    for width in (1, 7, 256):
        bulk = offsets_bulk(splits, n, 0, [width] + [1] * len(PADDED_ROW_ALIGNS), aligns, [False] * len(aligns),
                            None, rows, torch.device("cpu"))
        elements, row1 = bulk[:n + 1], bulk[pitch:pitch + n + 1]
        assert torch.equal(elements, row1 * width)
        results[width] = (bulk[pitch:pitch * len(aligns)], bulk[pitch * len(aligns)])
    assert all(torch.equal(r[0], results[1][0]) and int(r[1]) == int(results[1][1]) for r in results.values())
