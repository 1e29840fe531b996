// Binding of the grouped GEMM backends.  Python (lpmoe/gemm) validates the
// operands' shapes, dtypes and quantization roles and picks the buffers; this
// layer checks what would be unsafe for a kernel (device, arch, contiguity,
// alignment, sizes it can see) and launches.
#include <ATen/cuda/CUDAContext.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "binding/common.h"
#include "binding/ops.h"
#include "fp8_gemm/block_scaled.h"
#include "fp8_gemm/heuristics.h"
#include "fp8_gemm/wgrad.h"
#include "gemm/cublaslt_matmul.h"
#include "gemm/grouped_gemm.h"
#include "gemm/heuristics16.h"

namespace lpmoe {
namespace binding {
namespace {

enum Fmt : int64_t { kBF16 = 0, kFP16 = 1, kFP8 = 2, kFP32 = 3 };

gemm::GemmKind to_kind(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "lpmoe: kind must be 0 (fprop), 1 (dgrad) or 2 (wgrad)");
  return static_cast<gemm::GemmKind>(kind);
}

void check_operand(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_cuda(t, name);
  check_same_device(t, ref, name, "a");
  check_contiguous(t, name);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "lpmoe: `", name, "` must be 16-byte aligned");
}

void check_hopper(const at::Tensor& ref, const char* what) {
  const auto* prop = at::cuda::getDeviceProperties(ref.device().index());
  TORCH_CHECK(prop->major == 9, "lpmoe: ", what, " needs an sm_90 (Hopper) GPU; this is sm_", prop->major,
              prop->minor,
              ". FP8 block scaling GEMMs exist only on Hopper (use the MXFP8 recipe on Blackwell); "
              "16-bit grouped GEMMs on other GPUs: use backend='cublas' or torch._grouped_mm");
}

}  // namespace

std::tuple<int64_t, int64_t> fp8_block_scaled_choice(int64_t a_rows, int64_t num_groups, int64_t n_cols,
                                                     int64_t sm_count) {
  TORCH_CHECK(a_rows >= 0 && num_groups >= 1 && n_cols >= 1 && sm_count >= 1,
              "lpmoe: fp8_block_scaled_choice needs a_rows >= 0, num_groups >= 1, n_cols >= 1, sm_count >= 1");
  const auto c = fp8_gemm::choose_config(a_rows, static_cast<int>(num_groups), n_cols, static_cast<int>(sm_count));
  return {c.block_n, c.cluster};  // (-1, 0): the CUTLASS kernel
}

std::tuple<int64_t, int64_t> fp8_wgrad_choice(int64_t n, int64_t k) {
  TORCH_CHECK(n >= 1 && k >= 1, "lpmoe: fp8_wgrad_choice needs n >= 1 and k >= 1");
  const auto c = fp8_gemm::choose_wgrad_config(k);  // the choice depends on K only
  return {c.block_n, c.cluster};
}

int64_t grouped_gemm_setup_bytes(int64_t num_groups) {
  TORCH_CHECK(num_groups >= 0, "lpmoe: num_groups must be >= 0");
  return static_cast<int64_t>(gemm::grouped_gemm_setup_bytes(static_cast<int>(num_groups)));
}

std::tuple<int64_t, int64_t, int64_t> grouped_gemm_cutlass(
    int64_t kind, int64_t fmt, const at::Tensor& a, const c10::optional<at::Tensor>& a_scale, const at::Tensor& b,
    const c10::optional<at::Tensor>& b_ptrs, int64_t b_member_elems, const c10::optional<at::Tensor>& b_scale,
    int64_t b_scale_member_elems, const at::Tensor& d, const at::Tensor& padded_row_offsets, int64_t num_groups,
    int64_t n, int64_t k, double beta, const at::Tensor& setup, const at::Tensor& workspace, int64_t fp8_width,
    int64_t fp8_cluster, bool zero_tail) {
  const gemm::GemmKind gk = to_kind(kind);
  const fp8_gemm::BlockScaledConfig pinned{static_cast<int>(fp8_width), static_cast<int>(fp8_cluster)};
  const bool main_grad = fp8_gemm::wgrad_fp32_accumulate(beta, d.scalar_type() == at::kFloat);
  const bool config_exists = gk == gemm::GemmKind::kWgrad
                                 ? fp8_gemm::wgrad_supports(pinned, static_cast<int>(num_groups), main_grad)
                                 : fp8_gemm::block_scaled_supports(pinned, static_cast<int>(num_groups));
  if (!(fp8_width == -1 || (fp8_width == 0 && fp8_cluster == 0) || config_exists)) {
    throw std::invalid_argument("lpmoe: FP8 " + std::string(gk == gemm::GemmKind::kWgrad ? "wgrad " : "") +
                                "kernel config (width " + std::to_string(fp8_width) + ", cluster " +
                                std::to_string(fp8_cluster) + ") does not exist in this build for " +
                                std::to_string(num_groups) + " groups");
  }
  check_operand(a, a, "a");
  check_operand(b, a, "b");
  check_operand(d, a, "out");
  check_hopper(a, "the grouped GEMM backend");
  TORCH_CHECK(n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0,
              "lpmoe: grouped GEMM needs N and K multiples of 16 (16-byte TMA rows), got N=", n, " K=", k);
  TORCH_CHECK(num_groups >= 1, "lpmoe: num_groups must be >= 1");
  check_operand(setup, a, "setup workspace");
  check_operand(workspace, a, "workspace");
  TORCH_CHECK(setup.nbytes() >= gemm::grouped_gemm_setup_bytes(static_cast<int>(num_groups)),
              "lpmoe: setup workspace too small");
  const bool fp8 = fmt == kFP8;
  TORCH_CHECK(fmt == kBF16 || fmt == kFP16 || fp8, "lpmoe: grouped backend supports bf16, fp16 and FP8 block");
  TORCH_CHECK(!fp8 || gk != gemm::GemmKind::kWgrad ||
                  workspace.nbytes() >= fp8_gemm::wgrad_map_bytes(static_cast<int>(num_groups)),
              "lpmoe: workspace too small for the FP8 wgrad kernel's per-member TMA maps (", num_groups,
              " groups need ", fp8_gemm::wgrad_map_bytes(static_cast<int>(num_groups)), " bytes, got ",
              workspace.nbytes(), ")");
  if (fp8) {
    TORCH_CHECK(a_scale.has_value() && b_scale.has_value(), "lpmoe: FP8 operands need their scales");
    check_operand(*a_scale, a, "a scales");
    check_operand(*b_scale, a, "b scales");
    TORCH_CHECK(a_scale->scalar_type() == at::kFloat && b_scale->scalar_type() == at::kFloat,
                "lpmoe: FP8 block scales must be float32");
  }
  const bool wgrad_bf16 = gk == gemm::GemmKind::kWgrad && d.scalar_type() == at::kBFloat16 && fmt != kFP16;
  TORCH_CHECK(wgrad_bf16 ||
                  d.scalar_type() == (gk == gemm::GemmKind::kWgrad ? at::kFloat
                                                                   : (fmt == kFP16 ? at::kHalf : at::kBFloat16)),
              "lpmoe: grouped backend output dtype mismatch (fprop/dgrad: bf16, fp16 for fp16 inputs; wgrad: fp32, "
              "or bf16 for bf16/FP8 inputs), got ", d.scalar_type());
  const int64_t a_rows = a.numel() / (gk == gemm::GemmKind::kFprop ? k : n);
  if (gk == gemm::GemmKind::kWgrad) {
    TORCH_CHECK(d.numel() >= num_groups * n * k, "lpmoe: wgrad out must hold G*N*K elements");
  } else {
    TORCH_CHECK(d.numel() >= a_rows * (gk == gemm::GemmKind::kFprop ? n : k), "lpmoe: out is smaller than rows x cols");
    if (!b_ptrs.has_value()) {
      TORCH_CHECK(b.numel() >= num_groups * b_member_elems, "lpmoe: weights buffer smaller than G members");
    }
  }
  if (b_ptrs.has_value()) {
    check_operand(*b_ptrs, a, "b_ptrs");
    TORCH_CHECK(b_ptrs->scalar_type() == at::kLong && b_ptrs->numel() == num_groups,
                "lpmoe: b_ptrs must be int64 with one address per group");
  }
  c10::cuda::CUDAGuard guard(a.device());
  gemm::GroupedGemmArgs args;
  args.kind = gk;
  args.num_groups = static_cast<int>(num_groups);
  args.n = n;
  args.k = k;
  args.rows = group_rows_arg(padded_row_offsets, num_groups, a);
  TORCH_CHECK(args.rows.row != nullptr, "lpmoe: grouped GEMM needs padded_row_offsets");
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.b_ptrs = b_ptrs.has_value() ? b_ptrs->data_ptr<int64_t>() : nullptr;
  args.b_member_elems = b_member_elems;
  args.d = d.data_ptr();
  args.wgrad_bf16 = wgrad_bf16;
  args.beta = static_cast<float>(beta);
  args.zero_tail = zero_tail && gk != gemm::GemmKind::kWgrad;
  args.d_rows = args.zero_tail ? a_rows : 0;
  args.a_scale = a_scale.has_value() ? a_scale->data_ptr<float>() : nullptr;
  args.b_scale = b_scale.has_value() ? b_scale->data_ptr<float>() : nullptr;
  args.b_scale_member_elems = b_scale_member_elems;
  args.setup = setup.data_ptr();
  args.setup_bytes = setup.nbytes();
  args.workspace = workspace.data_ptr();
  args.workspace_bytes = workspace.nbytes();
  args.sm_count = at::cuda::getDeviceProperties(a.device().index())->multiProcessorCount;
  args.stream = current_stream();
  cudaError_t st = cudaErrorNotSupported;
  fp8_gemm::BlockScaledConfig ran{-1, 0};  // CUTLASS
  bool wgrad_tma_store = false;
  if (fp8 && fp8_width != -1) {
    // lpmoe's block-scaled kernels.  The heuristic's choice (zeros) falls
    // back to CUTLASS where they cannot run (discrete weights, too many
    // groups); a forced configuration fails instead.
    const fp8_gemm::BlockScaledConfig want{static_cast<int>(fp8_width), static_cast<int>(fp8_cluster)};
    const bool forced = fp8_width != 0 || fp8_cluster != 0;
    st = gk == gemm::GemmKind::kWgrad ? fp8_gemm::run_wgrad(args, a_rows, want, &ran, &wgrad_tma_store)
                                      : fp8_gemm::run_block_scaled(args, a_rows, want, &ran);
    if (st == cudaErrorNotSupported && forced) {
      throw std::invalid_argument(std::string("lpmoe: the FP8 block-scaled ") +
                                  (gk == gemm::GemmKind::kWgrad ? "wgrad" : "fprop/dgrad") +
                                  " kernel cannot run this call with config (width " +
                                  std::to_string(fp8_width) + ", cluster " + std::to_string(fp8_cluster) + ")");
    }
  }
  if (st == cudaErrorNotSupported) {
    ran = fp8_gemm::BlockScaledConfig{-1, 0};
    if (fp8) {
      st = gk != gemm::GemmKind::kWgrad ? gemm::fp8_block_grouped_gemm_1x128_128x128(args)
           : wgrad_bf16                 ? gemm::fp8_block_grouped_gemm_wgrad_bf16out(args)
                                        : gemm::fp8_block_grouped_gemm_wgrad(args);
    } else {
      // 16-bit: the tile's rows are reported like the FP8 kernel's width
      // (CALLS["16bit_rows<M>"]); wgrad's K loop runs over tokens, so its
      // tiles are full whatever the group sizes and it keeps one tile.
      const bool rows64 = gk != gemm::GemmKind::kWgrad &&
                          gemm::choose_tile16(a_rows, static_cast<int>(num_groups)) == gemm::Tile16::kRows64;
      const bool bf16 = fmt == kBF16;
      if (gk == gemm::GemmKind::kFprop) {
        st = rows64 ? (bf16 ? gemm::grouped_gemm_bf16_fprop_rows64(args) : gemm::grouped_gemm_fp16_fprop_rows64(args))
                    : (bf16 ? gemm::grouped_gemm_bf16_fprop(args) : gemm::grouped_gemm_fp16_fprop(args));
      } else if (gk == gemm::GemmKind::kDgrad) {
        st = rows64 ? (bf16 ? gemm::grouped_gemm_bf16_dgrad_rows64(args) : gemm::grouped_gemm_fp16_dgrad_rows64(args))
                    : (bf16 ? gemm::grouped_gemm_bf16_dgrad(args) : gemm::grouped_gemm_fp16_dgrad(args));
      } else {
        st = !bf16 ? gemm::grouped_gemm_fp16_wgrad(args)
             : wgrad_bf16 ? gemm::grouped_gemm_bf16_wgrad_bf16out(args)
                          : gemm::grouped_gemm_bf16_wgrad(args);
      }
      ran = fp8_gemm::BlockScaledConfig{rows64 ? 64 : 128, 0};
    }
  }
  TORCH_CHECK(st != cudaErrorNotSupported, "lpmoe: this build has no sm_90a grouped GEMM code (build with "
              "TORCH_CUDA_ARCH_LIST containing 9.0a)");
  LPMOE_CHECK_LAUNCH(st, "grouped GEMM");
  return {ran.block_n, ran.cluster, wgrad_tma_store ? 1 : 0};
}

void grouped_gemm_cublas(int64_t kind, int64_t fmt, const at::Tensor& a, const c10::optional<at::Tensor>& a_scale,
                         const std::vector<int64_t>& b_addrs, const std::vector<int64_t>& b_scale_addrs,
                         const c10::optional<at::Tensor>& b_token, const c10::optional<at::Tensor>& b_token_scale,
                         const at::Tensor& d, const std::vector<int64_t>& splits, int64_t n, int64_t k, double beta,
                         const at::Tensor& workspace, bool weights_e5m2) {
  const gemm::GemmKind gk = to_kind(kind);
  check_operand(a, a, "a");
  check_operand(d, a, "out");
  check_operand(workspace, a, "workspace");
  const bool fp8 = fmt == kFP8;
  const int64_t g = static_cast<int64_t>(splits.size());
  const bool wgrad = gk == gemm::GemmKind::kWgrad;
  if (fp8) check_hopper(a, "FP8 block scaling cuBLASLt GEMMs");
  if (wgrad) {
    TORCH_CHECK(b_token.has_value(), "lpmoe: wgrad needs the token-grouped `b`");
    check_operand(*b_token, a, "b");
    TORCH_CHECK(d.numel() >= g * n * k, "lpmoe: wgrad out must hold G*N*K elements");
  } else {
    TORCH_CHECK(static_cast<int64_t>(b_addrs.size()) == g, "lpmoe: one weight address per group");
  }
  if (fp8) {
    TORCH_CHECK(a_scale.has_value(), "lpmoe: FP8 operands need scales");
    check_operand(*a_scale, a, "a scales");
    if (wgrad) {
      TORCH_CHECK(b_token_scale.has_value(), "lpmoe: FP8 wgrad needs b's scales");
      check_operand(*b_token_scale, a, "b scales");
    } else {
      TORCH_CHECK(static_cast<int64_t>(b_scale_addrs.size()) == g, "lpmoe: one weight-scale address per group");
    }
  }
  cudaDataType_t in_t = fmt == kBF16 ? CUDA_R_16BF : fmt == kFP16 ? CUDA_R_16F : fmt == kFP32 ? CUDA_R_32F
                                                                                              : CUDA_R_8F_E4M3;
  if (fp8) in_t = a.scalar_type() == at::kFloat8_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  // b's element type: the token operand's (wgrad) or the weights' (passed
  // in, only their addresses are here).
  cudaDataType_t b_t = in_t;
  if (fp8) {
    const bool b_e5m2 = wgrad ? b_token->scalar_type() == at::kFloat8_e5m2 : weights_e5m2;
    b_t = b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    TORCH_CHECK(!(b_e5m2 && in_t == CUDA_R_8F_E5M2),
                "lpmoe: FP8 GEMMs need at least one E4M3 operand (E5M2 x E5M2 has no tensor-core kernel)");
  }
  cudaDataType_t d_t = d.scalar_type() == at::kFloat ? CUDA_R_32F : d.scalar_type() == at::kHalf ? CUDA_R_16F
                                                                                                  : CUDA_R_16BF;
  const int64_t esz = fp8 ? 1 : a.element_size();
  const int64_t dsz = d.element_size();
  c10::cuda::CUDAGuard guard(a.device());
  gemm::LtContext ctx;
  ctx.handle = at::cuda::getCurrentCUDABlasLtHandle();
  ctx.stream = current_stream();
  ctx.workspace = workspace.data_ptr();
  ctx.workspace_bytes = workspace.nbytes();
  const char* a_base = static_cast<const char*>(a.data_ptr());
  char* d_base = static_cast<char*>(d.data_ptr());
  const float* as = fp8 ? a_scale->data_ptr<float>() : nullptr;
  const auto vec = fp8 ? gemm::LtScale::kVec128 : gemm::LtScale::kNone;
  const auto blk = fp8 ? gemm::LtScale::kBlk128x128 : gemm::LtScale::kNone;
  int64_t row = 0, pad4 = 0, pad128 = 0;
  for (int64_t t = 0; t < g; ++t) {
    const int64_t m = splits[t];
    TORCH_CHECK(m >= 0, "lpmoe: negative split");
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    gemm::LtOperand A, B;
    A.type = b_t;  // cuBLAS A is lpmoe's b (weights, or x for wgrad)
    B.type = in_t;
    if (gk == gemm::GemmKind::kFprop && m > 0) {
      // D^T (N x M_t) = W_t (stored K x N col-major, transposed) . x_t^T
      A.ptr = reinterpret_cast<const void*>(b_addrs[t]);
      A.transpose = true;
      A.ld = k;
      A.scale = fp8 ? reinterpret_cast<const float*>(b_scale_addrs[t]) : nullptr;
      A.scale_mode = blk;
      B.ptr = a_base + row * k * esz;
      B.ld = k;
      B.scale = fp8 ? as + (k + 127) / 128 * pad4 : nullptr;
      B.scale_mode = vec;
      st = gemm::lt_matmul(ctx, n, m, k, A, B, d_base + row * n * dsz, d_t, n, 0.0f);
    } else if (gk == gemm::GemmKind::kDgrad && m > 0) {
      // D^T (K x M_t) = W_t^T . dy_t^T
      A.ptr = reinterpret_cast<const void*>(b_addrs[t]);
      if (fp8) {  // transposed weight copy (K, round_up(N,128)), read transposed
        A.transpose = true;
        A.ld = (n + 127) / 128 * 128;
        A.scale = reinterpret_cast<const float*>(b_scale_addrs[t]);
        A.scale_mode = blk;
      } else {  // W_t (N, K) row-major == (K x N) column-major
        A.transpose = false;
        A.ld = k;
      }
      B.ptr = a_base + row * n * esz;
      B.ld = n;
      B.scale = fp8 ? as + (n + 127) / 128 * pad4 : nullptr;
      B.scale_mode = vec;
      st = gemm::lt_matmul(ctx, k, m, n, A, B, d_base + row * k * dsz, d_t, k, 0.0f);
    } else if (wgrad) {
      char* dt = d_base + t * n * k * dsz;
      const int64_t mpad = (m + 127) / 128 * 128;
      if (m == 0) {
        if (beta == 0.0) LPMOE_CHECK_LAUNCH(cudaMemsetAsync(dt, 0, n * k * dsz, ctx.stream), "memset");
      } else if (fp8) {
        // D^T (K x N) = x_t^T (K x Mpad) . dy_t (Mpad x N), columnwise copies
        const char* bb = static_cast<const char*>(b_token->data_ptr());
        A.ptr = bb + k * pad128;
        A.transpose = true;
        A.ld = mpad;
        A.scale = b_token_scale->data_ptr<float>() + (k + 3) / 4 * 4 * (pad128 / 128);
        A.scale_mode = vec;
        B.ptr = a_base + n * pad128;
        B.transpose = false;
        B.ld = mpad;
        B.scale = as + (n + 3) / 4 * 4 * (pad128 / 128);
        B.scale_mode = vec;
        st = gemm::lt_matmul(ctx, k, n, mpad, A, B, dt, d_t, k, static_cast<float>(beta));
      } else {
        // D^T (K x N) = x_t^T . dy_t: x_t (M_t,K) row-major == (K x M_t) col-major
        const char* bb = static_cast<const char*>(b_token->data_ptr());
        A.ptr = bb + row * k * esz;
        A.transpose = false;
        A.ld = k;
        B.ptr = a_base + row * n * esz;
        B.transpose = true;
        B.ld = n;
        st = gemm::lt_matmul(ctx, k, n, m, A, B, dt, d_t, k, static_cast<float>(beta));
      }
    }
    TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "lpmoe: cuBLASLt matmul of group ", t, " failed (status ",
                static_cast<int>(st), st == CUBLAS_STATUS_NOT_SUPPORTED ? ": no algorithm for this configuration" : "",
                ")");
    row += m;
    pad4 += (m + 3) / 4 * 4;
    pad128 += (m + 127) / 128 * 128;
  }
}

void grouped_row_epilogue(const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& padded_row_offsets, int64_t num_groups, bool zero_tail) {
  check_operand(y, y, "out");
  TORCH_CHECK(y.dim() == 2, "lpmoe: out must be 2-D");
  const int dt = y.scalar_type() == at::kBFloat16 ? 0 : y.scalar_type() == at::kHalf ? 1
                 : y.scalar_type() == at::kFloat  ? 2 : -1;
  TORCH_CHECK(dt >= 0, "lpmoe: out must be bf16, fp16 or fp32");
  if (bias.has_value()) {
    check_operand(*bias, y, "bias");
    TORCH_CHECK(bias->scalar_type() == y.scalar_type() && bias->numel() == num_groups * y.size(1),
                "lpmoe: bias must be (G, N) in the output dtype");
  }
  c10::cuda::CUDAGuard guard(y.device());
  auto rows = group_rows_arg(padded_row_offsets, num_groups, y);
  LPMOE_CHECK_LAUNCH(gemm::grouped_row_epilogue(y.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr, dt, rows,
                                                static_cast<int>(num_groups), y.size(0), y.size(1), zero_tail,
                                                current_stream()),
                     "grouped row epilogue");
}

}  // namespace binding
}  // namespace lpmoe
