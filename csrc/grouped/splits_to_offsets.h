// Device-side prefix sums of group split sizes.
//
// A grouped layout needs several running offsets per member (element offsets
// of the data, row starts padded to 4/128/512 rows for scale and transposed
// layouts, ...).  All of them derive from the same split sizes, so one launch
// computes every requested output: out_j[t] = sum_{i<t} round_up(split_i,
// align_j) * stride_j, with out_j[0] = 0 and out_j[N] = the total (CSR style,
// N+1 entries).  An output may also multiply by a second per-member size
// (element offsets of groups whose first AND last dims vary: M_i * K_i).  The
// splits stay on the GPU: nothing here syncs with the host.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace lpmoe {
namespace grouped {

constexpr int kMaxOffsetOutputs = 8;

// Bits of the status word written by the kernel (0 = consistent).
enum OffsetsStatus : int64_t {
  kNegativeSplit = 1,    // some split < 0
  kAboveCapacity = 2,    // sum of splits > capacity_rows
};

struct OffsetOutput {
  int64_t* out;     // N+1 int64 entries
  int64_t stride;   // multiplier applied after rounding
  int64_t align;    // round each split up to a multiple of this (>= 1)
  bool times_second = false;  // also multiply by the second split array
};

struct SplitsToOffsetsArgs {
  // Split sizes: int32 or int64 on the device.  When null, every split equals
  // `uniform_split` (same-shape groups: no device array needed).
  const void* splits = nullptr;
  bool splits_are_int64 = true;
  int64_t uniform_split = 0;
  // Optional second per-member size (int32/int64), used by outputs with
  // times_second set; negative values are reported like negative splits.
  const void* second = nullptr;
  bool second_is_int64 = true;
  int num_splits = 0;
  int num_outputs = 0;
  OffsetOutput outputs[kMaxOffsetOutputs];
  int64_t* status = nullptr;     // optional; OffsetsStatus bits
  // >= 0: flag sums above it AND truncate members there (memory safety).
  int64_t capacity_rows = -1;
};

cudaError_t launch_splits_to_offsets(const SplitsToOffsetsArgs& args, cudaStream_t stream);

}  // namespace grouped
}  // namespace lpmoe
