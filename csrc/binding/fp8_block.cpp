// Binding of the FP8 block-scaling kernels.  Python (lpmoe/fp8_block_ops.py)
// validates shapes and allocates; this layer checks what would be unsafe for
// a kernel (devices, dtypes, contiguity, alignment) and launches.
#include "binding/common.h"
#include "binding/ops.h"
#include "fp8_block/fp8_block.h"
#include "grouped/group_rows.h"

namespace lpmoe {
namespace binding {

void fp8_block_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                        int64_t num_tensors, bool e5m2, int64_t block_dim, bool pow2_scales, double amax_epsilon,
                        const c10::optional<at::Tensor>& out_data, const c10::optional<at::Tensor>& out_scale,
                        const c10::optional<at::Tensor>& out_col_data,
                        const c10::optional<at::Tensor>& out_col_scale, bool pad_columnwise_tokens,
                        const c10::optional<at::Tensor>& noop, const c10::optional<at::Tensor>& dbias_workspace,
                        int64_t max_row_tiles, const c10::optional<at::Tensor>& row_source) {
  check_cuda(input, "x");
  check_contiguous(input, "x");
  TORCH_CHECK(input.dim() == 2, "lpmoe: `x` must be 2-D");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0, "lpmoe: `x` must be 16-byte aligned");
  TORCH_CHECK(out_data.has_value() == out_scale.has_value() && out_col_data.has_value() == out_col_scale.has_value(),
              "lpmoe: data and scale outputs come in pairs");
  if (noop.has_value()) {
    TORCH_CHECK(noop->scalar_type() == at::kFloat && noop->numel() >= 1, "lpmoe: `noop_flag` must be a float32 tensor");
  }
  // With row_source the grouped input has row_source.size(0) rows, row r
  // read from input row row_source[r] (QuantizeArgs::row_source).
  const int64_t cols = input.size(1);
  int64_t rows = input.size(0);
  if (row_source.has_value()) {
    check_same_device(*row_source, input, "row_source", "x");
    TORCH_CHECK(row_source->scalar_type() == at::kInt && row_source->dim() == 1 && row_source->is_contiguous(),
                "lpmoe: `row_source` must be a contiguous 1-D int32 tensor, got ", row_source->scalar_type(), " ",
                row_source->sizes());
    TORCH_CHECK(input.size(0) < (int64_t(1) << 31), "lpmoe: a gathered quantize's source rows must fit int32");
    TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf,
                "lpmoe: a gathered quantize reads bfloat16/float16 tokens, got ", input.scalar_type());
    TORCH_CHECK(pad_columnwise_tokens || !out_col_data.has_value() || block_dim != 1 || row_source->size(0) % 8 == 0,
                "lpmoe: a gathered quantize with an unpadded transposed copy needs a multiple of 8 rows");
    rows = row_source->size(0);
  }
  if (out_data.has_value()) {
    check_buffer(*out_data, input, "output.rowwise_data", 1, rows * cols);
    check_buffer(*out_scale, input, "output.scale_inv", 4, 0);
    TORCH_CHECK(out_scale->scalar_type() == at::kFloat, "lpmoe: FP8 block scale_inv must be float32");
  }
  if (out_col_data.has_value()) {
    check_buffer(*out_col_data, input, "output.columnwise_data", 1, rows * cols);
    check_buffer(*out_col_scale, input, "output.columnwise_scale_inv", 4, 0);
    TORCH_CHECK(out_col_scale->scalar_type() == at::kFloat, "lpmoe: FP8 block columnwise_scale_inv must be float32");
  }
  if (dbias_workspace.has_value()) {
    check_buffer(*dbias_workspace, input, "dbias workspace", 4, max_row_tiles * cols);
  }
  c10::cuda::CUDAGuard guard(input.device());
  fp8_block::QuantizeArgs a;
  a.input = input.data_ptr();
  a.input_dtype = to_hp_dtype(input.scalar_type(), "x");
  a.rows = rows;
  a.cols = cols;
  a.group = group_rows_arg(padded_row_offsets, num_tensors, input);
  if (row_source.has_value()) {
    a.row_source = row_source->data_ptr<int32_t>();
    a.source_rows = input.size(0);
  }
  a.e5m2 = e5m2;
  a.block_dim = static_cast<int>(block_dim);
  a.pow2_scales = pow2_scales;
  a.amax_epsilon = static_cast<float>(amax_epsilon);
  a.out_data = opt_ptr(out_data, input, "output.rowwise_data");
  a.out_scale = static_cast<float*>(opt_ptr(out_scale, input, "output.scale_inv"));
  a.out_col_data = opt_ptr(out_col_data, input, "output.columnwise_data");
  a.out_col_scale = static_cast<float*>(opt_ptr(out_col_scale, input, "output.columnwise_scale_inv"));
  a.pad_columnwise_tokens = pad_columnwise_tokens;
  a.noop = static_cast<const float*>(opt_ptr(noop, input, "noop_flag"));
  a.dbias_workspace = static_cast<float*>(opt_ptr(dbias_workspace, input, "dbias workspace"));
  a.max_row_tiles = max_row_tiles;
  LPMOE_CHECK_LAUNCH(fp8_block::launch_quantize(a, current_stream()), "fp8_block quantize");
}

std::tuple<int64_t, int64_t, int64_t> fp8_block_quantize_kernel_launches() {
  using fp8_block::QuantizeKernel;
  return {fp8_block::quantize_kernel_launches(QuantizeKernel::kPersistent),
          fp8_block::quantize_kernel_launches(QuantizeKernel::kTile),
          fp8_block::quantize_kernel_launches(QuantizeKernel::kTileColumns)};
}

std::tuple<int64_t, int64_t, int64_t, int64_t> fp8_block_dequantize_kernel_launches() {
  using fp8_block::DequantizeKernel;
  return {fp8_block::dequantize_kernel_launches(DequantizeKernel::kRows),
          fp8_block::dequantize_kernel_launches(DequantizeKernel::kColumnsStaged),
          fp8_block::dequantize_kernel_launches(DequantizeKernel::kColumnsRegisters),
          fp8_block::dequantize_kernel_launches(DequantizeKernel::kColumnsStagedTma)};
}

void fp8_block_dbias_reduce(const at::Tensor& workspace, const c10::optional<at::Tensor>& padded_row_offsets,
                            int64_t num_tensors, int64_t rows, const at::Tensor& out,
                            const c10::optional<at::Tensor>& noop) {
  check_cuda(workspace, "workspace");
  c10::cuda::CUDAGuard guard(workspace.device());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == num_tensors && out.is_contiguous(), "lpmoe: dbias must be (N, K)");
  TORCH_CHECK(num_tensors <= 65535, "lpmoe: at most 65535 members per dbias reduction, got ", num_tensors);
  TORCH_CHECK(workspace.scalar_type() == at::kFloat && workspace.is_contiguous(), "lpmoe: dbias workspace must be fp32");
  fp8_block::DbiasReduceArgs a;
  a.workspace = workspace.data_ptr<float>();
  a.group = group_rows_arg(padded_row_offsets, num_tensors, workspace);
  a.rows = rows;
  a.cols = out.size(1);
  a.out_dtype = to_hp_dtype(out.scalar_type(), "dbias");
  a.out = out.data_ptr();
  a.noop = static_cast<const float*>(opt_ptr(noop, workspace, "noop_flag"));
  LPMOE_CHECK_LAUNCH(fp8_block::launch_dbias_reduce(a, current_stream()), "fp8_block dbias reduce");
}

void fp8_block_dequantize(const at::Tensor& data, const at::Tensor& scale, bool columnwise,
                          bool pad_columnwise_tokens, bool e5m2, int64_t block_dim, int64_t rows, int64_t cols,
                          const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                          const at::Tensor& out, int64_t max_row_tiles) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "lpmoe: FP8 block scale_inv must be float32");
  check_dequantize_buffers(data, scale, out, 4, rows * cols, rows * cols);
  c10::cuda::CUDAGuard guard(data.device());
  fp8_block::DequantizeArgs a;
  a.data = data.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.columnwise = columnwise;
  a.pad_columnwise_tokens = pad_columnwise_tokens;
  a.e5m2 = e5m2;
  a.block_dim = static_cast<int>(block_dim);
  a.rows = rows;
  a.cols = cols;
  a.group = group_rows_arg(padded_row_offsets, num_tensors, data);
  a.out_dtype = to_hp_dtype(out.scalar_type(), "out dtype");
  a.out = out.data_ptr();
  a.max_row_tiles = max_row_tiles;
  LPMOE_CHECK_LAUNCH(fp8_block::launch_dequantize(a, current_stream()), "fp8_block dequantize");
}

}  // namespace binding
}  // namespace lpmoe
