// Binding of the fused activation kernels (csrc/activation).  Python
// (lpmoe/activation/kernels.py) validates shapes and allocates; this layer
// checks what would be unsafe for a kernel (devices, dtypes, contiguity,
// alignment, sizes) and launches.
#include "activation/activation.h"
#include "activation/heuristics.h"
#include "binding/common.h"
#include "binding/ops.h"

namespace lpmoe {
namespace binding {
namespace {

activation::Common common_args(const at::Tensor& h, int64_t kind, double alpha, double limit, int64_t ffn,
                               const c10::optional<at::Tensor>& probs,
                               const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                               int64_t max_row_tiles, int64_t sigmoid_table) {
  check_cuda(h, "h");
  check_contiguous(h, "h");
  TORCH_CHECK(h.dim() == 2, "lpmoe: `h` must be 2-D");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0, "lpmoe: `h` must be 16-byte aligned");
  TORCH_CHECK(kind >= 0 && kind <= 4, "lpmoe: unknown activation kind ", kind);
  TORCH_CHECK(sigmoid_table >= -1 && sigmoid_table <= 1, "lpmoe: `sigmoid_table` must be -1 (auto), 0 or 1, got ",
              sigmoid_table);
  activation::Common c;
  c.sigmoid_table = static_cast<activation::SigmoidTable>(sigmoid_table);
  c.kind = static_cast<activation::Kind>(kind);
  c.params.alpha = static_cast<float>(alpha);
  c.params.limit = static_cast<float>(limit);
  c.dtype = to_hp_dtype(h.scalar_type(), "h");
  c.rows = h.size(0);
  c.ffn = ffn;
  const int64_t w = activation::is_glu(c.kind) ? 2 * ffn : ffn;
  TORCH_CHECK(ffn % 16 == 0 && h.size(1) == w, "lpmoe: `h` must be (rows, ", w, ") with F a multiple of 16, got ",
              h.sizes());
  if (probs.has_value()) {
    check_same_device(*probs, h, "probs", "h");
    TORCH_CHECK(probs->scalar_type() == at::kFloat && probs->is_contiguous() && probs->numel() == c.rows,
                "lpmoe: `probs` must be a contiguous fp32 tensor of ", c.rows, " rows");
    c.probs = probs->data_ptr<float>();
  }
  c.group = group_rows_arg(padded_row_offsets, num_tensors, h);
  c.max_row_tiles = max_row_tiles;
  return c;
}

// FP8 block 1x128 output buffers of a (rows, cols) tensor; all absent = none.
fp8_block::QuantizeArgs fp8_output(const at::Tensor& ref, int64_t cols, const c10::optional<at::Tensor>& data,
                                   const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& col_data,
                                   const c10::optional<at::Tensor>& col_scale, bool pow2_scales, double amax_epsilon,
                                   const char* what) {
  TORCH_CHECK(data.has_value() == scale.has_value() && col_data.has_value() == col_scale.has_value(),
              "lpmoe: ", what, ": data and scale outputs come in pairs");
  const int64_t rows = ref.size(0);
  fp8_block::QuantizeArgs q;
  q.rows = rows;
  q.cols = cols;
  q.block_dim = 1;
  q.pow2_scales = pow2_scales;
  q.amax_epsilon = static_cast<float>(amax_epsilon);
  q.pad_columnwise_tokens = true;
  for (const auto* t : {&data, &col_data}) {
    if (t->has_value()) {
      check_buffer(**t, ref, what, 1, rows * cols);
      TORCH_CHECK((*t)->scalar_type() == at::kFloat8_e4m3fn, "lpmoe: ", what, " FP8 data must be E4M3");
    }
  }
  for (const auto* t : {&scale, &col_scale}) {
    if (t->has_value()) {
      check_buffer(**t, ref, what, 4, 0);
      TORCH_CHECK((*t)->scalar_type() == at::kFloat, "lpmoe: ", what, " scale_inv must be float32");
    }
  }
  q.out_data = data.has_value() ? data->data_ptr() : nullptr;
  q.out_scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  q.out_col_data = col_data.has_value() ? col_data->data_ptr() : nullptr;
  q.out_col_scale = col_scale.has_value() ? col_scale->data_ptr<float>() : nullptr;
  return q;
}

void* hp_output(const c10::optional<at::Tensor>& t, const at::Tensor& ref, int64_t cols, const char* what) {
  if (!t.has_value()) return nullptr;
  check_buffer(*t, ref, what, ref.element_size(), ref.size(0) * cols);
  TORCH_CHECK(t->scalar_type() == ref.scalar_type(), "lpmoe: ", what, " must have h's dtype ", ref.scalar_type());
  return t->data_ptr();
}

}  // namespace

void activation_forward(const at::Tensor& h, int64_t kind, double alpha, double limit, int64_t ffn,
                        const c10::optional<at::Tensor>& probs, const c10::optional<at::Tensor>& padded_row_offsets,
                        int64_t num_tensors, int64_t max_row_tiles, const c10::optional<at::Tensor>& out,
                        const c10::optional<at::Tensor>& fp8_data, const c10::optional<at::Tensor>& fp8_scale,
                        const c10::optional<at::Tensor>& fp8_col_data, const c10::optional<at::Tensor>& fp8_col_scale,
                        bool pow2_scales, double amax_epsilon, int64_t sigmoid_table) {
  activation::ForwardArgs a;
  a.c = common_args(h, kind, alpha, limit, ffn, probs, padded_row_offsets, num_tensors, max_row_tiles, sigmoid_table);
  a.h = h.data_ptr();
  a.out = hp_output(out, h, ffn, "out");
  a.fp8 = fp8_output(h, ffn, fp8_data, fp8_scale, fp8_col_data, fp8_col_scale, pow2_scales, amax_epsilon, "a (FP8)");
  c10::cuda::CUDAGuard guard(h.device());
  LPMOE_CHECK_LAUNCH(activation::launch_forward(a, current_stream()), "activation forward");
}

void activation_backward(const at::Tensor& da, const at::Tensor& h, int64_t kind, double alpha, double limit,
                         int64_t ffn, const c10::optional<at::Tensor>& probs,
                         const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                         int64_t max_row_tiles, const c10::optional<at::Tensor>& dh,
                         const c10::optional<at::Tensor>& dh_data, const c10::optional<at::Tensor>& dh_scale,
                         const c10::optional<at::Tensor>& dh_col_data, const c10::optional<at::Tensor>& dh_col_scale,
                         const c10::optional<at::Tensor>& dbias_workspace,
                         const c10::optional<at::Tensor>& probs_partials, bool pow2_scales, double amax_epsilon,
                         int64_t sigmoid_table) {
  activation::BackwardArgs a;
  a.c = common_args(h, kind, alpha, limit, ffn, probs, padded_row_offsets, num_tensors, max_row_tiles, sigmoid_table);
  check_buffer(da, h, "da", h.element_size(), h.size(0) * ffn);
  TORCH_CHECK(da.scalar_type() == h.scalar_type() && da.dim() == 2 && da.size(1) == ffn,
              "lpmoe: `da` must be (rows, ", ffn, ") of h's dtype, got ", da.scalar_type(), " ", da.sizes());
  const int64_t w = h.size(1);
  a.da = da.data_ptr();
  a.h = h.data_ptr();
  a.dh = hp_output(dh, h, w, "dh");
  a.dh_fp8 = fp8_output(h, w, dh_data, dh_scale, dh_col_data, dh_col_scale, pow2_scales, amax_epsilon, "dh (FP8)");
  if (dbias_workspace.has_value()) {
    check_buffer(*dbias_workspace, h, "dbias workspace", 4, max_row_tiles * w);
    a.dh_fp8.dbias_workspace = dbias_workspace->data_ptr<float>();
  }
  if (probs_partials.has_value()) {
    check_buffer(*probs_partials, h, "probs partials", 4, h.size(0) * ((ffn + 127) / 128));
    a.probs_partials = probs_partials->data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(h.device());
  LPMOE_CHECK_LAUNCH(activation::launch_backward(a, current_stream()), "activation backward");
}

int64_t activation_sigmoid_table_launches() { return activation::sigmoid_table_launches(); }

double activation_dram_bytes_per_sm_cycle(int64_t device_index) {
  int count = 0;
  TORCH_CHECK(cudaGetDeviceCount(&count) == cudaSuccess && device_index >= 0 && device_index < count,
              "lpmoe: `device_index` must name a CUDA device (0..", count - 1, "), got ", device_index);
  return activation::dram_bytes_per_sm_cycle(static_cast<int>(device_index));
}

void activation_probs_grad(const at::Tensor& partials, int64_t rows, int64_t blocks,
                           const c10::optional<at::Tensor>& used_rows, const at::Tensor& out) {
  check_cuda(partials, "partials");
  check_buffer(partials, partials, "partials", 4, rows * blocks);
  check_buffer(out, partials, "dprobs", 4, rows);
  TORCH_CHECK(out.scalar_type() == at::kFloat, "lpmoe: dprobs must be float32");
  activation::ProbsGradArgs a;
  a.partials = partials.data_ptr<float>();
  a.rows = rows;
  a.blocks = blocks;
  if (used_rows.has_value()) {
    check_same_device(*used_rows, partials, "used_rows", "partials");
    TORCH_CHECK(used_rows->scalar_type() == at::kLong && used_rows->numel() >= 1, "lpmoe: used_rows must be int64");
    a.used_rows = used_rows->data_ptr<int64_t>();
  }
  a.out = out.data_ptr<float>();
  c10::cuda::CUDAGuard guard(partials.device());
  LPMOE_CHECK_LAUNCH(activation::launch_probs_grad(a, current_stream()), "activation probs grad");
}

}  // namespace binding
}  // namespace lpmoe
