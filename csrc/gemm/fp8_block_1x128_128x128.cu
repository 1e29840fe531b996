// FP8 block-scaled grouped GEMM, 1x128 activations x 128x128 weights (fprop
// and dgrad), bf16 out: one CUTLASS instantiation (see gemm_fp8_block.cuh).
#include "gemm/gemm_fp8_block.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace {
using namespace cute;
// Cooperative 128x128x128: pingpong measured 0.3x (128-row tiles)
// and 0.63-0.74x (64-row tiles) of it on DSV3 shapes.
using Chosen = detail8::Config8<false, detail8::Cooperative, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
}  // namespace

cudaError_t fp8_block_grouped_gemm_1x128_128x128(const GroupedGemmArgs& args) {
  return detail8::run8_release<Chosen>(args);
}
#else
cudaError_t fp8_block_grouped_gemm_1x128_128x128(const GroupedGemmArgs&) { return cudaErrorNotSupported; }
#endif

}  // namespace gemm
}  // namespace lpmoe
