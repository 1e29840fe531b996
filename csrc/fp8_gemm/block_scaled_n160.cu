#include "fp8_gemm/launch.cuh"

namespace lpmoe {
namespace fp8_gemm {
LPMOE_INSTANTIATE_BLOCK_SCALED(160)
}  // namespace fp8_gemm
}  // namespace lpmoe
