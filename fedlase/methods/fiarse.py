"""FIARSE (Wu et al., 2024): one magnitude threshold over all budgeted parameters.

Follows the official code's semantics (see docs/methods.md): k = int(level * budgeted count), tau = the k-th
largest |w|; BatchNorm outside the budget and trained whole; the client keeps tau and re-evaluates its mask
at every forward; aggregation averages each coordinate over the clients that trained it.

`scope=layerwise` is the official code's layer-wise variant (`fiarse_layerwise/`): one top-k per stage of the
model instead of one over everything; a stage is a top-level module (for the CIFAR ResNet-18: the first conv,
each of the four residual stages, the classifier), each keeping int(level * its size)."""
from __future__ import annotations

from ..registry import register_method
from .base import Option, ThresholdMethod


def stages(names: list[str]) -> list[list[str]]:
    """Budgeted parameter names grouped by top-level module, in forward order."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(n.split(".", 1)[0], []).append(n)
    return list(groups.values())


@register_method
class FIARSE(ThresholdMethod):
    """FIARSE: one global magnitude threshold over all budgeted parameters (or one per stage)."""
    name = "fiarse"
    coverage = "nonzero"   # the official server counts the clients whose delta is nonzero (docs/methods.md)
    options = {**ThresholdMethod.options,
               "scope": Option("global", "global: one threshold over the whole model (the paper); layerwise: one "
                               "per top-level stage (the official code's fiarse_layerwise)",
                               choices=("global", "layerwise"))}

    def group_budgets(self, params, level):
        groups = [self.maskable] if self.args["scope"] == "global" else stages(self.maskable)
        out = []
        for names in groups:
            k = int(float(level) * sum(params[n].numel() for n in names))
            if k < 1:
                raise ValueError(f"level {level} leaves no parameter of {names[0]}")
            out.append((names, k))
        return out
