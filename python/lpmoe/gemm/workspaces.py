"""Persistent GEMM workspaces: allocated once, reused by every call.

Nothing in a grouped GEMM call allocates scratch memory that a captured CUDA
graph would have to keep alive, and two products that may run back to back
in one backward (dgrad and wgrad) never share a buffer:

* two 32 MiB kernel workspaces per device: slot 0 for fprop and dgrad,
  slot 1 for wgrad (cuBLASLt's workspace, or the CUTLASS kernel's TMA
  descriptor space);
* one setup buffer per (device, number of groups) holding the per-group
  argument arrays that a device kernel writes before each grouped launch.

All calls on one stream are ordered, so reusing a slot across calls is safe;
running two grouped GEMMs of the same slot concurrently on different streams
is not (documented in lpmoe.grouped_gemm).

Each is made on first use outside any CUDA-graph pool (lpmoe._persistent),
so a first use inside a reduce-overhead warm-up is fine.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from lpmoe._persistent import persistent

__all__ = ["WORKSPACE_BYTES", "gemm_workspace", "setup_workspace", "slot_for_kind"]

WORKSPACE_BYTES = 32 * 1024 * 1024

_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
_setups: Dict[Tuple[int, int], torch.Tensor] = {}


def slot_for_kind(kind: str) -> int:
    return 1 if kind == "wgrad" else 0


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def gemm_workspace(device: torch.device, slot: int) -> torch.Tensor:
    key = (_index(device), slot)
    ws = _workspaces.get(key)
    if ws is None:
        dev = torch.device("cuda", key[0])
        ws = persistent(lambda: torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), dev)
        _workspaces[key] = ws
    return ws


def setup_workspace(device: torch.device, num_groups: int) -> torch.Tensor:
    from lpmoe._ext import ext

    key = (_index(device), num_groups)
    ws = _setups.get(key)
    if ws is None:
        dev, size = torch.device("cuda", key[0]), ext().grouped_gemm_setup_bytes(num_groups)
        ws = persistent(lambda: torch.empty(size, dtype=torch.uint8, device=dev), dev)
        _setups[key] = ws
    return ws
