// Bindings of the MXFP8 and NVFP4 kernels.  Python (lpmoe/mx_ops.py) checks
// shapes and allocates; this layer checks what would be unsafe and launches.
#include "binding/common.h"
#include "binding/ops.h"
#include "mxfp8/mxfp8.h"
#include "nvfp4/nvfp4.h"

namespace lpmoe {
namespace binding {
namespace {

const int64_t* opt_long(const c10::optional<at::Tensor>& t, const at::Tensor& ref, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kLong, "lpmoe: `", name, "` must be int64");
  return static_cast<const int64_t*>(opt_ptr(t, ref, name));
}

mxfp8::Members members_arg(const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                           bool by_elements, const c10::optional<at::Tensor>& offsets,
                           const c10::optional<at::Tensor>& first_dims, const c10::optional<at::Tensor>& last_dims,
                           int64_t common_first, int64_t common_last, const at::Tensor& ref) {
  mxfp8::Members m;
  m.by_elements = by_elements;
  if (by_elements) {
    TORCH_CHECK(offsets.has_value() && offsets->numel() == num_tensors + 1,
                "lpmoe: varying-dims groups need tensor_offsets with num_tensors+1 entries");
    m.rows.num_tensors = static_cast<int>(num_tensors);
    m.offsets = opt_long(offsets, ref, "tensor_offsets");
    m.first_dims = opt_long(first_dims, ref, "first_dims");
    m.last_dims = opt_long(last_dims, ref, "last_dims");
    m.common_first = common_first;
    m.common_last = common_last;
  } else {
    m.rows = group_rows_arg(padded_row_offsets, num_tensors, ref);
  }
  return m;
}

}  // namespace

void mxfp8_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                    int64_t num_tensors, bool by_elements, const c10::optional<at::Tensor>& offsets,
                    const c10::optional<at::Tensor>& first_dims, const c10::optional<at::Tensor>& last_dims,
                    int64_t common_first, int64_t common_last, int64_t rows, int64_t cols, bool e5m2,
                    bool swizzled, const c10::optional<at::Tensor>& out_data,
                    const c10::optional<at::Tensor>& out_scale, const c10::optional<at::Tensor>& out_col_data,
                    const c10::optional<at::Tensor>& out_col_scale, const c10::optional<at::Tensor>& noop,
                    int64_t num_tiles) {
  check_cuda(input, "x");
  check_contiguous(input, "x");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0, "lpmoe: `x` must be 16-byte aligned");
  TORCH_CHECK(out_data.has_value() == out_scale.has_value() && out_col_data.has_value() == out_col_scale.has_value(),
              "lpmoe: data and scale outputs come in pairs");
  TORCH_CHECK(input.numel() >= rows * cols, "lpmoe: `x` holds ", input.numel(), " elements, the shape needs ",
              rows * cols);
  if (out_data.has_value()) {
    check_buffer(*out_data, input, "output.rowwise_data", 1, rows * cols);
    check_buffer(*out_scale, input, "output.scale_inv", 1, 0);
  }
  if (out_col_data.has_value()) {
    check_buffer(*out_col_data, input, "output.columnwise_data", 1, rows * cols);
    check_buffer(*out_col_scale, input, "output.columnwise_scale_inv", 1, 0);
  }
  c10::cuda::CUDAGuard guard(input.device());
  mxfp8::QuantizeArgs a;
  a.input = input.data_ptr();
  a.input_dtype = to_hp_dtype(input.scalar_type(), "x");
  a.rows = rows;
  a.cols = cols;
  a.numel = rows * cols;  // members must lie inside the logical shape the outputs were sized for
  a.members = members_arg(padded_row_offsets, num_tensors, by_elements, offsets, first_dims, last_dims, common_first,
                          common_last, input);
  a.e5m2 = e5m2;
  a.swizzled = swizzled;
  a.out_data = opt_ptr(out_data, input, "output.rowwise_data");
  a.out_scale = static_cast<uint8_t*>(opt_ptr(out_scale, input, "output.scale_inv"));
  a.out_col_data = opt_ptr(out_col_data, input, "output.columnwise_data");
  a.out_col_scale = static_cast<uint8_t*>(opt_ptr(out_col_scale, input, "output.columnwise_scale_inv"));
  a.noop = static_cast<const float*>(opt_ptr(noop, input, "noop_flag"));
  a.num_tiles = num_tiles;
  LPMOE_CHECK_LAUNCH(mxfp8::launch_quantize(a, current_stream()), "mxfp8 quantize");
}

void mxfp8_dequantize(const at::Tensor& data, const at::Tensor& scale, bool columnwise, bool swizzled, bool e5m2,
                      const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors, bool by_elements,
                      const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& first_dims,
                      const c10::optional<at::Tensor>& last_dims, int64_t common_first, int64_t common_last,
                      int64_t rows, int64_t cols, const at::Tensor& out, int64_t num_tiles) {
  TORCH_CHECK(scale.scalar_type() == at::kByte, "lpmoe: MXFP8 scales must be uint8 (E8M0)");
  check_dequantize_buffers(data, scale, out, 1, rows * cols, rows * cols);
  c10::cuda::CUDAGuard guard(data.device());
  mxfp8::DequantizeArgs a;
  a.data = data.data_ptr();
  a.scale = scale.data_ptr<uint8_t>();
  a.columnwise = columnwise;
  a.swizzled = swizzled;
  a.e5m2 = e5m2;
  a.rows = rows;
  a.cols = cols;
  a.numel = rows * cols;
  a.members = members_arg(padded_row_offsets, num_tensors, by_elements, offsets, first_dims, last_dims, common_first,
                          common_last, data);
  a.out_dtype = to_hp_dtype(out.scalar_type(), "out dtype");
  a.out = out.data_ptr();
  a.num_tiles = num_tiles;
  LPMOE_CHECK_LAUNCH(mxfp8::launch_dequantize(a, current_stream()), "mxfp8 dequantize");
}

std::tuple<int64_t, int64_t> mxfp8_dequantize_kernel_launches() {
  using mxfp8::DequantizeKernel;
  return {mxfp8::dequantize_kernel_launches(DequantizeKernel::kStores),
          mxfp8::dequantize_kernel_launches(DequantizeKernel::kTmaStores)};
}

void nvfp4_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                    int64_t num_tensors, bool swizzled, const c10::optional<at::Tensor>& out_data,
                    const c10::optional<at::Tensor>& out_scale, const c10::optional<at::Tensor>& out_col_data,
                    const c10::optional<at::Tensor>& out_col_scale, const at::Tensor& amax,
                    const c10::optional<at::Tensor>& col_amax, const c10::optional<at::Tensor>& noop,
                    int64_t max_row_tiles) {
  check_cuda(input, "x");
  check_contiguous(input, "x");
  TORCH_CHECK(input.dim() == 2, "lpmoe: `x` must be 2-D");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0, "lpmoe: `x` must be 16-byte aligned");
  TORCH_CHECK(amax.scalar_type() == at::kFloat && amax.numel() >= num_tensors, "lpmoe: amax must be fp32 (N,)");
  const int64_t half = input.numel() / 2;
  if (out_data.has_value()) {
    check_buffer(*out_data, input, "output.rowwise_data", 1, half);
    check_buffer(*out_scale, input, "output.scale_inv", 1, 0);
  }
  if (out_col_data.has_value()) {
    check_buffer(*out_col_data, input, "output.columnwise_data", 1, half);
    check_buffer(*out_col_scale, input, "output.columnwise_scale_inv", 1, 0);
  }
  if (col_amax.has_value()) {
    TORCH_CHECK(col_amax->scalar_type() == at::kFloat && col_amax->numel() >= num_tensors,
                "lpmoe: columnwise_amax must be fp32 (N,)");
  }
  c10::cuda::CUDAGuard guard(input.device());
  nvfp4::QuantizeArgs a;
  a.input = input.data_ptr();
  a.input_dtype = to_hp_dtype(input.scalar_type(), "x");
  a.rows = input.size(0);
  a.cols = input.size(1);
  a.group = group_rows_arg(padded_row_offsets, num_tensors, input);
  a.swizzled = swizzled;
  a.out_data = static_cast<uint8_t*>(opt_ptr(out_data, input, "output.rowwise_data"));
  a.out_scale = static_cast<uint8_t*>(opt_ptr(out_scale, input, "output.scale_inv"));
  a.out_col_data = static_cast<uint8_t*>(opt_ptr(out_col_data, input, "output.columnwise_data"));
  a.out_col_scale = static_cast<uint8_t*>(opt_ptr(out_col_scale, input, "output.columnwise_scale_inv"));
  a.amax = static_cast<float*>(opt_ptr(amax, input, "output.amax"));
  a.col_amax = static_cast<float*>(opt_ptr(col_amax, input, "output.columnwise_amax"));
  a.noop = static_cast<const float*>(opt_ptr(noop, input, "noop_flag"));
  a.max_row_tiles = max_row_tiles;
  LPMOE_CHECK_LAUNCH(nvfp4::launch_quantize(a, current_stream()), "nvfp4 quantize");
}

void nvfp4_dequantize(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& amax, bool swizzled,
                      const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors, int64_t rows,
                      int64_t cols, const at::Tensor& out, int64_t max_row_tiles) {
  check_same_device(amax, data, "amax", "data");
  TORCH_CHECK(amax.scalar_type() == at::kFloat && amax.numel() >= num_tensors, "lpmoe: amax must be fp32 (N,)");
  check_dequantize_buffers(data, scale, out, 1, rows * cols / 2, rows * cols);
  c10::cuda::CUDAGuard guard(data.device());
  nvfp4::DequantizeArgs a;
  a.data = static_cast<const uint8_t*>(data.data_ptr());
  a.scale = static_cast<const uint8_t*>(scale.data_ptr());
  a.amax = amax.data_ptr<float>();
  a.swizzled = swizzled;
  a.rows = rows;
  a.cols = cols;
  a.group = group_rows_arg(padded_row_offsets, num_tensors, data);
  a.out_dtype = to_hp_dtype(out.scalar_type(), "out dtype");
  a.out = out.data_ptr();
  a.max_row_tiles = max_row_tiles;
  LPMOE_CHECK_LAUNCH(nvfp4::launch_dequantize(a, current_stream()), "nvfp4 dequantize");
}

}  // namespace binding
}  // namespace lpmoe
