// The TMA-ring FP8 block quantizer (1x128 blocks, 16-bit inputs): internal
// to the fp8_block family, chosen by launch_quantize where it applies.
#pragma once

#include <cuda_runtime_api.h>

#include "fp8_block/fp8_block.h"

namespace lpmoe {
namespace fp8_block {

// Whether the ring kernel can run this call: 1x128 blocks, bf16/fp16 input
// 16-byte aligned, no fused dbias, whole 8-token chunks in the transposed
// output, rows addressable by TMA's 32-bit coordinates.
bool ring_quantize_applies(const QuantizeArgs& args);

// Launches the ring kernel over `tiles` tiles; `launched` is false (and
// nothing ran) when the device or driver cannot (no TMA, rejected layout).
cudaError_t launch_quantize_ring(const QuantizeArgs& args, int64_t tiles, cudaStream_t stream, bool& launched);

}  // namespace fp8_block
}  // namespace lpmoe
