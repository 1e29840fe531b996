// FP8 block-scaled grouped GEMM for the weight gradient: dW_t (N x K) =
// dy_t^T x_t, both operands 1x128-scaled along the (per member 128-padded)
// token dim, fp32 out with optional accumulation (beta = 1).  One CUTLASS
// instantiation (see gemm_fp8_block.cuh).
#include "gemm/gemm_fp8_block.cuh"

namespace lpmoe {
namespace gemm {

#if LPMOE_HAS_SM90_GROUPED
namespace {
using namespace cute;
// Pingpong with 64-row tiles: one warpgroup's per-128-token promotion (two
// scales per accumulator, granularity 1x1x128) overlaps the other's MMAs;
// measured 1.12x the cooperative 128x128 kernel on DSV3 shapes (sweep in
// docs/gemm-notes.md).  128-row pingpong tiles ran at ~1/3 the speed
// (presumably register pressure: two 128x128 fp32 accumulators per thread set).
using Chosen = detail8::Config8<true, detail8::Pingpong, Shape<_64, _128, _128>, Shape<_1, _2, _1>>;
#ifdef LPMOE_GEMM_EXPERIMENTS
using Coop = detail8::Config8<true, detail8::Cooperative, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
#endif
}  // namespace

cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs& args) {
#ifdef LPMOE_GEMM_EXPERIMENTS
  if (variant_is("coop")) return detail8::run8<Coop>(args);
#endif
  return detail8::run8<Chosen>(args);
}
#else
cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs&) { return cudaErrorNotSupported; }
#endif

}  // namespace gemm
}  // namespace lpmoe
