// Grouped GEMM launchers (pure CUDA/C++, no torch types).
//
// Notation of the MoE layer: member t holds M_t tokens, K = in_features,
// N = out_features, G = number of groups (experts).  Token-grouped operands
// are flat row-major buffers whose member bases follow the device prefix sums
// of grouped/group_rows.h, so nothing here needs the split sizes on the host.
//
//   fprop  y_t  (M_t x N) = x_t  (M_t x K) . W_t^T          A = x,  B = W
//   dgrad  dx_t (M_t x K) = dy_t (M_t x N) . W_t            A = dy, B = W
//   wgrad  dW_t (N x K)   = dy_t^T (N x M_t) . x_t (M_t x K) A = dy, B = x
//
// FP8 block scaling (formats.md §1): x / dy are 1x128-quantized, W 128x128.
// Hopper's FP8 tensor cores read both operands K-major, so dgrad reads the
// transposed (columnwise) weight copy and wgrad the transposed token copies,
// whose token dim is padded per member to 128 with zeros.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "grouped/group_rows.h"

namespace lpmoe {
namespace gemm {

enum class GemmKind : int { kFprop = 0, kDgrad = 1, kWgrad = 2 };

struct GroupedGemmArgs {
  GemmKind kind = GemmKind::kFprop;
  int num_groups = 0;
  int64_t n = 0;  // out_features
  int64_t k = 0;  // in_features
  grouped::GroupRows rows;  // token prefix sums (row, pad4, pad128 are read)

  // Operands.  B of fprop/dgrad is the weight group: member t at
  // b + t * b_member_elems, or at b_ptrs[t] when b_ptrs is given (discrete
  // weights); wgrad's B is token-grouped like A.
  const void* a = nullptr;
  const void* b = nullptr;
  const int64_t* b_ptrs = nullptr;  // device array of G addresses, optional
  int64_t b_member_elems = 0;
  void* d = nullptr;  // fprop/dgrad: token-grouped rows; wgrad: (G, N, K) fp32
  bool wgrad_bf16 = false;  // wgrad: d is bf16 instead
  float beta = 0.0f;  // wgrad only: 1 adds into d (main_grad style)
  // fprop/dgrad of a fresh output: rows [rows.row[G], d_rows) of d (the
  // capacity tail, whose start is a device value) are zeroed by the launch
  // that builds the per-group arguments (no extra kernel, no extra host call).
  bool zero_tail = false;
  int64_t d_rows = 0;

  // FP8 block scales (fp32 inverse scales, the quantizer's GEMM-ready
  // layouts); see fp8 launchers below for which buffer feeds which operand.
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  int64_t b_scale_member_elems = 0;

  // Caller-owned persistent buffers (never allocated here, so captured CUDA
  // graphs replay against the same memory).
  void* setup = nullptr;  // per-group argument arrays
  size_t setup_bytes = 0;
  void* workspace = nullptr;  // kernel workspace (TMA descriptors, ...)
  size_t workspace_bytes = 0;

  int sm_count = 0;
  cudaStream_t stream = nullptr;
};

// Bytes of `setup` every launcher below needs for `num_groups` groups: an
// upper bound over the instantiations (each checks its real need and fails
// with cudaErrorInvalidValue rather than overrun).
constexpr size_t kSetupBytesPerGroup = 512;
inline size_t grouped_gemm_setup_bytes(int num_groups) {
  return kSetupBytesPerGroup * static_cast<size_t>(num_groups) + 16 * 256;
}

// Each returns cudaErrorNotSupported when the build has no sm_90a code, and
// cudaErrorInvalidValue for buffers that are too small.
//
// FP8 block, fprop / dgrad: A 1x128 rowwise data + scales; B the 128x128
// weight group.  fprop reads W's rowwise data with its *columnwise* scales
// (N-major, (ceil(K/128), round_up(ceil(N/128),4)) per member) and dgrad the
// columnwise data (K, round_up(N,128)) with the *rowwise* scales
// ((ceil(N/128), round_up(ceil(K/128),4)) per member): the 128x128 scale of a
// block is the same number in both copies, and each buffer is the MN-major
// layout the other GEMM needs.  D is bf16.
cudaError_t fp8_block_grouped_gemm_1x128_128x128(const GroupedGemmArgs& args);
// FP8 block, wgrad: A = dy columnwise, B = x columnwise, both 1x128 along the
// (per member 128-padded) token dim.  D is fp32, d = beta*d + dy^T x.
cudaError_t fp8_block_grouped_gemm_wgrad(const GroupedGemmArgs& args);
// The same writing bf16 D (beta = 1 accumulates into bf16).
cudaError_t fp8_block_grouped_gemm_wgrad_bf16out(const GroupedGemmArgs& args);

// 16-bit operands (one CUTLASS instantiation each).  fprop/dgrad write D in
// the input dtype; wgrad writes fp32 (beta = 1 accumulates).
cudaError_t grouped_gemm_bf16_fprop(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_bf16_dgrad(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_bf16_wgrad(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_fp16_fprop(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_fp16_dgrad(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_fp16_wgrad(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_bf16_wgrad_bf16out(const GroupedGemmArgs& args);  // bf16 dW
// fprop / dgrad with 64-row tiles, for groups of <= 128 rows (heuristics16.h).
cudaError_t grouped_gemm_bf16_fprop_rows64(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_bf16_dgrad_rows64(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_fp16_fprop_rows64(const GroupedGemmArgs& args);
cudaError_t grouped_gemm_fp16_dgrad_rows64(const GroupedGemmArgs& args);

// wgrad helper: zero dW_t of every member with M_t == 0 (the GEMM gives such
// members no tiles).  (G, N, K) of elem_bytes-sized elements, N*K*elem_bytes
// a multiple of 16.
cudaError_t zero_empty_wgrad(void* d, size_t elem_bytes, const grouped::GroupRows& rows, int num_groups, int64_t n,
                             int64_t k, cudaStream_t stream);

// Row epilogue of a token-grouped (total_rows, n) output: rows below
// rows.row[G] get y += bias[member] (fp32 math, one rounding), rows at or past
// it are zeroed when zero_tail.  Without a bias only the tail is visited (its
// size is a device value: a fixed grid strides over it, ~free when empty).
// dtype 0 = bf16, 1 = fp16, 2 = fp32; bias member t at bias + t * n in y's
// dtype (may be null).
cudaError_t grouped_row_epilogue(void* y, const void* bias, int dtype, const grouped::GroupRows& rows,
                                 int num_groups, int64_t total_rows, int64_t n, bool zero_tail,
                                 cudaStream_t stream);

}  // namespace gemm
}  // namespace lpmoe
