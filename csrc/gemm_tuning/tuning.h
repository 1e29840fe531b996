// Extra grouped-GEMM configurations for tuning builds only
// (LPMOE_NVCC_EXTRA=-DLPMOE_GEMM_EXPERIMENTS; tools/gemm_experiments.sh).
// Release builds compile these translation units empty: each kind keeps one
// configuration (csrc/gemm).  A tuning build runs the configuration named by
// LPMOE_GEMM_VARIANT where one exists for the call's kind.
#pragma once

#include "gemm/grouped_gemm.h"

// One FP8 block-scaled configuration per translation unit:
// LPMOE_TUNING_FP8(name, wgrad?, schedule, tile M,N, cluster M,N, output type)
#define LPMOE_TUNING_FP8(NAME, WGRAD, SCHED, TM, TN, CM, CN, OUT)                                             \
  namespace lpmoe::gemm::tuning {                                                                             \
  cudaError_t NAME(const GroupedGemmArgs& args) {                                                             \
    using namespace cute;                                                                                     \
    using C = detail8::Config8<WGRAD, detail8::SCHED, Shape<Int<TM>, Int<TN>, _128>, Shape<Int<CM>, Int<CN>, _1>, \
                               OUT>;                                                                          \
    return detail8::run8<C>(args);                                                                            \
  }                                                                                                           \
  }

namespace lpmoe::gemm::tuning {
// Runs the configuration named by LPMOE_GEMM_VARIANT for this call's kind and
// output (FP8 block; bf16, or fp32 for wgrad) if there is one: returns true
// and its status; false if none applies (the caller runs its release one).
bool run_fp8_variant(const GroupedGemmArgs& args, bool fp32_out, cudaError_t* status);
}  // namespace lpmoe::gemm::tuning
