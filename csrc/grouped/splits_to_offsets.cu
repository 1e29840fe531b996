#include "grouped/splits_to_offsets.h"

#include <cub/block/block_scan.cuh>

#include "common/cuda_utils.h"

namespace lpmoe {
namespace grouped {
namespace {

constexpr int kThreads = 512;

// One block walks the splits in chunks of kThreads, carrying the running sums
// across chunks.  Split counts are small (experts per rank), so a single block
// is the right size and keeps the result deterministic.
__global__ void __launch_bounds__(kThreads) splits_to_offsets_kernel(SplitsToOffsetsArgs args) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t carry[kMaxOffsetOutputs];
  __shared__ int64_t raw_carry;
  __shared__ unsigned long long status;

  if (threadIdx.x == 0) {
    for (int j = 0; j < args.num_outputs; ++j) {
      carry[j] = 0;
      args.outputs[j].out[0] = 0;
    }
    raw_carry = 0;
    status = 0;
  }
  __syncthreads();

  for (int base = 0; base < args.num_splits; base += kThreads) {
    const int i = base + threadIdx.x;
    int64_t split = 0;
    int64_t second = 1;
    if (i < args.num_splits) {
      if (args.splits == nullptr) {
        split = args.uniform_split;
      } else if (args.splits_are_int64) {
        split = static_cast<const int64_t*>(args.splits)[i];
      } else {
        split = static_cast<const int32_t*>(args.splits)[i];
      }
      if (args.second != nullptr) {
        second = args.second_is_int64 ? static_cast<const int64_t*>(args.second)[i]
                                      : static_cast<const int32_t*>(args.second)[i];
      }
      if (split < 0 || second < 0) {
        atomicOr(reinterpret_cast<unsigned long long*>(&status), static_cast<unsigned long long>(kNegativeSplit));
      }
    }
    // Negative splits are reported through the status word and treated as 0
    // so every offset stays monotone and in bounds for the kernels that read them.
    const int64_t clamped = split < 0 ? 0 : split;
    const int64_t second_clamped = second < 0 ? 0 : second;

    int64_t raw_total;
    int64_t raw_incl;
    Scan(scan_storage).InclusiveSum(clamped, raw_incl, raw_total);
    // Members past the capacity are truncated (status reports it), so every
    // derived offset stays inside buffers sized for `capacity_rows` rows and
    // kernels cannot write out of bounds even with inconsistent splits.
    int64_t effective = clamped;
    if (args.capacity_rows >= 0) {
      const int64_t end = raw_carry + raw_incl;
      const int64_t begin = end - clamped;
      effective = min(end, args.capacity_rows) - min(begin, args.capacity_rows);
    }
    __syncthreads();
    if (threadIdx.x == 0) raw_carry += raw_total;

    for (int j = 0; j < args.num_outputs; ++j) {
      const OffsetOutput o = args.outputs[j];
      int64_t v = round_up<int64_t>(effective, o.align) * o.stride;
      if (o.times_second) v *= second_clamped;
      int64_t incl, total;
      Scan(scan_storage).InclusiveSum(v, incl, total);
      if (i < args.num_splits) o.out[i + 1] = carry[j] + incl;
      __syncthreads();
      if (threadIdx.x == 0) carry[j] += total;
      __syncthreads();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && args.status != nullptr) {
    int64_t s = static_cast<int64_t>(status);
    if (args.capacity_rows >= 0 && raw_carry > args.capacity_rows) s |= kAboveCapacity;
    *args.status = s;
  }
}

}  // namespace

cudaError_t launch_splits_to_offsets(const SplitsToOffsetsArgs& args, cudaStream_t stream) {
  if (args.num_outputs < 0 || args.num_outputs > kMaxOffsetOutputs) return cudaErrorInvalidValue;
  for (int j = 0; j < args.num_outputs; ++j) {
    if (args.outputs[j].out == nullptr || args.outputs[j].align < 1) return cudaErrorInvalidValue;
    if (args.outputs[j].times_second && args.second == nullptr) return cudaErrorInvalidValue;
  }
  if (args.num_outputs == 0 && args.status == nullptr) return cudaSuccess;
  splits_to_offsets_kernel<<<1, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace grouped
}  // namespace lpmoe
