// bf16 grouped fprop (one CUTLASS instantiation; see gemm_16bit.cuh).
#include "gemm/gemm_16bit.cuh"

LPMOE_DEFINE_GROUPED_16BIT(grouped_gemm_bf16_fprop, cutlass::bfloat16_t, lpmoe::gemm::GemmKind::kFprop)
