// bf16 grouped fprop with the 64-row pingpong tile of small groups (see
// heuristics16.h for when it runs, gemm_16bit.cuh for the configuration).
#include "gemm/gemm_16bit.cuh"

LPMOE_DEFINE_GROUPED_16BIT_ROWS64(grouped_gemm_bf16_fprop_rows64, cutlass::bfloat16_t, lpmoe::gemm::GemmKind::kFprop)
