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

from ..errors import ConfigError
from ..model_hooks import hook
from ..registry import register_method
from ..slicing import WidthSlicer, state_widths, width_rate
from .base import Method, Option


@register_method
class HeteroFL(Method):
    """HeteroFL: each level trains the first sqrt(level) of every layer's channels (static width slices)."""
    name = "heterofl"
    options = {
        "scaler": Option(None, "true: in local training, multiply the output of every layer the model names in "
                         "scaler_names() by 1/rate (the official code's Scaler; folded into those layers' weights); "
                         "false: no scaling; unset (None): the model's choice (true for the CNN and ResNet-18, false "
                         "for pretrained transformers, docs/text.md)", kind=bool, choices=(True, False)),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        scaler = self.args["scaler"]
        names, default = hook(model, "scaler_names"), hook(model, "scaler_default")
        if scaler is None:   # the model's choice; a model without scaler_names() has nothing to scale
            scaler = names is not None and (default is None or default)
        if scaler and names is None:
            raise ConfigError("method_args.scaler", f"model {type(model).__name__} declares no scaler_names(); "
                              "leave method_args.scaler unset or false")
        self.scaler = bool(scaler)
        self.slicer = WidthSlicer(self.facts, names() if self.scaler else (), self.name)
        # a traced model is checked at each window the run will use now, not at the round that first uses it
        self.slicer.check({n: p.detach() for n, p in model.named_parameters()}, self.system.levels, self.rolls)
        state_widths(self, lambda lvl: width_rate(float(lvl)))   # a level is a width: say what it really holds

    def roll(self, round: int) -> int:
        """How far the window has rolled at this round: never, for HeteroFL."""
        return 0

    def rolls(self, params) -> range:
        """The rolls whose windows are all the distinct windows of a run: the first only, for HeteroFL."""
        return range(1)

    def submodel(self, params, level, round):
        return self.slicer(params, level, self.roll(round))
