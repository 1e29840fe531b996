// Token permutation for MoE routing: rows of a (tokens, cols) matrix moved
// to their experts' rows and back.  The map from token slots to rows
// (`row_map`, (tokens, k) int32, -1 = slot not routed) is computed on the
// device by the caller (lpmoe/moe/routing_map.py); these kernels only move
// rows, so every launch is graph-safe and the routing may change per replay.
//
//   scatter  dst[row_map[t, j]] = scale[t, j] * src[t]   (read src once, write k rows)
//            optional dot_out[t, j] = <src[t], dot_with[row_map[t, j]]> (the
//            probabilities' gradient of an unpermute), optional zero-fill of
//            dst rows [*zero_from, out_rows) (rows no slot maps to in the
//            packed layout: dropped slots leave a tail).
//   gather   dst[t] = sum_j scale[t, j] * src[row_map[t, j]] (fp32 sum in j
//            order, written in the row dtype; read k rows, write one).
//
// permute = scatter, its backward = gather; unpermute = gather, its backward
// = scatter.  Rows are moved with 16-byte accesses when the row size and the
// pointers allow.  Map entries outside [0, rows) count as "not routed", so a
// bad map can drop rows but never write out of bounds.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"

namespace lpmoe {
namespace permute {

// Top-k per token that one launch accepts (the map of a token sits in shared memory).
constexpr int kMaxSlots = 256;

struct ScatterArgs {
  const void* src = nullptr;        // (tokens, cols)
  void* dst = nullptr;              // (out_rows, cols)
  const int32_t* row_map = nullptr; // (tokens, k)
  const float* scale = nullptr;     // (tokens, k) or null (plain copy)
  const void* dot_with = nullptr;   // (out_rows, cols) or null
  float* dot_out = nullptr;         // (tokens, k) fp32 when dot_with is set
  const int64_t* zero_from = nullptr;  // device scalar or null (no zero-fill)
  int64_t tokens = 0, k = 1, cols = 0, out_rows = 0;
  DType dtype = DType::kBFloat16;   // element type when `raw` is false
  bool raw = false;                 // move bytes (any element type, e.g. FP8 data or fp32 scales)
  int elem_bytes = 2;               // element size when `raw`
};

struct GatherArgs {
  const void* src = nullptr;        // (src_rows, cols)
  void* dst = nullptr;              // (tokens, cols)
  const int32_t* row_map = nullptr; // (tokens, k)
  const float* scale = nullptr;     // (tokens, k) or null (weights 1)
  int64_t tokens = 0, k = 1, cols = 0, src_rows = 0;
  DType dtype = DType::kBFloat16;   // bf16, fp16 or fp32
};

// Inverse of a routing map: row_source[r] = t for the slot (t, j) with
// row_map[t, j] == r, -1 for rows no slot names (the launch fills them).
struct RowSourcesArgs {
  const int32_t* row_map = nullptr;  // (tokens, k)
  int32_t* row_source = nullptr;     // (rows,)
  int64_t tokens = 0, k = 1, rows = 0;
};

cudaError_t launch_scatter(const ScatterArgs& args, int sm_count, cudaStream_t stream);
cudaError_t launch_gather(const GatherArgs& args, int sm_count, cudaStream_t stream);
cudaError_t launch_row_sources(const RowSourcesArgs& args, int sm_count, cudaStream_t stream);

}  // namespace permute
}  // namespace lpmoe
