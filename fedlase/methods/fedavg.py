"""FedAvg baselines: every client trains the full model, or every client trains the smallest level's
width slice (the usual lower bound: a small dense model that every device can hold)."""
from __future__ import annotations

from ..masks import Submodel
from ..registry import register_method
from ..slicing import WidthSlicer, state_widths, width_rate
from .base import Method


@register_method
class FedAvg(Method):
    """Every client trains the full model (the upper bound where every device could hold it)."""
    name = "fedavg"

    def submodel(self, params, level, round):
        return Submodel()


@register_method
class FedAvgSmall(Method):
    """Every client trains the width slice of the system's smallest level, whatever its own level: HeteroFL's
    slice of that level without the scaler."""
    name = "fedavg_small"

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.slicer = WidthSlicer(self.facts, method=self.name)
        self.slicer.check({n: p.detach() for n, p in model.named_parameters()}, [self.system.smallest],
                          lambda params: range(1))   # a traced model, at its one window, now
        state_widths(self, lambda lvl: width_rate(float(self.system.smallest)))

    def submodel(self, params, level, round):
        return self.slicer(params, self.system.smallest)
