"""The expert layers as custom ops with autograd, for torch.compile.

``lpmoe::grouped_linear`` / ``lpmoe::grouped_linear_backward`` and
``lpmoe::grouped_mlp`` / ``lpmoe::grouped_mlp_backward`` (whole, or one
of fc2's GEMMs, + ``grouped_mlp_backward_act`` and
``grouped_mlp_backward_fc1`` for large layers, lpmoe.library.mlp_ops) run
the same implementation as the eager autograd functions
(lpmoe.functional.linear / .mlp); ``register_autograd`` connects each
forward to its backward.  The ops live in lpmoe.library.linear_ops and
.mlp_ops (shared pieces: .layer_common); this module is their front.  A
compiled model therefore holds one opaque node per layer and direction
(up to five for a large MLP's backward):
Dynamo and Inductor never trace lpmoe's Python, and the kernels, recipes
and routing behave exactly as in eager mode (bitwise).

Static configuration (recipe, activation, gradient needs, weight shapes)
travels as a JSON string, constant per call site: changing routing (device
m_splits values) never recompiles, and with dynamic shapes neither does a
new token count (the fakes keep it symbolic, and the saved layout does not
depend on it).  The forward returns y plus the fresh tensors the
backward reads (lpmoe.library.saved_layout); inputs the backward reads (x,
parameters, probs, splits) are saved by ``setup_context``.  The fake
implementation is the forward itself run on fake tensors: every inner call
then goes to its op's fake, so shapes come from the code that makes them.

``fuse_wgrad_accumulation``: the backward op receives the weights and adds
their gradients into their ``main_grad`` at run time, as eager does
(lpmoe.library.fused_main_grads says how, and why not as a declared
mutation).
"""
from __future__ import annotations

from lpmoe.library.layer_common import CALLS  # noqa: F401  (tests read the counters here)
from lpmoe.library.linear_ops import _grouped_linear, linear_backward_args, linear_op_args  # noqa: F401
from lpmoe.library.mlp_ops import (_grouped_mlp, fc1_dh, mlp_backward_args, mlp_op_args,  # noqa: F401
                                   whole_backward_args)


def backward_args(op, fwd_args: tuple, fwd_out, grad) -> tuple:
    """Arguments of the backward op(s) of ``op`` (the grouped_linear or
    grouped_mlp op) after a forward with ``fwd_args`` returned ``fwd_out``,
    as the registered autograd formulas pass them (tests, opcheck); see
    linear_backward_args and mlp_backward_args."""
    if op is _grouped_linear:
        return linear_backward_args(fwd_args, fwd_out, grad)
    return mlp_backward_args(fwd_args, fwd_out, grad)
