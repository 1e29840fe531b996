// fp16 grouped dgrad with the 64-row pingpong tile of small groups (see
// heuristics16.h for when it runs, gemm_16bit.cuh for the configuration).
#include "gemm/gemm_16bit.cuh"

LPMOE_DEFINE_GROUPED_16BIT_ROWS64(grouped_gemm_fp16_dgrad_rows64, cutlass::half_t, lpmoe::gemm::GemmKind::kDgrad)
