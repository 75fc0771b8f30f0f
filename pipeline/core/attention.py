"""STUB (replaced by the tiled-fuse branch at merge): dense fuse_rows only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pipeline.config.model import AFFINITY_EPS

EPS = AFFINITY_EPS


def fuse_rows(q: Tensor, k: Tensor, v: Tensor, diag: Tensor | int = 0, activation: str = "relu",
              tile: int | None = None) -> Tensor:
    r, n = q.shape[0], k.shape[0]
    cols = diag if isinstance(diag, Tensor) else torch.arange(diag, diag + r, device=q.device)
    a = q @ k.T
    if activation == "relu":
        raw = a.clamp_min(0.0)
    elif activation == "softmax":
        raw = torch.softmax(a, dim=-1).clone()
    elif activation == "sigmoid":
        raw = torch.sigmoid(a).clone()
    else:
        raw = a.clone()
    raw[torch.arange(r, device=q.device), cols] = 0.0
    denom = raw.sum(dim=-1, keepdim=True) + n * EPS
    return (raw @ v + EPS * v.sum(dim=-2, keepdim=True)) / denom


_ = F
