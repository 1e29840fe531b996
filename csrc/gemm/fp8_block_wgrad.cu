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
// Cooperative 128x128x128, cluster 1x2 (as fprop).  Both operands carry a
// scale per row per 128 tokens, so each K block ends with a two-factor
// promotion; the two consumer warpgroups of the cooperative schedule
// overlap one's promotion with the other's MMAs, and the 128x128 tile reads
// half the operand bytes per FLOP of a 64x128 pingpong tile, which starved on
// L2 bandwidth (0.67-0.87 of cuBLASLt against 0.82-0.99 for this kernel in the same
// sweeps; docs/gemm-notes.md).
using Chosen = detail8::Config8<true, detail8::Cooperative, Shape<_128, _128, _128>, Shape<_1, _2, _1>>;
}  // namespace

cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs& args) {
  return detail8::run8_release<Chosen>(args);
}
#else
cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs&) { return cudaErrorNotSupported; }
#endif

}  // namespace gemm
}  // namespace lpmoe
