// Tuning configuration (see tuning.h).
#ifdef LPMOE_GEMM_EXPERIMENTS
#include "gemm/gemm_fp8_block.cuh"
#include "gemm_tuning/tuning.h"
#if LPMOE_HAS_SM90_GROUPED
LPMOE_TUNING_FP8(fwd_coop21, false, Cooperative, 128, 128, 2, 1, cutlass::bfloat16_t)
#endif
#endif
