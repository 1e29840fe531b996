// One cuBLASLt matmul with optional FP8 block scaling (pure C++, no torch).
// Column-major BLAS convention: D (m x n) = op(A) (m x k) . op(B) (k x n)
// [+ beta * D].  The per-expert loop of the "cublas" grouped backend calls it
// once per non-empty group; algorithm heuristics are cached per shape so the
// loop's host cost stays small.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lpmoe {
namespace gemm {

enum class LtScale : int { kNone = 0, kVec128 = 1, kBlk128x128 = 2 };

struct LtOperand {
  const void* ptr = nullptr;
  cudaDataType_t type = CUDA_R_16BF;
  bool transpose = false;  // op(X) = X^T; the stored matrix is then (k x m) / (n x k)
  int64_t ld = 0;
  const float* scale = nullptr;
  LtScale scale_mode = LtScale::kNone;
};

struct LtContext {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Returns CUBLAS_STATUS_NOT_SUPPORTED when no algorithm exists.
cublasStatus_t lt_matmul(const LtContext& ctx, int64_t m, int64_t n, int64_t k, const LtOperand& a,
                         const LtOperand& b, void* d, cudaDataType_t d_type, int64_t ldd, float beta);

}  // namespace gemm
}  // namespace lpmoe
