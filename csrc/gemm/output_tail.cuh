// Zeroing of a fresh fprop/dgrad output's capacity tail, folded into the
// small argument-building launch that precedes every grouped GEMM: the tail
// starts at the device row count, so it must be done on the device, and a
// launch of its own cost ~7 us of host time per call (eager MoE steps of small
// experts are host-bound) plus ~1.7 us of device time when there is no tail.
#pragma once

#include <cstdint>

#include "gemm/grouped_gemm.h"

namespace lpmoe {
namespace gemm {

// Blocks appended to the argument builder's grid when args.zero_tail: enough
// 16-byte stores in flight for a long tail; each exits after one load when
// the tail is empty.
constexpr int kTailBlocks = 256;

inline int tail_blocks(const GroupedGemmArgs& args) {
  return args.zero_tail && args.kind != GemmKind::kWgrad && args.d_rows > 0 ? kTailBlocks : 0;
}

// Block `part` of `parts` zeroes its share of rows [row[G], d_rows).  Output
// rows are N or K (multiples of 16, checked by the binding) 2-byte elements,
// so the tail starts and ends on 16-byte boundaries of the 16-byte aligned d.
__device__ __forceinline__ void zero_output_tail(const GroupedGemmArgs& args, int part, int parts) {
  const int64_t used = __ldg(args.rows.row + args.num_groups);
  if (used >= args.d_rows) return;
  const int64_t row_bytes = 2 * (args.kind == GemmKind::kFprop ? args.n : args.k);
  uint4* p = reinterpret_cast<uint4*>(static_cast<char*>(args.d) + used * row_bytes);
  const int64_t count = (args.d_rows - used) * row_bytes / 16;
  const int64_t stride = int64_t(parts) * blockDim.x;
  for (int64_t i = int64_t(part) * blockDim.x + threadIdx.x; i < count; i += stride) p[i] = make_uint4(0u, 0u, 0u, 0u);
}

}  // namespace gemm
}  // namespace lpmoe
