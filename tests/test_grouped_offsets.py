import pytest
import torch

from conftest import poison_allocator, requires_cuda
from lpmoe.grouped_offsets import splits_to_offsets


def _manual(splits, stride, align, second=None):
    out = [0]
    for i, s in enumerate(splits):
        v = -(-max(s, 0) // align) * align * stride
        if second is not None:
            v *= max(second[i], 0)
        out.append(out[-1] + v)
    return out


CASES = [
    [0],
    [5],
    [0, 0, 7, 0],
    [1, 127, 128, 129, 1000],
    list(range(128)),
]


@pytest.mark.parametrize("splits", CASES)
def test_cpu_offsets_match_manual(splits):
    s = torch.tensor(splits, dtype=torch.int64)
    strides, aligns = [1, 7168, 1, 1, 1], [1, 1, 4, 128, 512]
    res = splits_to_offsets(s, strides, aligns)
    for o, st, al in zip(res.offsets, strides, aligns):
        assert o.dtype == torch.int64 and o.numel() == len(splits) + 1
        assert o.tolist() == _manual(splits, st, al)
    assert int(res.status) == 0


def test_cpu_totals_above_int32():
    s = torch.tensor([2**30, 2**30, 3], dtype=torch.int32)
    res = splits_to_offsets(s, [7168], [1])
    assert res.offsets[0].tolist() == [0, 7168 * 2**30, 7168 * 2**31, 7168 * (2**31 + 3)]


def test_cpu_uniform_and_second():
    res = splits_to_offsets(None, [3], [4], num_splits=3, uniform_split=5, device="cpu")
    assert res.offsets[0].tolist() == [0, 24, 48, 72]
    res = splits_to_offsets(torch.tensor([2, 3]), [1], [1], second=torch.tensor([10, 20]), times_second=[True])
    assert res.offsets[0].tolist() == [0, 20, 80]


def test_status_flags_cpu():
    res = splits_to_offsets(torch.tensor([3, -1, 2]), [1], [1], capacity_rows=4)
    assert int(res.status) == 3  # negative and above capacity
    assert res.offsets[0].tolist() == [0, 3, 3, 4]  # negatives clamp to 0, truncated at capacity
    with pytest.raises(ValueError, match="negative"):
        res.check()


def test_validation_errors():
    with pytest.raises(TypeError, match="int32 or int64"):
        splits_to_offsets(torch.tensor([1.0, 2.0]), [1])
    with pytest.raises(ValueError, match="1-D"):
        splits_to_offsets(torch.ones(2, 2, dtype=torch.int64), [1])
    with pytest.raises(ValueError, match="same length"):
        splits_to_offsets(torch.tensor([1]), [1, 2], [1])
    with pytest.raises(ValueError, match="aligns"):
        splits_to_offsets(torch.tensor([1]), [1], [0])
    with pytest.raises(ValueError, match="num_splits"):
        splits_to_offsets(None, [1], [1], uniform_split=3)
    with pytest.raises(ValueError, match="capacity_rows"):
        splits_to_offsets(torch.tensor([1]), [1], [1], capacity_rows=-1)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 7, 128, 1000, 1537])
def test_gpu_matches_cpu(n, dtype):
    g = torch.Generator().manual_seed(n)
    s = torch.randint(0, 3000, (n,), generator=g, dtype=torch.int64)
    s[::5] = 0
    strides, aligns = [1, 7168, 1, 1, 1, 1], [1, 1, 4, 128, 512, 1]
    second = torch.randint(0, 50, (n,), generator=g)
    ts = [False] * 5 + [True]
    cpu = splits_to_offsets(s.to(dtype), strides, aligns, second=second, times_second=ts, capacity_rows=10**9)
    gpu = splits_to_offsets(s.to(dtype).cuda(), strides, aligns, second=second.cuda(), times_second=ts,
                            capacity_rows=10**9)
    for a, b in zip(cpu.offsets, gpu.offsets):
        assert b.is_cuda and b.data_ptr() % 16 == 0
        assert torch.equal(a, b.cpu())
    assert int(gpu.status) == 0


@requires_cuda
@pytest.mark.parametrize("n,cut", [(31, 0.66), (32, 0.66), (33, 0.66), (65, 0.66), (300, 0.66),
                                   (1025, 0.9), (1537, 0.8), (2100, 0.6)])
@pytest.mark.parametrize("second_dtype", [torch.int64, torch.int32])
def test_gpu_warps_chunks_capacity_cut_and_odd_aligns(n, cut, second_dtype):
    """One warp (31, 32 members), several (33-300), and chunks of 1024 with
    carries (1025-2100): a capacity that cuts inside the block or in a later
    chunk, aligns that are not powers of two, negative sizes in both arrays,
    an int32 second array; the allocator's free blocks poisoned first."""
    g = torch.Generator().manual_seed(1000 + n)
    s = torch.randint(0, 700, (n,), generator=g, dtype=torch.int64)
    s[::7] = 0
    s[n // 3] = -5
    second = torch.randint(0, 9, (n,), generator=g)
    second[n // 2] = -1
    strides, aligns = [1, 3, 1, 1, 1, 1], [1, 1, 3, 96, 128, 1000]
    ts = [False, False, False, False, False, True]
    cap = int(int(s.clamp(min=0).sum()) * cut)
    cpu = splits_to_offsets(s, strides, aligns, second=second.to(second_dtype), times_second=ts, capacity_rows=cap)
    s_gpu, second_gpu = s.cuda(), second.to(second_dtype).cuda()
    poison_allocator()
    gpu = splits_to_offsets(s_gpu, strides, aligns, second=second_gpu, times_second=ts, capacity_rows=cap)
    for a, b in zip(cpu.offsets, gpu.offsets):
        assert torch.equal(a, b.cpu())
    assert int(gpu.status) == int(cpu.status) == 3  # a negative size, and above capacity


@requires_cuda
def test_gpu_no_members_and_uniform_sizes():
    poison_allocator()
    res = splits_to_offsets(torch.zeros(0, dtype=torch.int64, device="cuda"), [5, 1], [1, 128], capacity_rows=0)
    assert [o.cpu().tolist() for o in res.offsets] == [[0], [0]] and int(res.status) == 0
    for n in (3, 40, 1030):
        cpu = splits_to_offsets(None, [7, 1], [1, 64], num_splits=n, uniform_split=100, device="cpu")
        gpu = splits_to_offsets(None, [7, 1], [1, 64], num_splits=n, uniform_split=100, device="cuda")
        for a, b in zip(cpu.offsets, gpu.offsets):
            assert torch.equal(a, b.cpu())


@requires_cuda
def test_gpu_totals_above_int32_and_status():
    s = torch.tensor([2**30, 2**30, 3], dtype=torch.int32, device="cuda")
    res = splits_to_offsets(s, [7168], [1])
    assert res.offsets[0].cpu().tolist() == [0, 7168 * 2**30, 7168 * 2**31, 7168 * (2**31 + 3)]
    res = splits_to_offsets(s, [1, 1], [1, 128], capacity_rows=2**31)
    assert int(res.status) == 2
    assert res.offsets[0].cpu().tolist() == [0, 2**30, 2**31, 2**31]  # truncated at capacity
    assert res.offsets[1].cpu().tolist() == [0, 2**30, 2**31, 2**31]
    res = splits_to_offsets(torch.tensor([1, -4], device="cuda"), [1], [1])
    assert int(res.status) & 1


@requires_cuda
def test_gpu_no_sync_and_graph_capture():
    s = torch.tensor([3, 0, 130, 7], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = splits_to_offsets(s, [16, 1], [1, 128])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert res.offsets[1].cpu().tolist() == [0, 128, 128, 384, 512]

    # Capture once, then change the splits in place and replay.
    g = torch.cuda.CUDAGraph()
    splits_to_offsets(s, [16, 1], [1, 128])  # warm-up outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        cap = splits_to_offsets(s, [16, 1], [1, 128])
    s.copy_(torch.tensor([1, 2, 3, 200], device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert cap.offsets[0].cpu().tolist() == [0, 16, 48, 96, 3296]
    assert cap.offsets[1].cpu().tolist() == [0, 128, 256, 384, 640]
