// pybind11 registration of lpmoe._C.  Only this file includes the pybind11
// headers; the per-family binding files include ATen alone, which keeps the
// 2-core CI build short.
#include <torch/extension.h>

#include "binding/ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lpmoe CUDA kernels (see python/lpmoe for the documented API)";
  // Bumped whenever a binding's arguments or results change, together with
  // BINDING_VERSION in python/lpmoe/_ext.py, which refuses an extension
  // built from other sources with an error that says to rebuild (instead of
  // a wrong-type failure deep in a layer).  2: splits_to_offsets returns the
  // bulk buffer alone.  3: routing_map, router_backward.  4:
  // fp8_block_quantize's row_source (rows gathered from a token matrix),
  // permute_row_sources.  5: fp8_block_dequantize_kernel_launches.
  // 6: adamw_fp8_block_step (csrc/optim).  7: its masters (16-bit
  // parameters with fp32 master weights).  8: grouped_gemm_cutlass also
  // says whether the wgrad kernel's bf16 output left through TMA stores.
  // 9: fp8_block_dequantize_kernel_launches counts the TMA-store staged tile.
  // 10: mxfp8_dequantize_kernel_launches.
  m.attr("BINDING_VERSION") = 10;
  m.def("splits_to_offsets", &lpmoe::binding::splits_to_offsets, py::arg("splits"), py::arg("num_splits"),
        py::arg("uniform_split"), py::arg("strides"), py::arg("aligns"), py::arg("times_second"),
        py::arg("second"), py::arg("capacity_rows"),
        py::arg("device_index"));
  m.def("fp8_block_quantize", &lpmoe::binding::fp8_block_quantize);
  m.def("fp8_block_quantize_kernel_launches", &lpmoe::binding::fp8_block_quantize_kernel_launches);
  m.def("fp8_block_dequantize_kernel_launches", &lpmoe::binding::fp8_block_dequantize_kernel_launches);
  m.def("fp8_block_dbias_reduce", &lpmoe::binding::fp8_block_dbias_reduce);
  m.def("fp8_block_dequantize", &lpmoe::binding::fp8_block_dequantize);
  m.def("mxfp8_quantize", &lpmoe::binding::mxfp8_quantize);
  m.def("mxfp8_dequantize", &lpmoe::binding::mxfp8_dequantize);
  m.def("mxfp8_dequantize_kernel_launches", &lpmoe::binding::mxfp8_dequantize_kernel_launches);
  m.def("nvfp4_quantize", &lpmoe::binding::nvfp4_quantize);
  m.def("nvfp4_dequantize", &lpmoe::binding::nvfp4_dequantize);
  m.def("activation_forward", &lpmoe::binding::activation_forward);
  m.def("activation_backward", &lpmoe::binding::activation_backward);
  m.def("activation_probs_grad", &lpmoe::binding::activation_probs_grad);
  m.def("activation_sigmoid_table_launches", &lpmoe::binding::activation_sigmoid_table_launches);
  m.def("activation_dram_bytes_per_sm_cycle", &lpmoe::binding::activation_dram_bytes_per_sm_cycle);
  m.def("permute_scatter", &lpmoe::binding::permute_scatter);
  m.def("permute_gather", &lpmoe::binding::permute_gather);
  m.def("permute_row_sources", &lpmoe::binding::permute_row_sources);
  m.def("router_grid_size", &lpmoe::binding::router_grid_size);
  m.def("router_topk", &lpmoe::binding::router_topk);
  m.def("router_backward", &lpmoe::binding::router_backward);
  m.def("routing_map_chunks", &lpmoe::binding::routing_map_chunks);
  m.def("routing_map", &lpmoe::binding::routing_map);
  m.def("grouped_gemm_setup_bytes", &lpmoe::binding::grouped_gemm_setup_bytes);
  m.def("grouped_gemm_cutlass", &lpmoe::binding::grouped_gemm_cutlass);
  m.def("fp8_block_scaled_choice", &lpmoe::binding::fp8_block_scaled_choice);
  m.def("fp8_wgrad_choice", &lpmoe::binding::fp8_wgrad_choice);
  m.def("grouped_gemm_cublas", &lpmoe::binding::grouped_gemm_cublas);
  m.def("grouped_row_epilogue", &lpmoe::binding::grouped_row_epilogue);
  m.def("adamw_fp8_block_step", &lpmoe::binding::adamw_fp8_block_step);
  m.def("adamw_fp8_block_launches", &lpmoe::binding::adamw_fp8_block_launches);
}
