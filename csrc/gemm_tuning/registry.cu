// Name -> configuration table of the tuning build (see tuning.h).
#ifdef LPMOE_GEMM_EXPERIMENTS
#include <cstdlib>
#include <cstring>

#include "gemm_tuning/tuning.h"

namespace lpmoe::gemm::tuning {
// wgrad: the previous release choice (pingpong 64x128, cluster 1x2; bf16 and
// fp32 output) and a
// 2x1 cluster of the cooperative 128x128 kernel; fprop/dgrad: 2x1 cluster.
cudaError_t wgrad_pp(const GroupedGemmArgs&);
cudaError_t wgrad_pp_f32(const GroupedGemmArgs&);
cudaError_t wgrad_coop21(const GroupedGemmArgs&);
cudaError_t fwd_coop21(const GroupedGemmArgs&);

namespace {
struct Entry {
  const char* name;
  bool wgrad;
  bool fp32_out;
  cudaError_t (*run)(const GroupedGemmArgs&);
};
constexpr Entry kEntries[] = {
    {"pp", true, false, wgrad_pp},
    {"pp", true, true, wgrad_pp_f32},
    {"coop21", true, false, wgrad_coop21},
    {"coop21", false, false, fwd_coop21},
};
}  // namespace

bool run_fp8_variant(const GroupedGemmArgs& args, bool fp32_out, cudaError_t* status) {
  const char* v = std::getenv("LPMOE_GEMM_VARIANT");
  if (v == nullptr) return false;
  const bool wgrad = args.kind == GemmKind::kWgrad;
  for (const Entry& e : kEntries) {
    if (e.wgrad == wgrad && e.fp32_out == fp32_out && std::strcmp(e.name, v) == 0) {
      *status = e.run(args);
      return true;
    }
  }
  return false;
}
}  // namespace lpmoe::gemm::tuning
#endif
