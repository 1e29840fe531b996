#include "fp8_gemm/wgrad_launch.cuh"

namespace lpmoe {
namespace fp8_gemm {
LPMOE_INSTANTIATE_WGRAD(192, false)
}  // namespace fp8_gemm
}  // namespace lpmoe
