"""Width slices for structured methods (HeteroFL, FedRolex, FedAvg on the small model), as masks.

A model declares, per parameter, which channel group its output and input dimensions belong to
(`channel_groups()`); a slice keeps a window of ceil(rate * K) channels of every group of size K, so a conv's
kept input channels are exactly the kept output channels of the layer that feeds it."""
from __future__ import annotations

import math

import torch
from torch import nn


def width_rate(level: float) -> float:
    """Parameter level -> width rate: a width rate r keeps about r^2 of a conv's parameters."""
    return math.sqrt(level)


def channel_window(size: int, rate: float, roll: int = 0) -> torch.Tensor:
    """Indices of the kept channels: ceil(rate * size) of them starting at (-roll) mod size, wrapping."""
    keep = min(size, max(1, math.ceil(rate * size - 1e-9)))
    return (torch.arange(keep) - roll) % size


def width_masks(model: nn.Module, params: dict[str, torch.Tensor], rate: float, roll: int = 0) -> dict[str, torch.Tensor]:
    """Masks of the width slice at `rate`, window rolled by `roll` channels (0: the first channels)."""
    groups = model.channel_groups()
    sizes: dict[str, int] = {}
    for name, (out_g, in_g) in groups.items():
        shape = params[name].shape
        for g, dim in ((out_g, 0), (in_g, 1)):
            if g is not None:
                sizes.setdefault(g, shape[dim])
    keep = {g: torch.zeros(k, dtype=torch.bool) for g, k in sizes.items()}
    for g, k in sizes.items():
        keep[g][channel_window(k, rate, roll)] = True
    masks = {}
    for name, (out_g, in_g) in groups.items():
        p = params[name]
        if out_g is None and in_g is None:
            continue
        m = torch.ones(p.shape, dtype=torch.bool, device=p.device)
        if out_g is not None:
            m &= keep[out_g].to(p.device).view(-1, *([1] * (p.dim() - 1)))
        if in_g is not None:
            m &= keep[in_g].to(p.device).view(1, -1, *([1] * (p.dim() - 2)))
        masks[name] = m
    return masks
