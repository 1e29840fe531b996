// AdamW step of a group of same-shape expert weights, fused with the FP8
// 128x128 block quantization of the updated weights (rowwise copy and
// per-member transposed copy, the grouped layout of fp8_block.h).
//
// Two kinds of weights: fp32 parameters stepped in place, or bf16 / fp16
// parameters with fp32 master copies (Megatron's and TransformerEngine's
// FusedAdam's master weights), where the master is stepped and the
// parameter is written as the master rounded to nearest even.  The FP8
// copies are always those of the parameter as written (for 16-bit
// parameters: of the rounded values), so a layer that quantized its
// parameter itself would get the same bits.
//
// Why fused: a layer that quantizes its weights in every forward reads each
// fp32 weight again (4 bytes) right after the optimizer wrote it.  Quantizing
// the value the optimizer holds in registers leaves only the FP8 writes, and
// the layer's next forward finds its FP8 weights ready
// (lpmoe/optim/adamw.py, lpmoe/functional/weights.py).
//
// Numerics (docs/optimizer-notes.md; lpmoe/reference/optim.py is the same
// sequence in PyTorch ops): every operation is one IEEE fp32 operation,
// rounded to nearest, no contraction into FMA, with fp32 scalars made on the
// host:
//   p   = p * decay                                 decay = 1 - lr * wd
//   m   = beta1 * m + one_minus_beta1 * g
//   v   = beta2 * v + one_minus_beta2 * (g * g)
//   den = sqrt(v) / bias_correction2_sqrt + eps
//   p   = p - (step_size * m) / den                 step_size = lr / (1 - beta1^t)
// and the FP8 copies are exactly what the grouped 128x128 quantization of
// the updated fp32 weights writes (fp8_block/tile_quantize.cuh's
// process_tile, the same code).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "fp8_block/fp8_block.h"

namespace lpmoe {
namespace optim {

struct AdamWScalars {
  float decay = 1.0f;
  float beta1 = 0.9f, one_minus_beta1 = 0.1f;
  float beta2 = 0.999f, one_minus_beta2 = 0.001f;
  float step_size = 0.0f;
  float bias_correction2_sqrt = 1.0f;
  float eps = 1e-8f;
};

// One member per expert: G tensors (rows, cols), each contiguous and
// 16-byte aligned, anywhere in memory.
struct AdamWFp8BlockArgs {
  int num_tensors = 0;
  int64_t rows = 0;                  // N: rows of every member
  int64_t cols = 0;                  // K: multiple of 16
  // The parameters' and gradients' dtype (the same for both): kFloat32 with
  // masters == nullptr, or kBFloat16 / kFloat16 with fp32 masters.
  DType dtype = DType::kFloat32;
  void* const* params = nullptr;     // host arrays of num_tensors pointers
  const void* const* grads = nullptr;
  float* const* masters = nullptr;   // fp32 master weights, or nullptr
  float* const* exp_avgs = nullptr;
  float* const* exp_avg_sqs = nullptr;
  AdamWScalars scalars;
  // The quantized copies: out_data / out_scale / out_col_data /
  // out_col_scale, e5m2, pow2_scales and amax_epsilon as for a grouped
  // 128x128 quantization of the (num_tensors * rows, cols) weights into
  // equal members (the other fields are ignored).
  fp8_block::QuantizeArgs quantized;
};

cudaError_t launch_adamw_fp8_block(const AdamWFp8BlockArgs& args, cudaStream_t stream);

// Kernel launches since the process started (tests prove the fused path ran).
int64_t adamw_fp8_block_launches();

}  // namespace optim
}  // namespace lpmoe
