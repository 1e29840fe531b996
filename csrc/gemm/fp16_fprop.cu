// fp16 grouped fprop (one CUTLASS instantiation; see gemm_16bit.cuh).
#include "gemm/gemm_16bit.cuh"

LPMOE_DEFINE_GROUPED_16BIT(grouped_gemm_fp16_fprop, cutlass::half_t, lpmoe::gemm::GemmKind::kFprop)
