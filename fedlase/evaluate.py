"""Evaluation of a level's submodel of the global model."""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


@torch.no_grad()
def predict(model: nn.Module, weights: dict, buffers: dict, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Predicted classes for x. With batch-statistics BN (as FIARSE) predictions depend on the batch, so
    callers evaluate each client's split as its own batches."""
    model.eval()
    out = [functional_call(model, (weights, buffers), (x[i:i + batch_size],)).argmax(1)
           for i in range(0, len(x), batch_size)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


@torch.no_grad()
def recompute_bn_stats(model: nn.Module, weights: dict, buffers: dict, x: torch.Tensor, batch_size: int) -> dict:
    """Static BN (HeteroFL's sBN): fresh running statistics of this submodel from a pass over training data.
    Returns new buffers; the model's own buffers are untouched. No-op when the model keeps no statistics."""
    if not any(n.endswith("running_mean") for n in buffers):
        return buffers
    fresh = {}
    for n, b in buffers.items():
        if n.endswith("running_mean") or n.endswith("num_batches_tracked"):
            fresh[n] = torch.zeros_like(b)
        elif n.endswith("running_var"):
            fresh[n] = torch.ones_like(b)
        else:
            fresh[n] = b.clone()
    model.train()   # BN momentum=None: a cumulative average over the batches of this pass
    for i in range(0, len(x), batch_size):
        functional_call(model, (weights, fresh), (x[i:i + batch_size],))
    return fresh


def accuracy(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float((pred == y).float().mean()) if len(y) else float("nan")
