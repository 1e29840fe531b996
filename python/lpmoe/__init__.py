"""lpmoe: low-precision Mixture-of-Experts layers for PyTorch on Hopper.

Public API:
  GroupedTensor, ShapeKind                 grouped storage (lpmoe.grouped_tensor)
  Float8BlockQuantizer, MXFP8Quantizer,
  NVFP4Quantizer                           format descriptions (lpmoe.quantizers)
  splits_to_offsets                        device prefix sums (lpmoe.grouped_offsets)
  reference                                pure-PyTorch bit-exact formats (lpmoe.reference)
  grouped_gemm                             grouped fprop/dgrad/wgrad (lpmoe.gemm)
  GroupedLinear, GroupedMLP                expert layers (lpmoe.module), functional forms in lpmoe.functional
  activation                               expert-MLP activations and their fused kernels
  recipe, autocast, ops                    recipes, the autocast context, composable ops
  optim.AdamW                              AdamW that writes the layers' FP8 weights in its step
"""
from lpmoe.quantizers import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer, Quantizer  # noqa: F401
from lpmoe.grouped_offsets import splits_to_offsets  # noqa: F401
from lpmoe.grouped_tensor import GroupedTensor, ShapeKind  # noqa: F401
from lpmoe import reference  # noqa: F401
from lpmoe._ext import has_extension  # noqa: F401

__version__ = "0.1.0"
from lpmoe.quantize import (  # noqa: F401,E402
    dequantize,
    group_dequantize,
    group_quantize,
    group_quantize_dbias,
    quantize,
)
from lpmoe.swizzle import swizzle_scales, unswizzle_scales  # noqa: F401,E402
from lpmoe.gemm import grouped_gemm  # noqa: F401,E402
from lpmoe import recipe  # noqa: F401,E402
from lpmoe.autocast import autocast, get_autocast_recipe  # noqa: F401,E402
from lpmoe import functional  # noqa: F401,E402
from lpmoe.module import GroupedLinear, GroupedMLP  # noqa: F401,E402
from lpmoe import activation  # noqa: F401,E402
from lpmoe import ops  # noqa: F401,E402
# torch.ops.lpmoe.* and the GroupedTensor pytree node (lpmoe.library)
from lpmoe import moe  # noqa: F401,E402
from lpmoe.library import grouped_codec, quantize_ops, single_ops, gemm_ops, activation_ops, layer_ops  # noqa: F401,E402,E501
from lpmoe.library import permute_ops  # noqa: F401,E402
from lpmoe import optim  # noqa: F401,E402
from lpmoe.library import optim_ops  # noqa: F401,E402
