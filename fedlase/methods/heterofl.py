"""HeteroFL (Diao et al., ICLR 2021): static width slices (see docs/methods-structured.md).

A level is a parameter fraction; its width rate is sqrt(level) (levels 1, 1/4, 1/16, 1/64 <-> rates 1, 1/2,
1/4, 1/8). Every channel group of size K keeps its first ceil(rate * K) channels, so each conv's kept inputs
are the kept outputs of the layer feeding it (residual stages share one group); BN weight and bias follow
their conv's channels; the classifier keeps all classes. Aggregation averages each coordinate over the
clients that hold it, as the official code does.

The submodel carries the slice both as masks (aggregation, bytes, `kept`) and, where the model allows, as
kept indices (`Submodel.slices`): a client then trains the physically smaller model, as the official code.
The scaler (each conv output times 1/rate in training) is folded into those convs' weights
(`Submodel.scales`): conv(x, W) * s == conv(x, s W), so no model multiplies anything per method."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..masks import Submodel
from .base import Method, Option
from .slicing import SliceCache, slice_key, width_rate, width_slices


class HeteroFL(Method):
    """HeteroFL: each level trains the first sqrt(level) of every layer's channels (static width slices)."""
    name = "heterofl"
    options = {
        "scaler": Option(True, "true: in local training, multiply each conv output by 1/rate before its BN "
                         "(the official code's Scaler; folded into the conv weights); false: no scaling",
                         choices=(True, False)),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        if not hasattr(model, "channel_groups"):
            raise ConfigError("method", f"{self.name} slices channels; model {type(model).__name__} declares no "
                              "channel_groups()")
        # a model names the layers the scaler multiplies (scaler_names); one that still applies the scaler
        # itself from a `width_scale` buffer gets the factor as a buffer override
        self._legacy_scale = not hasattr(model, "scaler_names") and "width_scale" in dict(model.named_buffers())
        if self.args["scaler"] and not hasattr(model, "scaler_names") and not self._legacy_scale:
            raise ConfigError("method_args.scaler", f"model {type(model).__name__} declares no scaler_names(); "
                              "set method_args.scaler=false")
        self._scaled = list(model.scaler_names()) if hasattr(model, "scaler_names") else []
        self._slices = SliceCache()

    def roll(self, round: int) -> int:
        """How far the window has rolled at this round: never, for HeteroFL."""
        return 0

    def submodel(self, params, level, round):
        rate = width_rate(float(level))
        if rate >= 1:
            return Submodel()   # the whole model: no masks to apply or count
        key = slice_key(params, rate, self.roll(round))
        return self._slices(level, key, lambda: self._slice(params, rate, key[1]))

    def _slice(self, params, rate: float, roll: int) -> Submodel:
        masks, slices = width_slices(self.model, params, rate, roll)
        scales, buffers = {}, {}
        if self.args["scaler"]:   # training only: evaluation never applies scales or buffer overrides
            if self._legacy_scale:
                buffers = {"width_scale": torch.tensor(1.0 / rate)}
            else:
                scales = {n: 1.0 / rate for n in self._scaled}
        return Submodel(masks, buffers=buffers, slices=slices, scales=scales)
