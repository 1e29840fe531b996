// NVFP4 (E2M1 data, E4M3 scale per 16 elements, fp32 per-member amax) on any
// arch: software E2M1 round-to-nearest-even with saturation (formats.md §0,
// §3).  Single tensor and grouped same-shape / varying-first (common K,
// K % 16 == 0, every M_t % 16 == 0; members breaking that are skipped).
//
// Grouped layout = concatenation of the members' single-tensor layouts:
//   rowwise data      (M_t, K/2) bytes, even element in the low nibble, at K*row[t]/2
//   columnwise data   (K, M_t/2) bytes (transposed, packed along M) at K*row[t]/2
//   rowwise scales    (round_up(M_t,128), SX = round_up(K/16,4)) at pad128[t]*SX
//   columnwise scales (KP = round_up(K,128), round_up(M_t/16,4)) at KP*pad64[t]/16
//   amax, columnwise_amax: one fp32 per member (the same value)
// Swizzled scales: per-member swizzle of each (rowwise-style) matrix.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace nvfp4 {

struct QuantizeArgs {
  const void* input = nullptr;   // (rows, K), 16-byte aligned
  DType input_dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t cols = 0;              // K % 16 == 0
  grouped::GroupRows group;
  bool swizzled = false;
  uint8_t* out_data = nullptr;
  uint8_t* out_scale = nullptr;
  uint8_t* out_col_data = nullptr;
  uint8_t* out_col_scale = nullptr;
  float* amax = nullptr;         // (N,) computed here (device, no sync)
  float* col_amax = nullptr;     // (N,) copy for the columnwise copy, or null
  const float* noop = nullptr;
  int64_t max_row_tiles = 0;
};

cudaError_t launch_quantize(const QuantizeArgs& args, cudaStream_t stream);

struct DequantizeArgs {
  const uint8_t* data = nullptr;  // rowwise
  const uint8_t* scale = nullptr;
  const float* amax = nullptr;
  bool swizzled = false;
  int64_t rows = 0;
  int64_t cols = 0;
  grouped::GroupRows group;
  DType out_dtype = DType::kBFloat16;
  void* out = nullptr;            // (rows, K)
  int64_t max_row_tiles = 0;
};

cudaError_t launch_dequantize(const DequantizeArgs& args, cudaStream_t stream);

}  // namespace nvfp4
}  // namespace lpmoe
