// Declarations of every op the binding layer exposes; module.cpp registers them.
#pragma once

#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

namespace lpmoe {
namespace binding {

// Returns the one int64 buffer holding every output (16-byte aligned, at a
// pitch of round_up(num_splits + 1, 2)) and then the status word; see
// grouped/splits_to_offsets.h.
at::Tensor splits_to_offsets(const c10::optional<at::Tensor>& splits, int64_t num_splits, int64_t uniform_split,
                             const std::vector<int64_t>& strides, const std::vector<int64_t>& aligns,
                             const std::vector<bool>& times_second, const c10::optional<at::Tensor>& second,
                             int64_t capacity_rows, int64_t device_index);

// FP8 block scaling (csrc/fp8_block); see lpmoe/fp8_block_ops.py.
void fp8_block_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                        int64_t num_tensors, bool e5m2, int64_t block_dim, bool pow2_scales, double amax_epsilon,
                        const c10::optional<at::Tensor>& out_data, const c10::optional<at::Tensor>& out_scale,
                        const c10::optional<at::Tensor>& out_col_data,
                        const c10::optional<at::Tensor>& out_col_scale, bool pad_columnwise_tokens,
                        const c10::optional<at::Tensor>& noop, const c10::optional<at::Tensor>& dbias_workspace,
                        int64_t max_row_tiles, const c10::optional<at::Tensor>& row_source);
// Launch counts of the quantize kernels: (persistent, tile, tile_columns);
// tests use them to prove which kernel a call took.
std::tuple<int64_t, int64_t, int64_t> fp8_block_quantize_kernel_launches();
// ... and of the dequantize kernels: (rows, columns staged, columns registers,
// columns staged with TMA-store output).
std::tuple<int64_t, int64_t, int64_t, int64_t> fp8_block_dequantize_kernel_launches();
void fp8_block_dbias_reduce(const at::Tensor& workspace, const c10::optional<at::Tensor>& padded_row_offsets,
                            int64_t num_tensors, int64_t rows, const at::Tensor& out,
                            const c10::optional<at::Tensor>& noop);
void fp8_block_dequantize(const at::Tensor& data, const at::Tensor& scale, bool columnwise,
                          bool pad_columnwise_tokens, bool e5m2, int64_t block_dim, int64_t rows, int64_t cols,
                          const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                          const at::Tensor& out, int64_t max_row_tiles);

// MXFP8 and NVFP4 (csrc/mxfp8, csrc/nvfp4); see lpmoe/mx_ops.py.
void mxfp8_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                    int64_t num_tensors, bool by_elements, const c10::optional<at::Tensor>& offsets,
                    const c10::optional<at::Tensor>& first_dims, const c10::optional<at::Tensor>& last_dims,
                    int64_t common_first, int64_t common_last, int64_t rows, int64_t cols, bool e5m2,
                    bool swizzled, const c10::optional<at::Tensor>& out_data,
                    const c10::optional<at::Tensor>& out_scale, const c10::optional<at::Tensor>& out_col_data,
                    const c10::optional<at::Tensor>& out_col_scale, const c10::optional<at::Tensor>& noop,
                    int64_t num_tiles);
// Launches of the MXFP8 dequantize kernels: (16-byte stores, TMA-store tiles).
std::tuple<int64_t, int64_t> mxfp8_dequantize_kernel_launches();
void mxfp8_dequantize(const at::Tensor& data, const at::Tensor& scale, bool columnwise, bool swizzled, bool e5m2,
                      const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors, bool by_elements,
                      const c10::optional<at::Tensor>& offsets, const c10::optional<at::Tensor>& first_dims,
                      const c10::optional<at::Tensor>& last_dims, int64_t common_first, int64_t common_last,
                      int64_t rows, int64_t cols, const at::Tensor& out, int64_t num_tiles);
void nvfp4_quantize(const at::Tensor& input, const c10::optional<at::Tensor>& padded_row_offsets,
                    int64_t num_tensors, bool swizzled, const c10::optional<at::Tensor>& out_data,
                    const c10::optional<at::Tensor>& out_scale, const c10::optional<at::Tensor>& out_col_data,
                    const c10::optional<at::Tensor>& out_col_scale, const at::Tensor& amax,
                    const c10::optional<at::Tensor>& col_amax, const c10::optional<at::Tensor>& noop,
                    int64_t max_row_tiles);
void nvfp4_dequantize(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& amax, bool swizzled,
                      const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors, int64_t rows,
                      int64_t cols, const at::Tensor& out, int64_t max_row_tiles);

// Fused activations (csrc/activation); see lpmoe/activation/kernels.py.
void activation_forward(const at::Tensor& h, int64_t kind, double alpha, double limit, int64_t ffn,
                        const c10::optional<at::Tensor>& probs, const c10::optional<at::Tensor>& padded_row_offsets,
                        int64_t num_tensors, int64_t max_row_tiles, const c10::optional<at::Tensor>& out,
                        const c10::optional<at::Tensor>& fp8_data, const c10::optional<at::Tensor>& fp8_scale,
                        const c10::optional<at::Tensor>& fp8_col_data, const c10::optional<at::Tensor>& fp8_col_scale,
                        bool pow2_scales, double amax_epsilon, int64_t sigmoid_table);
void activation_backward(const at::Tensor& da, const at::Tensor& h, int64_t kind, double alpha, double limit,
                         int64_t ffn, const c10::optional<at::Tensor>& probs,
                         const c10::optional<at::Tensor>& padded_row_offsets, int64_t num_tensors,
                         int64_t max_row_tiles, const c10::optional<at::Tensor>& dh,
                         const c10::optional<at::Tensor>& dh_data, const c10::optional<at::Tensor>& dh_scale,
                         const c10::optional<at::Tensor>& dh_col_data, const c10::optional<at::Tensor>& dh_col_scale,
                         const c10::optional<at::Tensor>& dbias_workspace,
                         const c10::optional<at::Tensor>& probs_partials, bool pow2_scales, double amax_epsilon,
                         int64_t sigmoid_table);
// Sigmoid-table kernel launches so far, and the device figure that decides them.
int64_t activation_sigmoid_table_launches();
double activation_dram_bytes_per_sm_cycle(int64_t device_index);
void activation_probs_grad(const at::Tensor& partials, int64_t rows, int64_t blocks,
                           const c10::optional<at::Tensor>& used_rows, const at::Tensor& out);

// Token permutation (csrc/permute); see lpmoe/moe/kernels.py.
void permute_scatter(const at::Tensor& src, const at::Tensor& row_map, const c10::optional<at::Tensor>& scale,
                     const at::Tensor& dst, const c10::optional<at::Tensor>& zero_from,
                     const c10::optional<at::Tensor>& dot_with, const c10::optional<at::Tensor>& dot_out, bool raw);
void permute_gather(const at::Tensor& src, const at::Tensor& row_map, const c10::optional<at::Tensor>& scale,
                    const at::Tensor& dst);
void permute_row_sources(const at::Tensor& row_map, const at::Tensor& row_source);

// Routing map: slot -> grouped row (csrc/routing_map); see lpmoe/moe/routing_map.py.
int64_t routing_map_chunks(int64_t slots);
void routing_map(const at::Tensor& indices, int64_t experts, int64_t capacity, bool padded, const at::Tensor& counts,
                 const at::Tensor& totals, const at::Tensor& row_map, const at::Tensor& m_splits,
                 const c10::optional<at::Tensor>& used, const at::Tensor& dropped);

// Fused router scoring (csrc/router); see lpmoe/moe/router_kernel.py.
int64_t router_grid_size(int64_t tokens);
void router_topk(const at::Tensor& logits, int64_t k, bool sigmoid, bool normalize, const at::Tensor& probs,
                 const at::Tensor& indices, const c10::optional<at::Tensor>& lse,
                 const c10::optional<at::Tensor>& affinity, const c10::optional<at::Tensor>& counts);
void router_backward(const at::Tensor& logits, const at::Tensor& indices, const c10::optional<at::Tensor>& grad_probs,
                     const c10::optional<at::Tensor>& grad_lse, const c10::optional<at::Tensor>& grad_affinity,
                     bool sigmoid, bool normalize, const at::Tensor& grad_logits);

// Grouped GEMM (csrc/gemm); see lpmoe/gemm.
int64_t grouped_gemm_setup_bytes(int64_t num_groups);
// (tile width, cluster) the FP8 fprop/dgrad heuristic picks (csrc/fp8_gemm/heuristics.h).
std::tuple<int64_t, int64_t> fp8_block_scaled_choice(int64_t a_rows, int64_t num_groups, int64_t n_cols,
                                                     int64_t sm_count);
// (tile width, cluster) the FP8 wgrad heuristic picks for dW (n x k).
std::tuple<int64_t, int64_t> fp8_wgrad_choice(int64_t n, int64_t k);
// Returns which kernel ran: (tile width, cluster) of lpmoe's FP8
// block-scaled kernel, (-1, 0) for the CUTLASS FP8 kernels, and (tile rows,
// 0) for the 16-bit kernels (64 or 128, gemm/heuristics16.h); then 1 when
// lpmoe's wgrad kernel wrote bf16 through its TMA-store strips, else 0.  fp8_width: 0 =
// the heuristic's choice, -1 = the CUTLASS kernel, else a tile width;
// fp8_cluster: 0 = the heuristic's choice, else 1 or 2 (FP8 fprop/dgrad, and
// wgrad with its own widths).
std::tuple<int64_t, int64_t, int64_t> grouped_gemm_cutlass(
    int64_t kind, int64_t fmt, const at::Tensor& a, const c10::optional<at::Tensor>& a_scale, const at::Tensor& b,
    const c10::optional<at::Tensor>& b_ptrs, int64_t b_member_elems, const c10::optional<at::Tensor>& b_scale,
    int64_t b_scale_member_elems, const at::Tensor& d, const at::Tensor& padded_row_offsets, int64_t num_groups,
    int64_t n, int64_t k, double beta, const at::Tensor& setup, const at::Tensor& workspace, int64_t fp8_width,
    int64_t fp8_cluster, bool zero_tail);
void grouped_gemm_cublas(int64_t kind, int64_t fmt, const at::Tensor& a, const c10::optional<at::Tensor>& a_scale,
                         const std::vector<int64_t>& b_addrs, const std::vector<int64_t>& b_scale_addrs,
                         const c10::optional<at::Tensor>& b_token, const c10::optional<at::Tensor>& b_token_scale,
                         const at::Tensor& d, const std::vector<int64_t>& splits, int64_t n, int64_t k, double beta,
                         const at::Tensor& workspace, bool weights_e5m2);
void grouped_row_epilogue(const at::Tensor& y, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& padded_row_offsets, int64_t num_groups, bool zero_tail);

// Fused AdamW + FP8 128x128 quantization of a group of same-shape weights
// (csrc/optim): fp32 parameters (masters empty), or bf16 / fp16 parameters
// with fp32 masters; see lpmoe/optim/kernels.py.  scalars: decay, beta1,
// 1 - beta1, beta2, 1 - beta2, step_size, sqrt(bias_correction2), eps.
void adamw_fp8_block_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<double>& scalars, bool e5m2, bool pow2_scales, double amax_epsilon,
                          const at::Tensor& out_data, const at::Tensor& out_scale, const at::Tensor& out_col_data,
                          const at::Tensor& out_col_scale);
int64_t adamw_fp8_block_launches();

}  // namespace binding
}  // namespace lpmoe
