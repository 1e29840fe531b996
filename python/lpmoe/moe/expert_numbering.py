"""State dicts of expert-parallel layers in the single-GPU expert numbering.

A rank holding global experts [first, first + count) stores them locally as
``weight0..weight{count-1}`` (GroupedLinear's keys).  The hooks installed
here rename them to ``weight{first + i}`` when saving, and when loading
rename the rank's own global keys back and drop other ranks' experts, so a
single-GPU state dict loads on every rank and the ranks' dicts merge into
the single-GPU dict.
"""
from __future__ import annotations

import re

import torch

__all__ = ["register_global_expert_numbering"]

_KEY = re.compile(r"^(?P<head>.*\.(?:weight|bias))(?P<idx>\d+)$")


def _expert_keys(state_dict, prefix: str):
    for key in list(state_dict):
        if key.startswith(prefix):
            m = _KEY.match(key[len(prefix):])
            if m:
                yield key, m.group("head"), int(m.group("idx"))


def register_global_expert_numbering(module: torch.nn.Module, experts_prefix: str, first: int, count: int) -> None:
    def save_hook(mod, state_dict, prefix, local_metadata):
        moved = {}
        for key, head, idx in _expert_keys(state_dict, prefix + experts_prefix):
            moved[f"{prefix}{experts_prefix}{head}{first + idx}"] = state_dict.pop(key)
        state_dict.update(moved)
        return state_dict

    def load_hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        moved = {}
        for key, head, idx in _expert_keys(state_dict, prefix + experts_prefix):
            value = state_dict.pop(key)
            if first <= idx < first + count:  # this rank's expert; others belong to other ranks
                moved[f"{prefix}{experts_prefix}{head}{idx - first}"] = value
        state_dict.update(moved)

    module._register_state_dict_hook(save_hook)
    module._register_load_state_dict_pre_hook(load_hook)
