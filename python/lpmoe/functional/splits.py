"""The routing of one call: tokens per expert, on the device (graph-safe
path) and, on the host path, also as a host list."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional

import torch

__all__ = ["Splits", "parse_splits"]


@dataclass
class Splits:
    device: torch.Tensor          # int64, on the input's device
    host: Optional[List[int]]     # None on the graph-safe path

    @property
    def num(self) -> int:
        return int(self.device.numel())  # member counts are static (a SymInt while tracing is specialized)

    @property
    def graph_safe(self) -> bool:
        return self.host is None


def parse_splits(m_splits, num: int, rows: int, device: torch.device) -> Splits:
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"m_splits must hold int32/int64 values, got {m_splits.dtype}")
        if m_splits.dim() != 1 or m_splits.numel() != num:
            raise ValueError(f"m_splits must have one entry per expert ({num}), got shape {tuple(m_splits.shape)}")
        if m_splits.device.type != "cpu":
            if m_splits.device != device:
                raise ValueError(f"m_splits is on {m_splits.device} but the input is on {device}")
            return Splits(m_splits.to(torch.int64), None)  # graph-safe: never read on the host
        host = [int(v) for v in m_splits.tolist()]  # CPU memory: no device sync
    elif isinstance(m_splits, (list, tuple)):
        bad = [v for v in m_splits if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if bad:
            raise TypeError(f"m_splits must be ints, got {type(bad[0]).__name__} {bad[0]!r}")
        if len(m_splits) != num:
            raise ValueError(f"m_splits has {len(m_splits)} entries, expected one per expert ({num})")
        host = [int(v) for v in m_splits]
    else:
        raise TypeError(f"m_splits must be a list of ints or an int tensor, got {type(m_splits).__name__}")
    if any(v < 0 for v in host):
        raise ValueError(f"m_splits must be non-negative, got {host}")
    if sum(host) > rows:
        raise ValueError(f"sum(m_splits) = {sum(host)} exceeds the input's {rows} token rows")
    dev = torch.tensor(host, dtype=torch.int64)
    return Splits(dev if device.type == "cpu" else dev.to(device), host)


def splits_for_checks(m_splits, num: int, rows: int, device: torch.device) -> Splits:
    """What the argument checks read, without touching tensor values (the
    torch.compile path: the layer op parses the splits when it runs).  A
    list is validated here; ``device`` of the result is the given tensor
    (or None for a list)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"m_splits must hold int32/int64 values, got {m_splits.dtype}")
        if m_splits.dim() != 1 or m_splits.numel() != num:
            raise ValueError(f"m_splits must have one entry per expert ({num}), got shape {tuple(m_splits.shape)}")
        if m_splits.device.type != "cpu" and m_splits.device != device:
            raise ValueError(f"m_splits is on {m_splits.device} but the input is on {device}")
        if m_splits.device.type == "cpu":
            # The host path (the op reads the values when it runs and checks
            # them then); an empty host list here marks "host, values unread".
            return Splits(m_splits, [])
        return Splits(m_splits, None)
    host = parse_splits(m_splits, num, rows, torch.device("cpu")).host
    return Splits(None, host)
