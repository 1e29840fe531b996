#include "grouped/splits_to_offsets.h"

#include "common/cuda_utils.h"

namespace lpmoe {
namespace grouped {
namespace {

constexpr int kLanes = 32;
constexpr int kMaxThreads = 1024;
constexpr int kMaxWarps = kMaxThreads / kLanes;
constexpr unsigned kFull = 0xffffffffu;

// One block, one thread per member (chunks of blockDim members when there
// are more, the sums so far carried in by the chunk's first thread), and
// every output scanned in the same pass: warp shuffles, then one
// shared-memory step across the warps (none with a single warp).  The
// previous kernel ran a 512-thread CUB BlockScan per output in turn, each
// with its own barriers: 4.7 us per launch for 8 to 256 members on the H100,
// 8.5 for 1024; this one 2.5 up to 32 members, 3.3-3.6 up to 256, 6.5 for
// 1024 (tools/offsets_ablation, graph-replayed launches).  Integer sums: the
// same values in any order.

__device__ __forceinline__ int64_t load_size(const void* p, bool is_int64, int i) {
  return is_int64 ? __ldg(static_cast<const int64_t*>(p) + i)
                  : static_cast<int64_t>(__ldg(static_cast<const int32_t*>(p) + i));
}

// Inclusive sums of v[0..N) over the block's threads, all N scanned together;
// total[j] = the block's sum.  `ws` is shared scratch of N x kMaxWarps.
// Every thread of the block must call it (it has barriers unless the block
// is one warp).
template <int N>
__device__ __forceinline__ void block_inclusive_sums(int64_t (&v)[N], int64_t (&total)[N], int64_t (*ws)[kMaxWarps]) {
  const int lane = threadIdx.x % kLanes;
  const int warp = threadIdx.x / kLanes;
  const int warps = blockDim.x / kLanes;
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const int64_t u = __shfl_up_sync(kFull, v[j], o);
      if (lane >= o) v[j] += u;
    }
  }
  if (warps == 1) {  // up to 32 members: no cross-warp step
#pragma unroll
    for (int j = 0; j < N; ++j) total[j] = __shfl_sync(kFull, v[j], kLanes - 1);
    return;
  }
  if (lane == kLanes - 1) {
#pragma unroll
    for (int j = 0; j < N; ++j) ws[j][warp] = v[j];
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of the warp sums, in place
#pragma unroll
    for (int j = 0; j < N; ++j) {
      int64_t w = lane < warps ? ws[j][lane] : 0;
#pragma unroll
      for (int o = 1; o < kLanes; o <<= 1) {
        const int64_t u = __shfl_up_sync(kFull, w, o);
        if (lane >= o) w += u;
      }
      if (lane < warps) ws[j][lane] = w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (warp > 0) v[j] += ws[j][warp - 1];
    total[j] = ws[j][warps - 1];
  }
  __syncthreads();  // the scratch is reused by the next call
}

// round_up(x, align) * stride [* second], x >= 0; power-of-two aligns (all
// of lpmoe's layouts) by a mask, others by a division.
__device__ __forceinline__ int64_t member_value(const OffsetOutput& o, int64_t x, int64_t second) {
  const int64_t a = o.align;
  const int64_t r = (a & (a - 1)) == 0 ? (x + a - 1) & ~(a - 1) : round_up<int64_t>(x, a);
  const int64_t v = r * o.stride;
  return o.times_second ? v * second : v;
}

__global__ void __launch_bounds__(kMaxThreads) splits_to_offsets_kernel(const SplitsToOffsetsArgs args) {
  __shared__ int64_t ws[kMaxOffsetOutputs][kMaxWarps];
  __shared__ int negative;
  if (threadIdx.x == 0) negative = 0;
  __syncthreads();
  // Sums over the members of the chunks done so far (the same in every
  // thread); thread 0 adds them to its value, so the scans return sums over
  // all members up to and including each thread's own.
  int64_t raw_carry = 0;
  int64_t carry[kMaxOffsetOutputs] = {};
  for (int base = 0; base < args.num_splits; base += blockDim.x) {
    const int i = base + threadIdx.x;
    int64_t split = 0, second = 1;
    if (i < args.num_splits) {
      split = args.splits == nullptr ? args.uniform_split : load_size(args.splits, args.splits_are_int64, i);
      if (args.second != nullptr) second = load_size(args.second, args.second_is_int64, i);
      if (split < 0 || second < 0) negative = 1;  // benign race: every writer stores 1
    }
    // Negative sizes are reported through the status word and count as 0,
    // so every offset stays monotone and in bounds for the kernels that read them.
    split = split < 0 ? 0 : split;
    second = second < 0 ? 0 : second;

    int64_t end[1] = {threadIdx.x == 0 ? raw_carry + split : split};
    int64_t raw_total[1];
    block_inclusive_sums<1>(end, raw_total, ws);  // end[0]: raw rows through member i
    raw_carry = raw_total[0];
    // Members past the capacity are truncated (the status word reports it),
    // so every derived offset stays inside buffers sized for `capacity_rows`
    // rows and kernels cannot write out of bounds even with inconsistent splits.
    int64_t rows = split;
    if (args.capacity_rows >= 0) rows = min(end[0], args.capacity_rows) - min(end[0] - split, args.capacity_rows);

    int64_t v[kMaxOffsetOutputs];
#pragma unroll
    for (int j = 0; j < kMaxOffsetOutputs; ++j) {
      v[j] = j < args.num_outputs ? member_value(args.outputs[j], rows, second) : 0;
      if (threadIdx.x == 0) v[j] += carry[j];
    }
    block_inclusive_sums<kMaxOffsetOutputs>(v, carry, ws);  // the new carries are the totals
#pragma unroll
    for (int j = 0; j < kMaxOffsetOutputs; ++j)
      if (j < args.num_outputs && i < args.num_splits) args.outputs[j].out[i + 1] = v[j];
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < kMaxOffsetOutputs; ++j)
      if (j < args.num_outputs) args.outputs[j].out[0] = 0;
  }
  __syncthreads();  // `negative` complete
  if (threadIdx.x == 0 && args.status != nullptr) {
    int64_t s = negative ? kNegativeSplit : 0;
    if (args.capacity_rows >= 0 && raw_carry > args.capacity_rows) s |= kAboveCapacity;
    *args.status = s;
  }
}

}  // namespace

cudaError_t launch_splits_to_offsets(const SplitsToOffsetsArgs& args, cudaStream_t stream) {
  if (args.num_outputs < 0 || args.num_outputs > kMaxOffsetOutputs || args.num_splits < 0) return cudaErrorInvalidValue;
  for (int j = 0; j < args.num_outputs; ++j) {
    if (args.outputs[j].out == nullptr || args.outputs[j].align < 1) return cudaErrorInvalidValue;
    if (args.outputs[j].times_second && args.second == nullptr) return cudaErrorInvalidValue;
  }
  if (args.num_outputs == 0 && args.status == nullptr) return cudaSuccess;
  // A warp per 32 members, up to 1024 threads (more members loop in chunks).
  const int threads = args.num_splits >= kMaxThreads ? kMaxThreads : round_up(args.num_splits < 1 ? 1 : args.num_splits, kLanes);
  splits_to_offsets_kernel<<<1, threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace grouped
}  // namespace lpmoe
