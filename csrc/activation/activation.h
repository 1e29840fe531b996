// Fused expert-MLP activations: the activation between fc1 and fc2, forward
// and backward, written straight into the operands the next grouped GEMMs
// read (FP8 block 1x128 GroupedTensor buffers, or high precision).
//
//   forward   h (rows, W) -> a (rows, F)             a = act(h) [* probs]
//   backward  da (rows, F), h -> dh (rows, W)        (+ d probs)
//
// W = 2F for GLU kinds (h = [gate | value], gate first) and W = F otherwise.
// FP8 outputs use fp8_block::QuantizeArgs (its `input` unused): each output
// is exactly what fp8_block::launch_quantize would write for the rounded
// high-precision values, because both run fp8_block/tile_quantize.cuh on the
// same registers.  Work is split into 128x128 tiles of (rows, F) that never
// straddle members (tile rows in pad128 space, grouped/row_tiles.cuh); rows
// past the members (capacity tail) are never read or written by the FP8
// variants.  High-precision-only launches pass a single-member group
// spanning every row.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "fp8_block/fp8_block.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace activation {

enum class Kind : int { kSwiGLU = 0, kGeGLU = 1, kGELU = 2, kReLU = 3, kClampedSwiGLU = 4 };

__host__ __device__ constexpr bool is_glu(Kind k) {
  return k == Kind::kSwiGLU || k == Kind::kGeGLU || k == Kind::kClampedSwiGLU;
}

struct Params {
  float alpha = 1.702f;  // clamped SwiGLU: sigmoid(alpha * gate)
  float limit = 7.0f;    // clamped SwiGLU: gate <= limit, |value| <= limit
};

// Whether a bf16 SwiGLU kernel takes its sigmoid from the shared-memory table
// (sigmoid_table.cuh).  kAuto: where the device makes these kernels
// issue-bound (heuristics.cu); kOff / kOn force it (tests, A/B timing).  Only
// the bf16 SwiGLU forward and FP8 backward have a table variant; every other
// launch ignores the setting.
enum class SigmoidTable : int { kAuto = -1, kOff = 0, kOn = 1 };

struct Common {
  Kind kind = Kind::kSwiGLU;
  SigmoidTable sigmoid_table = SigmoidTable::kAuto;
  Params params;
  DType dtype = DType::kBFloat16;  // of h, da and every high-precision output
  int64_t rows = 0;                // buffer rows (capacity)
  int64_t ffn = 0;                 // F, multiple of 16
  const float* probs = nullptr;    // (rows,) row scales, or null
  grouped::GroupRows group;        // member rows (null arrays: one member)
  int64_t max_row_tiles = 0;       // grid bound, 128-row tiles in pad128 space
};

struct ForwardArgs {
  Common c;
  const void* h = nullptr;         // (rows, W) row-major, 16-byte aligned
  void* out = nullptr;             // (rows, F) high-precision a, or null
  fp8_block::QuantizeArgs fp8;     // FP8 block 1x128 a (cols = F); no output when both data pointers are null
};

struct BackwardArgs {
  Common c;
  const void* da = nullptr;        // (rows, F)
  const void* h = nullptr;         // (rows, W)
  void* dh = nullptr;              // (rows, W) high precision, or null
  fp8_block::QuantizeArgs dh_fp8;  // FP8 block 1x128 dh (cols = W), optional per-tile column sums
  float* probs_partials = nullptr; // (rows, ceil(F/128)) per-block sums of da * u, or null
};

// FP8 outputs are E4M3 with 1x128 blocks (the operands of the grouped GEMMs).
// A GLU backward with an FP8 dh needs F % 128 == 0 (dh's 1x128 blocks may not
// straddle the gate/value boundary); callers fall back to a high-precision dh
// and fp8_block::launch_quantize otherwise.
cudaError_t launch_forward(const ForwardArgs& args, cudaStream_t stream);
cudaError_t launch_backward(const BackwardArgs& args, cudaStream_t stream);

// Sigmoid-table kernel launches requested since the process started, counted
// on the host when the launch is issued (so tests can prove which variant
// ran; a CUDA graph counts its capture, not its replays).
int64_t sigmoid_table_launches();

struct ProbsGradArgs {
  const float* partials = nullptr;  // from launch_backward
  int64_t rows = 0;
  int64_t blocks = 0;               // ceil(F/128)
  const int64_t* used_rows = nullptr;  // device scalar: rows covered by members (null: all)
  float* out = nullptr;             // (rows,) fp32; rows past used_rows get 0
};

// d probs[t] = partial block sums of row t added left to right (deterministic).
cudaError_t launch_probs_grad(const ProbsGradArgs& args, cudaStream_t stream);

}  // namespace activation
}  // namespace lpmoe
