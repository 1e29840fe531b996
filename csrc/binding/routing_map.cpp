// Binding of the routing map kernels (csrc/routing_map).  Python
// (lpmoe/moe/routing_map.py) allocates; this layer checks and launches.
#include <ATen/cuda/CUDAContext.h>

#include "binding/common.h"
#include "binding/ops.h"
#include "routing_map/routing_map.h"

namespace lpmoe {
namespace binding {

int64_t routing_map_chunks(int64_t slots) { return routing_map::chunks(slots); }

void routing_map(const at::Tensor& indices, int64_t experts, int64_t capacity, bool padded, const at::Tensor& counts,
                 const at::Tensor& totals, const at::Tensor& row_map, const at::Tensor& m_splits,
                 const c10::optional<at::Tensor>& used, const at::Tensor& dropped) {
  check_cuda(indices, "indices");
  check_contiguous(indices, "indices");
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
              "lpmoe: `indices` must be int32 or int64, got ", indices.scalar_type());
  const int64_t slots = indices.numel();
  TORCH_CHECK(slots < (int64_t{1} << 31), "lpmoe: `indices` has ", slots, " slots; the int32 row map takes < 2^31");
  TORCH_CHECK(experts >= 1 && experts <= routing_map::kMaxExperts, "lpmoe: the routing map kernel takes 1..",
              routing_map::kMaxExperts, " experts, got ", experts);
  // (a division: experts * capacity could wrap for a huge capacity)
  TORCH_CHECK(!padded || (capacity >= 0 && capacity <= (int64_t{1} << 31) / experts - 1),
              "lpmoe: the padded layout needs 0 <= capacity and experts * capacity < 2^31, got capacity ", capacity);
  check_dense(counts, indices, "counts", "indices", at::kInt, routing_map::chunks(slots) * experts);
  check_dense(totals, indices, "totals", "indices", at::kInt, experts);
  check_dense(row_map, indices, "row_map", "indices", at::kInt, slots);
  check_dense(m_splits, indices, "m_splits", "indices", at::kLong, experts);
  check_dense(dropped, indices, "dropped", "indices", at::kLong, 1);
  routing_map::Args a;
  if (used.has_value()) {
    check_dense(*used, indices, "used", "indices", at::kLong, 1);
    a.used = used->data_ptr<int64_t>();
  }
  a.indices = indices.data_ptr();
  a.indices_int64 = indices.scalar_type() == at::kLong;
  a.slots = slots;
  a.experts = static_cast<int>(experts);
  a.capacity = capacity;
  a.padded = padded;
  a.counts = counts.data_ptr<int32_t>();
  a.totals = totals.data_ptr<int32_t>();
  a.row_map = row_map.data_ptr<int32_t>();
  a.m_splits = m_splits.data_ptr<int64_t>();
  a.dropped = dropped.data_ptr<int64_t>();
  const c10::cuda::CUDAGuard guard(indices.device());
  LPMOE_CHECK_LAUNCH(routing_map::launch_routing_map(a, current_stream()), "routing map");
}

}  // namespace binding
}  // namespace lpmoe
