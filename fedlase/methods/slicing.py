"""Width slices for structured methods (HeteroFL, FedRolex, FedAvg on the small model), as masks.

A model declares, per parameter, which channel group its output and input dimensions belong to
(`channel_groups()`); a slice keeps a window of ceil(rate * K) channels of every group of size K, so a conv's
kept input channels are exactly the kept output channels of the layer that feeds it."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..levels import level_name
from ..masks import Submodel


def width_rate(level: float) -> float:
    """Parameter level -> width rate: a width rate r keeps about r^2 of a conv's parameters."""
    return math.sqrt(level)


def channel_window(size: int, rate: float, roll: int = 0) -> torch.Tensor:
    """Indices of the kept channels: ceil(rate * size) of them starting at (-roll) mod size, wrapping."""
    keep = min(size, max(1, math.ceil(rate * size - 1e-9)))
    return (torch.arange(keep) - roll) % size


def group_sizes(groups: dict, params: dict[str, torch.Tensor]) -> dict[str, int]:
    """Channel group -> its channel count, read off the weights that produce or consume it (`groups`:
    `model.channel_groups()`, weight name -> (output group, input group))."""
    sizes: dict[str, int] = {}
    for name, (out_g, in_g) in groups.items():
        for g, dim in ((out_g, 0), (in_g, 1)):
            if g is not None:
                sizes.setdefault(g, params[name].shape[dim])
    return sizes


def group_keep(model: nn.Module, groups: dict, params: dict[str, torch.Tensor], rate: float,
               roll: int = 0) -> dict[str, torch.Tensor]:
    """Channel group -> bool vector of its kept channels at `rate`, the window rolled by `roll` channels (0: the
    first channels); `groups` is `model.channel_groups()`.

    A model may declare `group_units()` -> {group: unit size}: such a group is cut in whole units of that
    many consecutive channels (a transformer's attention heads: unit = head size), the window counting and
    rolling in units. Groups it does not name have unit 1 (single channels)."""
    units = model.group_units() if hasattr(model, "group_units") else {}
    sizes = group_sizes(groups, params)
    keep = {g: torch.zeros(k, dtype=torch.bool) for g, k in sizes.items()}
    for g, k in sizes.items():
        u = units.get(g, 1)
        if u == 1:
            keep[g][channel_window(k, rate, roll)] = True
        else:   # whole units: unit j covers channels j*u .. j*u + u - 1
            kept_units = channel_window(k // u, rate, roll)
            keep[g][(kept_units[:, None] * u + torch.arange(u)).flatten()] = True
    return keep


def _masks(groups, params, keep) -> dict[str, torch.Tensor]:
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


def channel_groups(model: nn.Module, method: str) -> dict[str, tuple]:
    """`model.channel_groups()`; a model that declares none gets them derived by tracing it, once
    (fedlase/models/trace.py: also its `sliceable`), or the one-line ConfigError of a method that cuts channels
    (`method`: its name, for the message) on a model that cannot be traced."""
    if not hasattr(model, "channel_groups"):
        # Torch-Pruning is imported only for such a model
        from ..models.trace import ensure_groups
        ensure_groups(model, method, width_slices)
    return model.channel_groups()


def width_slices(model: nn.Module, params: dict[str, torch.Tensor], rate: float, roll: int = 0,
                 keep: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(masks, slices) of the width slice: the masks of the kept channels (`group_keep`), and per sliced parameter
    (and BN running statistic of a sliced BN) the kept indices of its output and input dims, for
    `Submodel.slices`. Indices are sorted:
    a permutation applied to every tensor of a group alike leaves the network's function unchanged.

    Slices only for a model that declares `sliceable = True` (its forward takes every shape from the
    tensors, e.g. global pooling before the classifier); otherwise no slices and the masks train. `keep`: the
    kept channels of every group (bool vectors, FedDSE's own choice) in place of the window."""
    groups = model.channel_groups()
    keep = group_keep(model, groups, params, rate, roll) if keep is None else keep
    masks = _masks(groups, params, keep)
    if not getattr(model, "sliceable", False):
        return masks, {}
    device = next(iter(params.values())).device
    index = {g: torch.nonzero(k).flatten().to(device) for g, k in keep.items()}   # sorted kept indices
    buffers = {n for n, _ in model.named_buffers()}
    slices: dict[str, tuple] = {}
    for name, (out_g, in_g) in groups.items():
        if name not in masks:
            continue
        dims = [out_g] + ([in_g] if masks[name].dim() > 1 else [])
        idx = [None if g is None else index[g] for g in dims]
        while idx and idx[-1] is None:
            idx.pop()
        slices[name] = tuple(idx)
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and masks[name].dim() == 1:   # a BN's weight: its running statistics follow it
            for stat in ("running_mean", "running_var"):
                if f"{prefix}.{stat}" in buffers:
                    slices[f"{prefix}.{stat}"] = tuple(idx)
    return masks, slices


class WidthSlicer:
    """The width-slice submodels of one model (HeteroFL, FedRolex, FedAvg on the small model): the one place
    they are built. A slice depends on the rate, the window's roll and the weights' device, never on the
    weights' values, so the last submodel built per level is reused while those hold: HeteroFL and FedAvg-small
    build each level's submodel once per run (and its `inner()` once), FedRolex, whose window moves every
    round, rebuilds. Memory: one submodel per level.

    `scaled`: the parameters HeteroFL's scaler multiplies in training (the model's `scaler_names()`); a slice
    at rate r carries them as `Submodel.scales` of 1/r."""

    def __init__(self, model: nn.Module, scaled: list[str] = (), method: str = "width slices"):
        channel_groups(model, method)
        self.model, self.scaled = model, list(scaled)
        self._last: dict = {}

    def __call__(self, params: dict[str, torch.Tensor], level, roll: int = 0) -> Submodel:
        """The submodel of `level` (a fraction of the parameters: width rate sqrt(level)), window rolled by
        `roll`; the whole model at level 1."""
        rate = width_rate(float(level))
        if rate >= 1:
            return Submodel()   # the whole model: no masks to apply or count
        key = (rate, roll, next(iter(params.values())).device)
        name = level_name(level)   # an exact fraction's name, never a float key
        hit = self._last.get(name)
        if hit is None or hit[0] != key:
            masks, slices = width_slices(self.model, params, rate, roll)
            hit = self._last[name] = (key, Submodel(masks, slices=slices,
                                                    scales={n: 1.0 / rate for n in self.scaled}))
        return hit[1]
