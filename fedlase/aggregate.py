"""Per-coordinate aggregation of client updates.

Coverage counts come from the masks the server sent, never from zeros in the updates: a client whose
trained coordinate did not move still counts for it."""
from __future__ import annotations

import torch

from .masks import Submodel

AGGREGATIONS = ("coverage", "mean")


class Aggregator:
    """Accumulates masked deltas one client at a time (memory: two tensors per parameter), then applies.

    coverage: each coordinate moves by the mean delta over the clients that trained it; coordinates no
        client trained stay unchanged (FIARSE, HeteroFL, FedRolex, FedLASE).
    mean: each coordinate moves by the sum of masked deltas divided by the number of clients, |A|
        (the rebuttal's "w/o overlap" ablation, FedAvg-style)."""

    def __init__(self, global_params: dict[str, torch.Tensor], mode: str = "coverage"):
        if mode not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
        self.mode = mode
        self.global_params = global_params
        self.sums = {n: torch.zeros_like(p) for n, p in global_params.items()}
        self.counts = {n: torch.zeros_like(p) for n, p in global_params.items()}
        self.clients = 0

    def add(self, delta: dict[str, torch.Tensor], sub: Submodel, weight: int = 1) -> None:
        """Add one client's delta (already zero outside its mask). `weight` > 1 adds that many identical
        coverage contributions (used only by tests and batched paths that pre-sum deltas)."""
        for n, d in delta.items():
            self.sums[n].add_(d)
            if n in sub.masks:
                self.counts[n].add_(sub.masks[n], alpha=weight)
            else:
                self.counts[n].add_(weight)
        self.clients += weight

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
              mode: str = "coverage") -> dict[str, torch.Tensor]:
    """New global parameters from (delta, submodel) pairs."""
    agg = Aggregator(global_params, mode)
    for delta, sub in updates:
        agg.add(delta, sub)
    return agg.result()
