// Binding of the fused router scoring kernel (csrc/router).  Python
// (lpmoe/moe/router_kernel.py) allocates; this layer checks and launches.
#include <ATen/cuda/CUDAContext.h>

#include "binding/common.h"
#include "binding/ops.h"
#include "router/topk_router.h"

namespace lpmoe {
namespace binding {

int64_t router_grid_size(int64_t tokens) {
  return router::grid_size(tokens, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
}

void router_topk(const at::Tensor& logits, int64_t k, bool sigmoid, bool normalize, const at::Tensor& probs,
                 const at::Tensor& indices, const c10::optional<at::Tensor>& lse,
                 const c10::optional<at::Tensor>& affinity, const c10::optional<at::Tensor>& counts) {
  check_cuda(logits, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "lpmoe: `logits` must be (tokens, experts), got ", logits.sizes());
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(e >= 1 && e <= router::kMaxExperts && k >= 1 && k <= router::kMaxTopK && k <= e,
              "lpmoe: the fused router takes 1..", router::kMaxExperts, " experts and 1..", router::kMaxTopK,
              " <= experts slots, got ", e, " experts, k ", k);
  auto check_out = [&](const at::Tensor& x, at::ScalarType dt, int64_t numel, const char* name) {
    check_same_device(x, logits, name, "logits");
    TORCH_CHECK(x.scalar_type() == dt && x.is_contiguous() && x.numel() == numel, "lpmoe: `", name,
                "` must be a contiguous ", dt, " tensor of ", numel, " elements");
  };
  check_out(probs, at::kFloat, t * k, "probs");
  check_out(indices, at::kLong, t * k, "indices");
  router::TopKArgs a;
  a.logits = logits.data_ptr();
  a.dtype = to_hp_dtype(logits.scalar_type(), "logits");
  a.tokens = t;
  a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.normalize = normalize;
  a.probs = probs.data_ptr<float>();
  a.indices = indices.data_ptr<int64_t>();
  if (lse.has_value()) {
    check_out(*lse, at::kFloat, t, "lse");
    a.lse = lse->data_ptr<float>();
  }
  if (affinity.has_value()) {
    check_out(*affinity, at::kFloat, router_grid_size(t) * e, "affinity");
    a.affinity = affinity->data_ptr<float>();
  }
  if (counts.has_value()) {
    check_out(*counts, at::kInt, router_grid_size(t) * e, "counts");
    a.counts = counts->data_ptr<int32_t>();
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  LPMOE_CHECK_LAUNCH(router::launch_topk(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                         current_stream()),
                     "router top-k");
}

void router_backward(const at::Tensor& logits, const at::Tensor& indices, const c10::optional<at::Tensor>& grad_probs,
                     const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_affinity,
                     bool sigmoid, bool normalize, const at::Tensor& grad_logits) {
  check_cuda(logits, "logits");
  check_contiguous(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "lpmoe: `logits` must be (tokens, experts), got ", logits.sizes());
  TORCH_CHECK(indices.dim() == 2 && indices.size(0) == logits.size(0), "lpmoe: `indices` must be (tokens, k), got ",
              indices.sizes());
  const int64_t t = logits.size(0), e = logits.size(1), k = indices.size(1);
  TORCH_CHECK(e >= 1 && e <= router::kMaxExperts && k >= 1 && k <= router::kMaxTopK && k <= e,
              "lpmoe: the router backward takes 1..", router::kMaxExperts, " experts and 1..", router::kMaxTopK,
              " <= experts slots, got ", e, " experts, k ", k);
  auto check_in = [&](const at::Tensor& x, at::ScalarType dt, int64_t numel, const char* name) {
    check_same_device(x, logits, name, "logits");
    TORCH_CHECK(x.scalar_type() == dt && x.is_contiguous() && x.numel() == numel, "lpmoe: `", name,
                "` must be a contiguous ", dt, " tensor of ", numel, " elements");
  };
  check_in(indices, at::kLong, t * k, "indices");
  check_in(grad_logits, logits.scalar_type(), t * e, "grad_logits");
  router::BackwardArgs a;
  a.logits = logits.data_ptr();
  a.dtype = to_hp_dtype(logits.scalar_type(), "logits");
  a.tokens = t;
  a.experts = static_cast<int>(e);
  a.k = static_cast<int>(k);
  a.sigmoid = sigmoid;
  a.normalize = normalize;
  a.indices = indices.data_ptr<int64_t>();
  if (grad_probs.has_value()) {
    check_in(*grad_probs, at::kFloat, t * k, "grad_probs");
    a.grad_probs = grad_probs->data_ptr<float>();
  }
  if (grad_lse.has_value()) {
    check_in(*grad_lse, at::kFloat, t, "grad_lse");
    a.grad_lse = grad_lse->data_ptr<float>();
  }
  if (grad_affinity.has_value()) {
    check_in(*grad_affinity, at::kFloat, e, "grad_affinity");
    a.grad_affinity = grad_affinity->data_ptr<float>();
  }
  a.grad_logits = grad_logits.data_ptr();
  const c10::cuda::CUDAGuard guard(logits.device());
  LPMOE_CHECK_LAUNCH(router::launch_backward(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                                             current_stream()),
                     "router backward");
}

}  // namespace binding
}  // namespace lpmoe
