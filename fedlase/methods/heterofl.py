"""HeteroFL (Diao et al., ICLR 2021): static width slices, as masks (see docs/methods-structured.md).

A level is a parameter fraction; its width rate is sqrt(level) (levels 1, 1/4, 1/16, 1/64 <-> rates 1, 1/2,
1/4, 1/8). Every channel group of size K keeps its first ceil(rate * K) channels, so each conv's kept inputs
are the kept outputs of the layer feeding it (residual stages share one group); BN weight and bias follow
their conv's channels; the classifier keeps all classes. Aggregation averages each coordinate over the
clients that hold it, as the official code does."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..masks import Submodel
from .base import Method, Option
from .slicing import width_masks, width_rate


class HeteroFL(Method):
    """HeteroFL: each level trains the first sqrt(level) of every layer's channels (static width slices)."""
    name = "heterofl"
    options = {
        "scaler": Option(True, "true: in local training, multiply each conv output by 1/rate before its BN "
                         "(the official code's Scaler); false: no scaling", choices=(True, False)),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        if not hasattr(model, "channel_groups"):
            raise ConfigError("method", f"{self.name} slices channels; model {type(model).__name__} declares no "
                              "channel_groups()")
        if self.args["scaler"] and "width_scale" not in dict(model.named_buffers()):
            raise ConfigError("method_args.scaler", f"model {type(model).__name__} has no width_scale buffer; "
                              "set method_args.scaler=false")

    def roll(self, round: int) -> int:
        """How far the window has rolled at this round: never, for HeteroFL."""
        return 0

    def submodel(self, params, level, round):
        rate = width_rate(float(level))
        if rate >= 1:
            return Submodel()   # the whole model: no masks to apply or count
        masks = width_masks(self.model, params, rate, self.roll(round))
        # the scaler only matters in training: evaluation never uses Submodel.buffers
        buffers = {"width_scale": torch.tensor(1.0 / rate)} if self.args["scaler"] else {}
        return Submodel(masks, buffers=buffers)
