// Binding of the device splits -> offsets kernel.
#include "binding/common.h"
#include "binding/ops.h"
#include "grouped/splits_to_offsets.h"

namespace lpmoe {
namespace binding {

namespace {
void check_split_tensor(const at::Tensor& s, int64_t num_splits, const char* name) {
  check_cuda(s, name);
  check_contiguous(s, name);
  TORCH_CHECK(s.dim() == 1 && s.size(0) == num_splits, "lpmoe: `", name, "` must be 1-D of length ",
              num_splits, ", got shape ", s.sizes());
  TORCH_CHECK(s.scalar_type() == at::kLong || s.scalar_type() == at::kInt, "lpmoe: `", name,
              "` must be int32 or int64, got ", s.scalar_type());
}
}  // namespace

at::Tensor splits_to_offsets(const c10::optional<at::Tensor>& splits, int64_t num_splits, int64_t uniform_split,
                             const std::vector<int64_t>& strides, const std::vector<int64_t>& aligns,
                             const std::vector<bool>& times_second, const c10::optional<at::Tensor>& second,
                             int64_t capacity_rows, int64_t device_index) {
  const int64_t n_out = static_cast<int64_t>(strides.size());
  TORCH_CHECK(n_out == static_cast<int64_t>(aligns.size()) &&
                  n_out == static_cast<int64_t>(times_second.size()),
              "lpmoe: `strides`, `aligns` and `times_second` must have the same length");
  TORCH_CHECK(n_out <= grouped::kMaxOffsetOutputs, "lpmoe: at most ", grouped::kMaxOffsetOutputs,
              " offset outputs per launch, got ", n_out);
  TORCH_CHECK(num_splits >= 0, "lpmoe: `num_splits` must be >= 0");
  for (int64_t a : aligns) TORCH_CHECK(a >= 1, "lpmoe: every entry of `aligns` must be >= 1");

  at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  if (splits.has_value()) {
    check_split_tensor(*splits, num_splits, "splits");
    device = splits->device();
  } else {
    TORCH_CHECK(uniform_split >= 0, "lpmoe: `uniform_split` must be >= 0");
  }
  if (second.has_value()) {
    check_split_tensor(*second, num_splits, "second");
    TORCH_CHECK(second->device() == device, "lpmoe: `second` must be on ", device, ", got ", second->device());
  }
  for (int64_t j = 0; j < n_out; ++j) {
    TORCH_CHECK(!times_second[j] || second.has_value(),
                "lpmoe: an output multiplies by `second` but `second` was not given");
  }
  c10::cuda::CUDAGuard guard(device);

  // One allocation: each output padded to an even count of int64 so every
  // view starts 16-byte aligned; a final 2-slot block holds the status word.
  const int64_t per_out = ((num_splits + 1) + 1) / 2 * 2;
  at::Tensor bulk = at::empty({per_out * n_out + 2}, at::TensorOptions().dtype(at::kLong).device(device));

  grouped::SplitsToOffsetsArgs args;
  args.splits = splits.has_value() ? splits->data_ptr() : nullptr;
  args.splits_are_int64 = splits.has_value() ? splits->scalar_type() == at::kLong : true;
  args.uniform_split = uniform_split;
  args.second = second.has_value() ? second->data_ptr() : nullptr;
  args.second_is_int64 = second.has_value() ? second->scalar_type() == at::kLong : true;
  args.num_splits = static_cast<int>(num_splits);
  args.num_outputs = static_cast<int>(n_out);
  // The caller cuts the views it needs (making them here and converting
  // them to Python cost more host time than the launch).
  int64_t* base = bulk.data_ptr<int64_t>();
  for (int64_t j = 0; j < n_out; ++j) {
    args.outputs[j] = {base + j * per_out, strides[j], aligns[j], static_cast<bool>(times_second[j])};
  }
  args.status = base + per_out * n_out;
  args.capacity_rows = capacity_rows;
  LPMOE_CHECK_LAUNCH(grouped::launch_splits_to_offsets(args, current_stream()), "splits_to_offsets");
  return bulk;
}

}  // namespace binding
}  // namespace lpmoe
