// Binding of the token permutation kernels (csrc/permute).  Python
// (lpmoe/moe/kernels.py) computes the routing map and allocates; this layer
// checks what would be unsafe for a kernel and launches.
#include <ATen/cuda/CUDAContext.h>

#include "binding/common.h"
#include "binding/ops.h"
#include "permute/permute.h"

namespace lpmoe {
namespace binding {
namespace {

void check_rows(const at::Tensor& t, const at::Tensor& ref, const char* name, int64_t cols) {
  check_same_device(t, ref, name, "input");
  check_contiguous(t, name);
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols, "lpmoe: `", name, "` must be (rows, ", cols, "), got ", t.sizes());
}

// (tokens, k) int32 map and optional fp32 scales of the same shape.
void check_map(const at::Tensor& row_map, const c10::optional<at::Tensor>& scale, const at::Tensor& ref,
               int64_t tokens) {
  check_same_device(row_map, ref, "row_map", "input");
  TORCH_CHECK(row_map.scalar_type() == at::kInt && row_map.is_contiguous() && row_map.dim() == 2 &&
                  row_map.size(0) == tokens,
              "lpmoe: `row_map` must be a contiguous int32 (", tokens, ", k) tensor, got ", row_map.scalar_type(),
              " ", row_map.sizes());
  TORCH_CHECK(row_map.size(1) >= 1 && row_map.size(1) <= permute::kMaxSlots, "lpmoe: `row_map` must have 1..",
              permute::kMaxSlots, " slots per token, got ", row_map.size(1));
  if (scale.has_value()) {
    check_same_device(*scale, ref, "scale", "input");
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->sizes() == row_map.sizes(),
                "lpmoe: `scale` must be a contiguous fp32 tensor shaped like row_map ", row_map.sizes());
  }
}

// src (rows, cols) and dst (rows', cols) of one dtype, contiguous, on one CUDA device; returns cols.
int64_t check_src_dst(const at::Tensor& src, const at::Tensor& dst) {
  check_cuda(src, "src");
  TORCH_CHECK(src.dim() == 2, "lpmoe: `src` must be 2-D, got ", src.sizes());
  check_contiguous(src, "src");
  check_rows(dst, src, "dst", src.size(1));
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "lpmoe: `dst` must have src's dtype ", src.scalar_type());
  return src.size(1);
}

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

}  // namespace

void permute_scatter(const at::Tensor& src, const at::Tensor& row_map, const c10::optional<at::Tensor>& scale,
                     const at::Tensor& dst, const c10::optional<at::Tensor>& zero_from,
                     const c10::optional<at::Tensor>& dot_with, const c10::optional<at::Tensor>& dot_out,
                     bool raw) {
  const int64_t cols = check_src_dst(src, dst);
  check_map(row_map, scale, src, src.size(0));
  TORCH_CHECK(row_map.numel() < (int64_t(1) << 31) && dst.size(0) < (int64_t(1) << 31),
              "lpmoe: permutation rows must fit int32");
  permute::ScatterArgs a;
  a.src = src.data_ptr();
  a.dst = dst.data_ptr();
  a.row_map = row_map.data_ptr<int32_t>();
  a.tokens = src.size(0);
  a.k = row_map.size(1);
  a.cols = cols;
  a.out_rows = dst.size(0);
  a.raw = raw;
  if (raw) {
    TORCH_CHECK(!scale.has_value() && !dot_with.has_value(), "lpmoe: a raw (byte) scatter takes no scale or dot");
    a.elem_bytes = static_cast<int>(src.element_size());
  } else {
    a.dtype = to_hp_dtype(src.scalar_type(), "src");
  }
  if (scale.has_value()) a.scale = scale->data_ptr<float>();
  if (zero_from.has_value()) {
    check_same_device(*zero_from, src, "zero_from", "src");
    TORCH_CHECK(zero_from->scalar_type() == at::kLong && zero_from->numel() == 1,
                "lpmoe: `zero_from` must be one int64 value on the device");
    a.zero_from = zero_from->data_ptr<int64_t>();
  }
  TORCH_CHECK(dot_with.has_value() == dot_out.has_value(), "lpmoe: `dot_with` and `dot_out` come together");
  if (dot_with.has_value()) {
    check_rows(*dot_with, src, "dot_with", cols);
    TORCH_CHECK(dot_with->scalar_type() == src.scalar_type() && dot_with->size(0) == dst.size(0),
                "lpmoe: `dot_with` must be shaped and typed like dst");
    TORCH_CHECK(dot_out->scalar_type() == at::kFloat && dot_out->is_contiguous() &&
                    dot_out->sizes() == row_map.sizes(),
                "lpmoe: `dot_out` must be a contiguous fp32 tensor shaped like row_map");
    check_same_device(*dot_out, src, "dot_out", "src");
    a.dot_with = dot_with->data_ptr();
    a.dot_out = dot_out->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(src.device());
  LPMOE_CHECK_LAUNCH(permute::launch_scatter(a, sm_count(), current_stream()), "permute scatter");
}

void permute_gather(const at::Tensor& src, const at::Tensor& row_map, const c10::optional<at::Tensor>& scale,
                    const at::Tensor& dst) {
  const int64_t cols = check_src_dst(src, dst);
  check_map(row_map, scale, src, dst.size(0));
  TORCH_CHECK(src.size(0) < (int64_t(1) << 31), "lpmoe: permutation rows must fit int32");
  permute::GatherArgs a;
  a.src = src.data_ptr();
  a.dst = dst.data_ptr();
  a.row_map = row_map.data_ptr<int32_t>();
  a.scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
  a.tokens = dst.size(0);
  a.k = row_map.size(1);
  a.cols = cols;
  a.src_rows = src.size(0);
  a.dtype = to_hp_dtype(src.scalar_type(), "src");
  const c10::cuda::CUDAGuard guard(src.device());
  LPMOE_CHECK_LAUNCH(permute::launch_gather(a, sm_count(), current_stream()), "permute gather");
}

void permute_row_sources(const at::Tensor& row_map, const at::Tensor& row_source) {
  check_cuda(row_map, "row_map");
  check_map(row_map, c10::nullopt, row_map, row_map.size(0));
  check_same_device(row_source, row_map, "row_source", "row_map");
  TORCH_CHECK(row_source.scalar_type() == at::kInt && row_source.dim() == 1 && row_source.is_contiguous(),
              "lpmoe: `row_source` must be a contiguous 1-D int32 tensor, got ", row_source.scalar_type(), " ",
              row_source.sizes());
  TORCH_CHECK(row_source.size(0) < (int64_t(1) << 31) && row_map.size(0) < (int64_t(1) << 31),
              "lpmoe: permutation rows and tokens must fit int32");
  permute::RowSourcesArgs a;
  a.row_map = row_map.data_ptr<int32_t>();
  a.row_source = row_source.data_ptr<int32_t>();
  a.tokens = row_map.size(0);
  a.k = row_map.size(1);
  a.rows = row_source.size(0);
  const c10::cuda::CUDAGuard guard(row_map.device());
  LPMOE_CHECK_LAUNCH(permute::launch_row_sources(a, sm_count(), current_stream()), "permute row sources");
}

}  // namespace binding
}  // namespace lpmoe
