"""FjORD (Horváth et al., NeurIPS 2021): ordered dropout (see docs/methods.md, "FjORD").

Widths are nested slices: a width rate p keeps the first ceil(p K) channels of every channel group of size K
(HeteroFL's slice without its scaler; the image channels and the classes are never cut). A client of level l
holds the widest allowed width p_max <= sqrt(l) and, on every local batch, trains a width drawn uniformly from
the allowed widths up to p_max (its draws come from the client's own seeded stream). With `distill`, each batch
also trains p_max on the labels and the drawn width on p_max's softened output (Flower's FjORD KD). The held
slice trains as the smaller model (sliced compute, as HeteroFL) and each drawn width as a slice of it; a level
evaluates its p_max slice. Aggregation: each coordinate averaged over the clients whose p_max slice holds it."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..masks import Submodel
from ..registry import register_method
from ..slicing import state_widths, width_rate, width_slices
from .base import LocalObjective, Method, Option

UNIFORM5 = (0.2, 0.4, 0.6, 0.8, 1.0)   # FjORD's own width set ("uniform-5")


def _check_widths(value: str) -> str | None:
    if value in ("levels", "uniform5"):
        return None
    try:
        rates = [float(v) for v in value.split(",")]
    except ValueError:
        return f"expected levels, uniform5 or comma-separated rates such as 0.25,0.5,1; got {value!r}"
    if not rates or any(not 0 < r <= 1 for r in rates):
        return f"width rates must be in (0, 1], got {value!r}"
    return None


class OrderedDropout(LocalObjective):
    """Per batch: a width drawn uniformly from `widths` (each a Submodel cutting the held slice, None for the
    held slice itself); with `distill`, plus the held width's label loss and the drawn width's loss against
    the held width's detached softmax."""

    def __init__(self, widths: list[Submodel | None], distill: bool):
        self.widths, self.distill = widths, distill

    @staticmethod
    def _cut(sub: Submodel | None, weights, buffers):
        if sub is None:
            return weights, buffers
        if sub.slices:   # a prefix of every channel group: also the first channels of the held slice
            return sub.gather(weights), sub.gather(buffers)
        return sub.apply(weights), buffers   # a model that cannot slice: its masks

    def loss(self, forward, weights, buffers, xb, yb):
        sub = self.widths[int(torch.randint(len(self.widths), ()))]
        if not self.distill:
            return F.cross_entropy(forward(*self._cut(sub, weights, buffers), xb), yb)
        full = forward(weights, buffers, xb)
        soft = F.softmax(full.detach(), dim=-1)
        return F.cross_entropy(full, yb) + F.cross_entropy(forward(*self._cut(sub, weights, buffers), xb), soft)


@register_method
class FjORD(Method):
    """FjORD: ordered dropout, a width drawn per local batch from the nested widths the client's level allows."""
    name = "fjord"
    # its own LocalObjective: not vmapped (no batched clients); a Flower node rebuilds it from the level
    runs_on = ("embedded", "flower-sim", "flower-deploy")
    options = {
        "widths": Option("levels", "the width rates a batch may train: levels (sqrt of each of the system's "
                         "levels, the rates of HeteroFL's slices), uniform5 (0.2,0.4,0.6,0.8,1: FjORD's own) or "
                         "comma-separated rates", kind=str, check=_check_widths),
        "distill": Option(False, "self-distillation: each batch also trains the client's widest width on the "
                          "labels, and the drawn width on its softmax (Flower's FjORD KD)", choices=(True, False)),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.facts.channel_groups("fjord")   # traced now where the model declares none, or its one-line error
        spec = self.args["widths"]
        rates = ([width_rate(float(lv)) for lv in self.system.levels] if spec == "levels"
                 else UNIFORM5 if spec == "uniform5" else [float(v) for v in spec.split(",")])
        self.rates = sorted(set(rates))
        self.allowed = {}
        for lvl in self.system.levels:
            ok = [r for r in self.rates if r <= width_rate(float(lvl)) + 1e-9]
            if not ok:
                raise ConfigError("method_args.widths", f"no width rate fits level {lvl.name} (its rate is at most "
                                  f"{width_rate(float(lvl)):.4g}); add a smaller rate")
            self.allowed[lvl] = ok
        state_widths(self, lambda lvl: self.allowed[lvl][-1])   # the widest width a level holds
        self._cache: dict = {}

    def submodel(self, params, level, round):
        key = (level, next(iter(params.values())).device)
        if key not in self._cache:
            self._cache[key] = self._build(params, self.allowed[level])
        return self._cache[key]

    def _build(self, params, rates: list[float]) -> Submodel:
        top = rates[-1]
        cuts = [None if r == top else self._slice(params, r) for r in rates]
        local = OrderedDropout(cuts, self.args["distill"])
        if top >= 1:
            return Submodel(local=local)   # the whole model: nothing to cut or count
        return dataclasses.replace(self._slice(params, top), local=local)

    def _slice(self, params, rate: float) -> Submodel:
        masks, slices = width_slices(self.facts, params, rate)
        return Submodel(masks, slices=slices)
