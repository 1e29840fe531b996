// bf16 grouped wgrad writing bf16 weight gradients directly (no fp32
// buffer and cast pass; beta = 1 accumulates into bf16).  See gemm_16bit.cuh.
#include "gemm/gemm_16bit.cuh"

LPMOE_DEFINE_GROUPED_16BIT_WGRAD_OUT(grouped_gemm_bf16_wgrad_bf16out, cutlass::bfloat16_t, cutlass::bfloat16_t)
