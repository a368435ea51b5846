"""Per-coordinate aggregation of client updates.

Two choices make up the server step:

mode (how far a coordinate moves):
    coverage: by the mean delta over the clients credited with it; coordinates nobody is credited with stay.
    mean: by the sum of the deltas divided by the number of clients, |A| (FedAvg-style).

coverage (which clients are credited with a coordinate, i.e. the denominator of `coverage` mode):
    mask: every client whose mask holds it (the mask the server sent at the start of the round), so a client
        whose trained coordinate did not move still counts with its zero.
    nonzero: every client whose returned delta there is nonzero (exactly FIARSE's official server,
        `fiarse/server.py`: `tot_mask += (grad != 0)` on the state-dict difference; a coordinate nobody moved
        gets 0/0, turned into a step of 0 by `nan_to_num`).
    kept: structural credit. Weights are credited by mask. A per-channel parameter (a conv/linear bias entry,
        a BatchNorm weight or bias) is credited only when the output channel it belongs to keeps at least one
        weight of its layer in the client's mask (and, for a masked bias, its own mask holds it). A channel
        whose whole weight row was dropped is not part of the client's network: what its BN shift or bias
        learned (a constant fed to the next layer) is dropped with it, from the sum as well as the count.
"""
from __future__ import annotations

import torch
from torch import nn

from .masks import Submodel, slice_block

AGGREGATIONS = ("coverage", "mean")
COVERAGES = ("mask", "nonzero", "kept")


def channel_owners(model: nn.Module) -> dict[str, str]:
    """Per-channel parameter name -> the conv/linear weight whose output channels it follows.

    A conv/linear bias follows its own layer's weight. A BatchNorm's weight and bias follow the last conv or
    linear layer registered before it, when that layer's output channels match the BN's features (true of the
    bundled CNN and ResNet-18, whose modules are registered in forward order: conv, bn, ..., shortcut conv,
    shortcut bn). Anything else (LayerNorm, embeddings) has no owner and is credited by its mask."""
    owners: dict[str, str] = {}
    last: tuple[str, int] | None = None   # (weight name, output channels) of the last conv/linear seen
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
            weight = f"{prefix}weight"
            if mod.bias is not None:
                owners[f"{prefix}bias"] = weight
            last = (weight, mod.weight.shape[0])
        elif isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.affine and last is not None \
                and last[1] == mod.num_features:
            owners[f"{prefix}weight"] = owners[f"{prefix}bias"] = last[0]
    return owners


def kept_credit(sub: Submodel, names, owners: dict[str, str]) -> dict[str, torch.Tensor]:
    """The `kept` coverage rule's credit masks of one submodel, for the named parameters that have a mask or
    an owner (the others are credited whole)."""
    out = {}
    for n in names:
        base = sub.masks.get(n)
        owner = owners.get(n)
        if owner is not None and owner in sub.masks:
            w = sub.masks[owner]
            alive = w.reshape(w.shape[0], -1).any(1)   # channel keeps at least one weight of its layer
            base = alive if base is None else base & alive
        if base is not None:
            out[n] = base
    return out


class Aggregator:
    """Accumulates masked deltas one client at a time (memory: two tensors per parameter), then applies.

    mode: 'coverage' (per-coordinate mean over the credited clients; FIARSE, HeteroFL, FedRolex, FedLASE) or
        'mean' (sum of the deltas divided by the number of clients, |A|: the rebuttal's "w/o overlap").
    coverage: 'mask' (default), 'nonzero' or 'kept'; see the module docstring. Under `mean` mode only `kept`
        matters (it drops the deltas of uncredited channels); the other two give the same result there.
    owners: for `kept`, the map from per-channel parameters to their layer's weight (`channel_owners(model)`).
    """

    def __init__(self, global_params: dict[str, torch.Tensor], mode: str = "coverage", coverage: str = "mask",
                 owners: dict[str, str] | None = None):
        if mode not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
        if coverage not in COVERAGES:
            raise ValueError(f"coverage must be one of {COVERAGES}, got {coverage!r}")
        if coverage == "kept" and owners is None:
            raise ValueError("coverage='kept' needs owners=channel_owners(model)")
        self.mode, self.coverage, self.owners = mode, coverage, owners or {}
        self.global_params = global_params
        self.sums = {n: torch.zeros_like(p) for n, p in global_params.items()}
        self.counts = {n: torch.zeros_like(p) for n, p in global_params.items()}
        self.clients = 0
        self._credit: dict[int, tuple[Submodel, dict]] = {}   # id(sub) -> (sub, kept credit): once per level

    def add(self, delta: dict[str, torch.Tensor], sub: Submodel) -> None:
        """Add one client's delta (already zero outside its mask) and the submodel it was sent. A width
        slice's delta may come as the gathered smaller tensors (`local_train(..., scatter=False)`); it is then
        added into its block only, which skips a full-size scatter and the adds of its zeros (same result)."""
        small = bool(sub.slices) and any(d.shape != self.sums[n].shape for n, d in delta.items())
        if self.coverage == "kept":
            self._add_kept(sub.scatter(delta, self.global_params) if small else delta, sub)
        else:
            inner = sub.inner() if small else None   # the gathered masks that are not whole (label split)
            for n, d in delta.items():
                if small and n in sub.slices:
                    block = slice_block(sub.slices[n])
                    self.sums[n][block] += d
                    self.counts[n][block] += self._count(d, inner.masks.get(n))
                else:
                    self.sums[n].add_(d)
                    self.counts[n].add_(self._count(d, sub.masks.get(n)))
        self.clients += 1

    def _count(self, d: torch.Tensor, mask: torch.Tensor | None):
        """What one client adds to a coordinate's count under `mask` or `nonzero` coverage."""
        if self.coverage == "nonzero":
            return d != 0
        return 1 if mask is None else mask

    def _add_kept(self, delta, sub) -> None:
        cached = self._credit.get(id(sub))
        if cached is None or cached[0] is not sub:
            cached = (sub, kept_credit(sub, delta.keys(), self.owners))
            self._credit[id(sub)] = cached
        credit = cached[1]
        for n, d in delta.items():
            c = credit.get(n)
            if c is None:
                self.sums[n].add_(d)
                self.counts[n].add_(1)
            else:
                self.sums[n].add_(d * c)
                self.counts[n].add_(c)

    def result(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, g in self.global_params.items():
            if self.mode == "coverage":
                step = self.sums[n] / self.counts[n].clamp(min=1)
            else:
                step = self.sums[n] / max(self.clients, 1)
            out[n] = g + step
        return out


def aggregate(global_params: dict[str, torch.Tensor], updates: list[tuple[dict, Submodel]],
              mode: str = "coverage", coverage: str = "mask", owners: dict[str, str] | None = None
              ) -> dict[str, torch.Tensor]:
    """New global parameters from (delta, submodel) pairs."""
    agg = Aggregator(global_params, mode, coverage, owners)
    for delta, sub in updates:
        agg.add(delta, sub)
    return agg.result()
