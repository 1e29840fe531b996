#include "gemm/cublaslt_matmul.h"

#include <map>
#include <mutex>
#include <tuple>

namespace lpmoe {
namespace gemm {
namespace {

#define LPMOE_LT_TRY(expr)                          \
  do {                                              \
    cublasStatus_t st_ = (expr);                    \
    if (st_ != CUBLAS_STATUS_SUCCESS) return st_;   \
  } while (0)

// RAII holders so every early return frees the descriptors.
struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};

using AlgoKey = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int, int, int64_t, int64_t, int64_t, int,
                           size_t, uintptr_t>;
std::mutex g_mutex;
std::map<AlgoKey, cublasLtMatmulAlgo_t> g_algos;

cublasLtMatmulMatrixScale_t to_lt(LtScale s) {
  return s == LtScale::kVec128 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

}  // namespace

cublasStatus_t lt_matmul(const LtContext& ctx, int64_t m, int64_t n, int64_t k, const LtOperand& a,
                         const LtOperand& b, void* d, cudaDataType_t d_type, int64_t ldd, float beta) {
  Desc desc;
  LPMOE_LT_TRY(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N;
  LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (a.scale_mode != LtScale::kNone) {
    // Block scaling always runs with split (fp32 promoted) accumulation:
    // there is no fast-accumulation algorithm for these modes.
    cublasLtMatmulMatrixScale_t ma = to_lt(a.scale_mode), mb = to_lt(b.scale_mode);
    LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof(ma)));
    LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof(mb)));
    LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a.scale,
                                                sizeof(a.scale)));
    LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b.scale,
                                                sizeof(b.scale)));
    int8_t fast = 0;
    LPMOE_LT_TRY(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  }
  Layout la, lb, ld;
  LPMOE_LT_TRY(cublasLtMatrixLayoutCreate(&la.l, a.type, a.transpose ? k : m, a.transpose ? m : k, a.ld));
  LPMOE_LT_TRY(cublasLtMatrixLayoutCreate(&lb.l, b.type, b.transpose ? n : k, b.transpose ? k : n, b.ld));
  LPMOE_LT_TRY(cublasLtMatrixLayoutCreate(&ld.l, d_type, m, n, ldd));

  AlgoKey key{m, n, k, int(a.type), int(b.type), int(d_type), int(a.transpose), int(b.transpose),
              int(a.scale_mode) * 4 + int(b.scale_mode), a.ld, b.ld, ldd, beta != 0.0f, ctx.workspace_bytes,
              reinterpret_cast<uintptr_t>(ctx.handle)};
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_algos.find(key);
    if (it != g_algos.end()) {
      algo = it->second;
    } else {
      cublasLtMatmulPreference_t pref = nullptr;
      LPMOE_LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = ctx.workspace_bytes;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(ctx.handle, desc.d, la.l, lb.l, ld.l, ld.l, pref, 1, &result,
                                                         &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
      if (found == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
      algo = result.algo;
      g_algos.emplace(key, algo);
    }
  }
  const float alpha = 1.0f;
  return cublasLtMatmul(ctx.handle, desc.d, &alpha, a.ptr, la.l, b.ptr, lb.l, &beta, d, ld.l, d, ld.l, &algo,
                        ctx.workspace, ctx.workspace_bytes, ctx.stream);
}

}  // namespace gemm
}  // namespace lpmoe
