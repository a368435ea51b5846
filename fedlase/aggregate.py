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
    kept: structural credit. Weights are credited by mask. A per-channel parameter is credited only on the
        output channels that are part of the client's network: a conv/linear bias entry where its own layer
        keeps at least one weight of that channel (and, for a masked bias, its own mask holds it); a BatchNorm
        weight or bias entry where some layer producing its channel group (the model's `channel_groups()`)
        keeps one. A channel nobody keeps a weight of carries only constants: what its BN shift or bias
        learned (a constant fed to the next layer) is dropped with it, from the sum as well as the count. In a
        residual stage one group has several producers (the stem or block outputs and the shortcuts, added
        together): a block's BN channel counts while the stage's channel is alive, since its shift then adds
        to a live signal.
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import BatchNorm
from .masks import Submodel, slice_block
from .model_facts import ModelFacts
from .robust_config import COVERAGES

AGGREGATIONS = ("coverage", "mean")


def channel_owners(model: nn.Module, facts: ModelFacts | None = None) -> dict[str, list[str]]:
    """Per-channel parameter name -> the conv/linear weights whose output channels decide its `kept` credit.

    A conv/linear bias follows its own layer's weight. A BatchNorm's weight and bias follow every weight
    (a parameter of two or more dims) that the model's channel groups put in the same output group: its
    `channel_groups()`, or those the run's width method traced (`facts`, the run's ModelFacts); a model with
    neither names no BN owner. Anything else (LayerNorm, embeddings) has no owner and is credited by its mask."""
    owners: dict[str, list[str]] = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) and mod.bias is not None:
            prefix = f"{mod_name}." if mod_name else ""
            owners[f"{prefix}bias"] = [f"{prefix}weight"]
    groups = (facts or ModelFacts(model)).known_groups()
    if groups is None:
        return owners
    shapes = {n: p.dim() for n, p in model.named_parameters()}
    producers: dict[str, list[str]] = {}
    for name, (out_g, _) in groups.items():
        if out_g is not None and shapes.get(name, 0) > 1:
            producers.setdefault(out_g, []).append(name)
    bn = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, BatchNorm)
          for p, _ in mod.named_parameters(recurse=False)}
    for name, (out_g, _) in groups.items():
        if name in bn and out_g in producers:
            owners[name] = producers[out_g]
    return owners


def kept_credit(sub: Submodel, names, owners: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """The `kept` coverage rule's credit masks of one submodel, for the named parameters that have a mask or
    an owner (the others are credited whole)."""
    out = {}
    for n in names:
        base = sub.masks.get(n)
        weights = owners.get(n, [])
        if weights and all(w in sub.masks for w in weights):   # an owner kept whole keeps every channel alive
            alive = None
            for w in weights:   # a channel is alive when some owner keeps at least one weight of it
                m = sub.masks[w]
                rows = m.reshape(m.shape[0], -1).any(1)
                alive = rows if alive is None else alive | rows
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
    owners: for `kept`, the map from per-channel parameters to the weights owning their channels
        (`channel_owners(model)`).
    """

    def __init__(self, global_params: dict[str, torch.Tensor], mode: str = "coverage", coverage: str = "mask",
                 owners: dict[str, list[str]] | None = None):
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

    def add(self, delta: dict[str, torch.Tensor], sub: Submodel, weight: float = 1.0) -> None:
        """Add one client's delta (already zero outside its mask) and the submodel it was sent. A width
        slice's delta may come as the gathered smaller tensors (`local_train(..., scatter=False)`); it is then
        added into its block only, which skips a full-size scatter and the adds of its zeros (same result).
        `weight`: a factor on the delta alone (FedBuff's staleness weight, fedlase/sim_config.py); its credit
        counts once, so a coordinate moves by sum_i w_i c_ij d_ij / sum_i c_ij (Nguyen et al. 2022: a uniformly
        stale buffer takes a smaller step, where a weighted mean would cancel the weights)."""
        for n, block, d, count in self.terms(delta, sub):
            if weight != 1.0:   # 1: the unweighted sums exactly
                d = d * weight
            if block is None:
                self.sums[n].add_(d)
                self.counts[n].add_(count)
            else:
                self.sums[n][block] += d
                self.counts[n][block] += count
        self.clients += 1

    def terms(self, delta: dict[str, torch.Tensor], sub: Submodel):
        """What one client adds, per parameter: (name, block or None for the whole tensor, its delta there, its
        credit there: 1, a bool mask or a float credit). The one statement of the coverage rules, shared by the
        streaming mean and the robust rules (fedlase/server_step.py)."""
        small = bool(sub.slices) and any(d.shape != self.sums[n].shape for n, d in delta.items())
        if self.coverage == "kept":
            full = sub.scatter(delta, self.global_params) if small else delta
            credit = self._kept(full, sub)
            for n, d in full.items():
                c = credit.get(n)
                yield (n, None, d, 1) if c is None else (n, None, d * c, c)
            return
        inner = sub.inner() if small else None   # the gathered masks that are not whole (label split)
        for n, d in delta.items():
            if small and n in sub.slices:
                yield n, slice_block(sub.slices[n]), d, self._count(d, inner.masks.get(n))
            else:
                yield n, None, d, self._count(d, sub.masks.get(n))

    def _count(self, d: torch.Tensor, mask: torch.Tensor | None):
        """What one client adds to a coordinate's count under `mask` or `nonzero` coverage."""
        if self.coverage == "nonzero":
            return d != 0
        return 1 if mask is None else mask

    def _kept(self, delta, sub) -> dict[str, torch.Tensor]:
        cached = self._credit.get(id(sub))
        if cached is None or cached[0] is not sub:
            cached = (sub, kept_credit(sub, delta.keys(), self.owners))
            self._credit[id(sub)] = cached
        return cached[1]

    def result(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, g in self.global_params.items():
            if self.mode == "coverage":
                c = self.counts[n]   # a float credit (kept) may be below 1: only an uncredited coordinate divides by 1
                step = self.sums[n] / torch.where(c > 0, c, torch.ones_like(c))
            else:
                step = self.sums[n] / (self.clients if self.clients > 0 else 1)
            out[n] = g + step
        return out


def aggregate(global_params: dict[str, torch.Tensor], updates: list[tuple[dict, Submodel]],
              mode: str = "coverage", coverage: str = "mask", owners: dict[str, list[str]] | None = None,
              weights: list[float] | None = None) -> dict[str, torch.Tensor]:
    """New global parameters: the streaming mean (`Aggregator`) of (delta, submodel) pairs under `mode` and
    `coverage` (`weights`: each update's factor on its delta, default 1; see `Aggregator.add`). The engine's
    server step ends here for every robust rule but the coordinate-wise ones (fedlase/server_step.py,
    `Rule.aggregate`); public API, for library code that aggregates updates of its own."""
    agg = Aggregator(global_params, mode, coverage, owners)
    for i, (delta, sub) in enumerate(updates):
        agg.add(delta, sub, 1.0 if weights is None else weights[i])
    return agg.result()
