// Binding of the fused optimizer kernels (csrc/optim).  Python
// (lpmoe/optim/kernels.py) chooses the scalars and the output buffers; this
// layer checks what would be unsafe for the kernel and launches.
#include <vector>

#include "binding/common.h"
#include "binding/ops.h"
#include "optim/adamw_fp8_block.h"

namespace lpmoe {
namespace binding {

namespace {

// Every tensor of `list` is a contiguous, 16-byte aligned CUDA tensor of
// dtype `dt` and ref's shape and device.
void check_members(const std::vector<at::Tensor>& list, const at::Tensor& ref, const char* name,
                   at::ScalarType dt) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    check_cuda(t, name);
    check_same_device(t, ref, name, "params[0]");
    TORCH_CHECK(t.scalar_type() == dt, "lpmoe: `", name, "[", i, "]` must be ", dt, ", got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == ref.sizes(), "lpmoe: `", name, "[", i, "]` has shape ", t.sizes(), ", expected ",
                ref.sizes());
    check_contiguous(t, name);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "lpmoe: `", name, "[", i,
                "]` must be 16-byte aligned");
  }
}

}  // namespace

void adamw_fp8_block_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<double>& scalars, bool e5m2, bool pow2_scales, double amax_epsilon,
                          const at::Tensor& out_data, const at::Tensor& out_scale, const at::Tensor& out_col_data,
                          const at::Tensor& out_col_scale) {
  const size_t g = params.size();
  TORCH_CHECK(g >= 1, "lpmoe: adamw_fp8_block_step needs at least one parameter");
  TORCH_CHECK(grads.size() == g && exp_avgs.size() == g && exp_avg_sqs.size() == g,
              "lpmoe: params, grads, exp_avgs and exp_avg_sqs must have the same length, got ", g, ", ",
              grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK(g < (size_t(1) << 20), "lpmoe: too many parameters in one fused step: ", g);
  TORCH_CHECK(scalars.size() == 8, "lpmoe: adamw_fp8_block_step takes 8 scalars, got ", scalars.size());
  const at::Tensor& ref = params[0];
  TORCH_CHECK(ref.dim() == 2, "lpmoe: fused AdamW parameters must be 2-D (out, in), got ", ref.sizes());
  // fp32 parameters are stepped in place; bf16 / fp16 ones through their
  // fp32 masters (then one per parameter), with gradients of their dtype
  const at::ScalarType pt = ref.scalar_type();
  const bool master = pt != at::kFloat;
  TORCH_CHECK(pt == at::kFloat || pt == at::kBFloat16 || pt == at::kHalf,
              "lpmoe: fused AdamW parameters must be float32, bfloat16 or float16, got ", pt);
  TORCH_CHECK(masters.size() == (master ? g : 0), "lpmoe: ",
              master ? "16-bit parameters need one float32 master per parameter"
                     : "float32 parameters take no masters",
              ", got ", masters.size(), " masters for ", g, " parameters");
  check_members(params, ref, "params", pt);
  check_members(grads, ref, "grads", pt);
  check_members(masters, ref, "masters", at::kFloat);
  check_members(exp_avgs, ref, "exp_avgs", at::kFloat);
  check_members(exp_avg_sqs, ref, "exp_avg_sqs", at::kFloat);
  const int64_t n = ref.size(0), k = ref.size(1);
  TORCH_CHECK(k % 16 == 0, "lpmoe: FP8 block scaling needs in_features to be a multiple of 16, got ", k);
  const int64_t members = static_cast<int64_t>(g);
  const int64_t bx = (k + 127) / 128, by = (n + 127) / 128;
  const int64_t pad128 = (n + 127) / 128 * 128;
  check_buffer(out_data, ref, "rowwise_data", 1, members * n * k);
  check_buffer(out_col_data, ref, "columnwise_data", 1, members * pad128 * k);
  check_buffer(out_scale, ref, "scale_inv", 4, members * by * ((bx + 3) / 4 * 4));
  check_buffer(out_col_scale, ref, "columnwise_scale_inv", 4, members * bx * ((by + 3) / 4 * 4));
  TORCH_CHECK(out_scale.scalar_type() == at::kFloat && out_col_scale.scalar_type() == at::kFloat,
              "lpmoe: FP8 block scales must be float32");

  std::vector<void*> p(g);
  std::vector<const void*> gr(g);
  std::vector<float*> w(master ? g : 0), m(g), v(g);
  for (size_t i = 0; i < g; ++i) {
    p[i] = params[i].data_ptr();
    gr[i] = grads[i].data_ptr();
    if (master) w[i] = masters[i].data_ptr<float>();
    m[i] = exp_avgs[i].data_ptr<float>();
    v[i] = exp_avg_sqs[i].data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(ref.device());
  optim::AdamWFp8BlockArgs a;
  a.num_tensors = static_cast<int>(g);
  a.rows = n;
  a.cols = k;
  a.dtype = pt == at::kFloat ? DType::kFloat32 : pt == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  a.params = p.data();
  a.grads = gr.data();
  a.masters = master ? w.data() : nullptr;
  a.exp_avgs = m.data();
  a.exp_avg_sqs = v.data();
  optim::AdamWScalars& s = a.scalars;
  s.decay = static_cast<float>(scalars[0]);
  s.beta1 = static_cast<float>(scalars[1]);
  s.one_minus_beta1 = static_cast<float>(scalars[2]);
  s.beta2 = static_cast<float>(scalars[3]);
  s.one_minus_beta2 = static_cast<float>(scalars[4]);
  s.step_size = static_cast<float>(scalars[5]);
  s.bias_correction2_sqrt = static_cast<float>(scalars[6]);
  s.eps = static_cast<float>(scalars[7]);
  a.quantized.e5m2 = e5m2;
  a.quantized.pow2_scales = pow2_scales;
  a.quantized.amax_epsilon = static_cast<float>(amax_epsilon);
  a.quantized.out_data = out_data.data_ptr();
  a.quantized.out_scale = out_scale.data_ptr<float>();
  a.quantized.out_col_data = out_col_data.data_ptr();
  a.quantized.out_col_scale = out_col_scale.data_ptr<float>();
  LPMOE_CHECK_LAUNCH(optim::launch_adamw_fp8_block(a, current_stream()), "fused AdamW + FP8 block quantize");
}

int64_t adamw_fp8_block_launches() { return optim::adamw_fp8_block_launches(); }

}  // namespace binding
}  // namespace lpmoe
