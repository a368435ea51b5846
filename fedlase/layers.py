"""torch's layers as fedlase reads them: the layer families that have no public base class, each named once, and
how often one forward pass applies each weight (the one per-layer compute figure).

Every BatchNorm (1d, 2d, 3d, Sync, lazy) derives from torch's private `_BatchNorm`, every dropout (Dropout,
Dropout1d/2d/3d, the alpha dropouts) from its private `_DropoutNd`, every convolution (1d-3d, transposed, lazy)
from its private `_ConvNd`; torch exports none of them, and listing the public classes would miss the next one it
adds. These three lines are the only place fedlase names a private torch class
(tests/test_structure.py fences the others out), so a torch release that renames one breaks here, at import."""
from __future__ import annotations

import torch
from torch import nn

from .model_hooks import hook

BatchNorm = nn.modules.batchnorm._BatchNorm   # private: the base of every BatchNorm layer; torch has no public one
Dropout = nn.modules.dropout._DropoutNd       # private: the base of every dropout layer; torch has no public one
Conv = nn.modules.conv._ConvNd                # private: the base of every convolution; torch has no public one


@torch.no_grad()
def forward_uses(model: nn.Module, x: torch.Tensor | None = None) -> dict[str, int]:
    """Weight name (every parameter of 2+ dims) -> how often one sample's forward pass applies each of its
    coordinates: a conv weight at every output position, a linear weight once per token. Measured by hooks on
    one forward pass, in eval mode, of `x`, by default a zero batch of the model's `input_shape`; a model that
    declares none (and no `x`) gets 1 for every weight (linear layers applied once).

    A weight's forward multiply-adds per sample are uses x numel (one output row's: uses x row size); torch's
    FlopCounterMode, which fedlase/cost.py runs over a whole training step, counts 2 x batch x that for each conv
    and linear layer's forward (tests/test_channels.py checks both agree)."""
    weights = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    shape = hook(model, "input_shape")
    if x is None and shape is None:
        return {n: 1 for n in weights}
    uses: dict[str, int] = {}
    hooks = []
    for prefix, module in model.named_modules():
        w = getattr(module, "weight", None)
        name = f"{prefix}.weight" if prefix else "weight"
        if isinstance(w, nn.Parameter) and name in weights:
            def record(mod, inputs, out, name=name, rows=w.shape[0]):
                uses[name] = out.numel() // (out.shape[0] * rows)   # output positions (or tokens) per sample
            hooks.append(module.register_forward_hook(record))
    was_training = model.training
    try:
        model.eval()
        model(x if x is not None else torch.zeros(2, *shape, device=next(model.parameters()).device))
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return {n: uses.get(n, 1) for n in weights}


__all__ = ["BatchNorm", "Dropout", "forward_uses"]
