"""lpmoe's PyTorch custom ops (``torch.ops.lpmoe.*``): what torch.compile sees.

Kernel entry points (one opaque node per call, fake implementations for
shapes; CPU tensors run the bit-exact reference through the same ops):

* ``splits_to_offsets``                          lpmoe.quantize_ops
* ``group_quantize`` (+ fused dbias), ``group_quantize_into`` (``output=``,
  ``noop_flag``), ``group_dequantize``           FP8 block / MXFP8 / NVFP4
* ``quantize``, ``dequantize``                     single tensors, every format
* ``grouped_gemm``, ``grouped_gemm_out`` (``out=``, ``accumulate``)
* ``activation_forward``, ``activation_backward``
* ``permute_scatter``, ``permute_gather``           MoE token permutation
* ``permute_row_sources``, ``gather_quantize``     the inverse map, and FP8 block
                                                   rows quantized as they are gathered
* ``router_topk``, ``router_backward``             fused router scores / top-k and their gradient
* ``routing_map``                                  slot -> grouped row (MoE routing)
* ``adamw_fp8_block_step``                         AdamW + the FP8 weight copies (lpmoe.optim)

Layers, with autograd registered (``register_autograd``):

* ``grouped_linear`` / ``grouped_linear_backward``
* ``grouped_mlp`` / ``grouped_mlp_backward`` (whole, or one of fc2's GEMMs),
  ``grouped_mlp_backward_act`` and ``grouped_mlp_backward_fc1``

Why Python ``torch.library.custom_op`` rather than ``TORCH_LIBRARY`` schemas
in C++: every op needs a Python CPU implementation (the reference) and a
Python fake (the layout rules live in lpmoe.grouped_layout), and the layer
ops' implementations are the Python policies; one registration mechanism
covers all of them, call counters stay in the implementations, and the C++
extension keeps only private kernel launchers.  Eager calls bypass the
dispatcher (lpmoe.library.routing).  GroupedTensor is a registered pytree
node (lpmoe.library.grouped_codec).
"""
# The op modules are imported by lpmoe/__init__ (after the modules they wrap).

#: every op lpmoe registers (for opcheck and documentation)
OP_NAMES = ("splits_to_offsets", "group_quantize", "group_quantize_into", "group_dequantize", "quantize",
            "dequantize", "grouped_gemm",
            "grouped_gemm_out", "activation_forward", "activation_backward", "grouped_linear",
            "grouped_linear_backward", "grouped_mlp", "grouped_mlp_backward", "grouped_mlp_backward_act",
            "grouped_mlp_backward_fc1",
            "permute_scatter", "permute_gather", "permute_row_sources", "gather_quantize",
            "router_topk", "router_backward", "routing_map", "adamw_fp8_block_step")
