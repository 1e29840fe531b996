// FP8 block-scaled grouped wgrad writing bf16 weight gradients directly (fp32
// accumulation; halves the output bytes, which dominate when experts get
// few tokens).  One CUTLASS instantiation (see gemm_fp8_block.cuh).
#include "gemm/gemm_fp8_block.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace {
using namespace cute;
// Same schedule as fp8_block_wgrad.cu (cooperative 128x128, cluster 1x2).
using Chosen = detail8::Config8<true, detail8::Cooperative, Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                                cutlass::bfloat16_t>;
}  // namespace

cudaError_t fp8_block_grouped_gemm_wgrad_bf16out(const GroupedGemmArgs& args) {
  return detail8::run8_release<Chosen>(args);
}
#else
cudaError_t fp8_block_grouped_gemm_wgrad_bf16out(const GroupedGemmArgs&) { return cudaErrorNotSupported; }
#endif

}  // namespace gemm
}  // namespace lpmoe
