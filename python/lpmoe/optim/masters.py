"""fp32 master weights of 16-bit parameters (``lpmoe.optim.AdamW(...,
master_weights=True)``).

Training bf16 parameters with an optimizer that keeps an fp32 copy of each
(Megatron's mixed-precision optimizers, TransformerEngine's FusedAdam with
``master_weights``): the master takes the update, the parameter is then
the master rounded to nearest even.  Updates smaller than half a bf16 ulp
of the weight are not lost, which a bf16 AdamW would lose.

The state of such a parameter is torch's AdamW state made on its master
(``step``, fp32 ``exp_avg`` / ``exp_avg_sq``) plus ``master_param``
(TransformerEngine's key), kept per parameter like any optimizer state, so
state dicts carry the masters.

Which is the truth, master or parameter: the master, as long as the
parameter holds what the optimizer last wrote into it.  :class:`Masters`
records each parameter's version counter after writing it (PyTorch bumps it
on every in-place write: ``copy_``, ``load_state_dict``, ``.data``-free
edits), so a weight changed outside the optimizer gets its master remade
from it at the next step, and a master that is not fp32 (a state that
passed through torch's AdamW, which casts it) is remade too.  After
``load_state_dict`` no version is known: the first step compares every
master, rounded, with its parameter (one host sync) and remakes those that
differ, whichever of model and optimizer was loaded first."""
from __future__ import annotations

import sys
from typing import Dict, List, Tuple

import torch

from lpmoe.optim.kernels import MASTER_DTYPES

__all__ = ["FP32_STATE_KEYS", "Masters", "keep_fp32_state"]

#: state entries that stay fp32 for a 16-bit parameter with a master
FP32_STATE_KEYS = ("master_param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def has_master(p: torch.Tensor) -> bool:
    return p.dtype in MASTER_DTYPES


class Masters:
    """The masters of one optimizer: made, checked and written back."""

    def __init__(self, state):
        self.state = state
        #: parameter -> its version counter when the optimizer last wrote it
        self.versions: Dict[torch.Tensor, int] = {}
        #: masters loaded from a state dict, not yet compared with their parameters
        self.unverified = False

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 master, made from ``p`` where it is missing, not
        fp32 or stale (``p`` written outside the optimizer), with 16-bit
        moments widened (a state saved without masters)."""
        st = self.state[p]
        m = st.get("master_param")
        if m is None or self.versions.get(p, p._version) != p._version or m.dtype != torch.float32 \
                or m.shape != p.shape or m.device != p.device:
            m = st["master_param"] = p.detach().to(torch.float32, copy=True)
            self.versions[p] = p._version
            for key in FP32_STATE_KEYS[1:]:
                t = st.get(key)
                if t is not None and t.dtype != torch.float32:
                    st[key] = t.to(torch.float32)
        return m

    def written(self, params) -> None:
        """The optimizer just wrote ``params`` (from their masters)."""
        for p in params:
            self.versions[p] = p._version

    def verify(self, params) -> None:
        """After a load: remake the masters whose rounded value is not their
        parameter (one sync for all), and record every parameter's version."""
        self.unverified = False
        pairs = [(p, self.state[p]["master_param"]) for p in params
                 if has_master(p) and isinstance(self.state.get(p, {}).get("master_param"), torch.Tensor)]
        pairs = [(p, m) for p, m in pairs if m.dtype == torch.float32 and m.shape == p.shape]
        if not pairs:
            return
        differ = torch.stack([(m.to(p.device, p.dtype) != p).any() for p, m in pairs]).tolist()
        for (p, _), bad in zip(pairs, differ):
            if bad:
                self.versions[p] = -1  # stale: remade by master()
            else:
                self.versions[p] = p._version


class masters_in_place_of:
    """For the length of a ``with`` block, each 16-bit parameter with a
    gradient in ``groups`` is replaced by its fp32 master, with the gradient
    widened to fp32 and the state (without ``master_param``) keyed by the
    master, so torch's AdamW steps the masters as ordinary fp32 parameters.
    On a clean exit the parameters take their masters' values (rounded to
    their dtype); on any exit the groups and the state are as before."""

    def __init__(self, masters: Masters, groups: List[dict]):
        self.masters = masters
        self.groups = groups
        self.kept: List[list] = []
        self.swaps: List[Tuple[torch.Tensor, torch.Tensor, dict, dict]] = []

    def __enter__(self):
        try:
            self._swap()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _swap(self):
        state = self.masters.state
        for g in self.groups:
            ps = list(g["params"])
            self.kept.append(g["params"])
            g["params"] = ps
            for i, p in enumerate(ps):
                if p.grad is None or not has_master(p):
                    continue
                m = self.masters.master(p)
                st = state[p]
                inner = {k: v for k, v in st.items() if k != "master_param"}
                m.grad = torch.empty_like(m)
                self.swaps.append((p, m, st, inner))
                state[m] = inner  # torch makes step / moments here on a first step
                ps[i] = m
        if self.swaps:  # the gradients widened (exactly) in a few multi-tensor launches
            torch._foreach_copy_([m.grad for _, m, *_ in self.swaps], [p.grad for p, *_ in self.swaps])

    def __exit__(self, exc_type, exc, tb):
        for g, ps in zip(self.groups, self.kept):
            g["params"] = ps
        state = self.masters.state
        for p, m, st, inner in self.swaps:
            st.update(inner)
            state.pop(m, None)
            m.grad = None
        if exc_type is None and self.swaps:
            params = [p for p, *_ in self.swaps]
            torch._foreach_copy_(params, [m for _, m, *_ in self.swaps])
            self.masters.written(params)
        return False


def keep_fp32_state(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """After ``torch.optim.Optimizer.load_state_dict(state_dict)``: put back
    the fp32 values of the 16-bit parameters' fp32 state entries, which
    torch cast to the parameter's dtype."""
    by_id: Dict[int, torch.Tensor] = {}
    for saved, group in zip(state_dict["param_groups"], opt.param_groups):
        by_id.update(zip(saved["params"], group["params"]))
    for pid, saved in state_dict["state"].items():
        p = by_id.get(pid)
        if p is None or not has_master(p):
            continue
        st = opt.state[p]
        for key in FP32_STATE_KEYS:
            t = saved.get(key)
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                st[key] = t.to(p.device, copy=True)
