// MXFP8 (E8M0 scale per 32 elements) quantize and dequantize on any arch
// (software E8M0; formats.md §2), single tensor and grouped, all four shape
// kinds, compact or GEMM-swizzled scales.
//
// Grouped layout = concatenation of the members' single-tensor layouts:
//  * same-shape / varying-first (common K, any M_t): data at K*row[t] (both
//    directions, (M_t, K) row-major); rowwise scales (round_up(M_t,128),
//    SX = round_up(ceil(K/32),4)) at pad128[t]*SX; columnwise scales
//    (round_up(M_t,128)/32, KP = round_up(K,128)) at pad128[t]/32*KP.
//  * varying-last / varying-both (every M_t and K_t a multiple of 128): data
//    at offsets[t]; rowwise scales (M_t, K_t/32) and columnwise scales
//    (M_t/32, K_t) both at offsets[t]/32.  Members breaking the alignment are
//    skipped (the host checks it where the dims are host-visible).
// Swizzled scales use the per-member swizzle of formats.md §2.3 (columnwise:
// of the transposed matrix).  Every scale byte of a member's padded matrix is
// written (padding = 0); bytes past the last member are untouched.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace mxfp8 {

struct Members {
  // Same-shape / varying-first: row prefix sums (all null = one member).
  grouped::GroupRows rows;
  // Varying-last / varying-both: element offsets (N+1) and per-member dims
  // (null = the common value).
  bool by_elements = false;
  const int64_t* offsets = nullptr;
  const int64_t* first_dims = nullptr;
  const int64_t* last_dims = nullptr;
  int64_t common_first = 0;
  int64_t common_last = 0;
};

struct QuantizeArgs {
  const void* input = nullptr;  // logical (rows, cols) buffer, 16-byte aligned
  DType input_dtype = DType::kBFloat16;
  int64_t rows = 0;             // logical rows (capacity for varying-first)
  int64_t cols = 0;             // common K (rows mode; multiple of 16)
  int64_t numel = 0;            // logical elements (elements mode)
  Members members;
  bool e5m2 = false;
  bool swizzled = false;
  void* out_data = nullptr;
  uint8_t* out_scale = nullptr;
  void* out_col_data = nullptr;
  uint8_t* out_col_scale = nullptr;
  const float* noop = nullptr;
  int64_t num_tiles = 0;        // grid bound
};

cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream);

struct DequantizeArgs {
  const void* data = nullptr;
  const uint8_t* scale = nullptr;
  bool columnwise = false;
  bool swizzled = false;
  bool e5m2 = false;
  int64_t rows = 0, cols = 0, numel = 0;
  Members members;
  DType out_dtype = DType::kBFloat16;
  void* out = nullptr;          // same element layout as the data
  int64_t num_tiles = 0;
};

cudaError_t launch_dequantize(const DequantizeArgs& args, cudaStream_t stream);

// Launches of each dequantize kernel since the process started (tests prove
// which one a call took): 16-byte output stores (fp32 outputs, members of
// varying K, a driver without tensor maps, outputs past 2^31 rows), and whole
// 16-bit output tiles through TMA stores (bf16 and fp16 outputs otherwise;
// code built for an architecture without TMA, below sm_90 or a Blackwell
// target without "a"/"f", runs the 16-byte stores inside that kernel and is
// counted under it).
enum class DequantizeKernel { kStores = 0, kTmaStores = 1, kCount = 2 };
int64_t dequantize_kernel_launches(DequantizeKernel kernel);

}  // namespace mxfp8
}  // namespace lpmoe
