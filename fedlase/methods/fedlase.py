"""FedLASE: layer-adaptive submodel extraction (from the authors' rebuttal; no public code exists).

Each round, for each resource level:
1. budget B = int(level * maskable count), as FIARSE counts it. The first and last layers (and all biases)
   are kept whole and paid from B; the rest, R, is shared among the extracted layers (the other conv and
   linear weights).
2. each extracted layer l gets a score s_l from its magnitudes: mean |w| (default), max |w|, or `equal`
   (every extracted layer keeps the same ratio);
3. the score becomes an allocation weight a_l by one of two transforms (`transform`):
     share: a_l = log(1 + n_l * s_l)            (log off: n_l * s_l)    -- layer's share of R
     ratio: a_l = n_l * log(1 + s_l / s_min)    (log off: n_l * s_l / s_min) -- keep ratio ~ log(1 + s/s_min)
   where n_l is the layer's size;
4. k_l = min(n_l, c * a_l) with c chosen so that sum k_l = R exactly (water-filling: a layer that would
   exceed its size is kept whole and its surplus goes to the others in proportion), rounded by largest
   remainder;
5. inside each layer the k_l largest |w| are kept; the client keeps the per-layer thresholds and trains as
   FIARSE's clients do (`ste`), and the server averages each coordinate over the clients that trained it.
"""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..model_hooks import hook
from ..registry import register_method
from ..server_step import on_host
from .base import Option, ThresholdMethod


def water_fill(weights: list[float], sizes: list[int], total: int) -> list[int]:
    """Integers k_l <= sizes[l] with sum == total (<= sum of sizes), proportional to weights where no cap
    binds: capped layers are kept whole and the rest is re-shared among the others. Remainders go to the
    largest fractional parts (ties to the earlier layer), so the total is met exactly. Non-finite weights
    (scores of a model that holds NaN or Inf) share by size."""
    n = len(sizes)
    total = min(total, sum(sizes))
    if not all(math.isfinite(w) for w in weights):   # a model holding NaN/Inf (robust=none): no usable signal
        weights = [float(s) for s in sizes]
    alloc = [0.0] * n
    free = [i for i in range(n) if sizes[i] > 0]
    left = float(total)
    while free and left > 0:
        w = [max(weights[i], 0.0) for i in free]
        if sum(w) <= 0:                      # no signal left: share by size
            w = [float(sizes[i]) for i in free]
        c = left / sum(w)
        capped = [i for i, wi in zip(free, w) if c * wi >= sizes[i]]
        if not capped:
            for i, wi in zip(free, w):
                alloc[i] = c * wi
            break
        for i in capped:
            alloc[i] = float(sizes[i])
            left -= sizes[i]
        free = [i for i in free if i not in capped]
    k = [min(sizes[i], math.floor(alloc[i] + 1e-9)) for i in range(n)]
    short = total - sum(k)
    order = sorted(range(n), key=lambda i: (-(alloc[i] - k[i]), i))
    for i in order:
        if short <= 0:
            break
        if k[i] < sizes[i]:
            k[i] += 1
            short -= 1
    return k


@register_method
class FedLASE(ThresholdMethod):
    """FedLASE: layer-adaptive extraction; per-layer budgets from log-smoothed layer magnitude scores."""
    name = "fedlase"
    options = {
        "score": Option("mean", "layer score: mean |w| of the layer, max |w|, or equal (same ratio for every layer)",
                        choices=("mean", "max", "equal")),
        "log": Option(True, "log-smooth the layer scores (false: the rebuttal's 'w/o log')", choices=(True, False)),
        "transform": Option("share", "share: budget share ~ log(1 + n*s); ratio: keep ratio ~ log(1 + s/s_min)",
                            choices=("share", "ratio")),
        "extract_all_layers": Option(False, "extract the first and last layers too (the rebuttal's 'w all layers')",
                                     choices=(True, False)),
        "edge_layers": Option("model", "layers kept whole: model (the model's edge_layers() if it declares them, "
                              "else its first and last layers) or first_last (always the first and last budgeted "
                              "weights)", choices=("model", "first_last")),
        **ThresholdMethod.options,   # ste, overlap
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        params = dict(model.named_parameters())
        weights = [n for n in self.maskable if n.endswith("weight")]
        if self.args["extract_all_layers"]:
            self.extracted = weights
        else:
            # the layers kept whole: the model's own choice (a transformer's edge_layers(), see docs/text.md)
            # unless edge_layers=first_last; models that declare none keep their first and last weights
            edges = [weights[0], weights[-1]]
            declared = hook(model, "edge_layers")
            if self.args["edge_layers"] == "model" and declared is not None:
                edges = list(declared())
            self.extracted = [n for n in weights if n not in edges]
        fixed = sum(params[n].numel() for n in self.maskable if n not in self.extracted)
        smallest = float(self.system.smallest)
        if self.budget(params, smallest) < fixed:
            raise ConfigError("method_args.extract_all_layers",
                              f"level {smallest:g} allows {self.budget(params, smallest)} parameters, fewer than the "
                              f"{fixed} of the first and last layers and biases kept whole; set "
                              "method_args.extract_all_layers=true or use a larger model")

    def layer_budgets(self, params: dict[str, torch.Tensor], level: float) -> dict[str, int]:
        """Kept parameters of each extracted layer at this level (sums exactly to the extracted budget)."""
        sizes = [params[n].numel() for n in self.extracted]
        fixed = sum(params[n].numel() for n in self.maskable if n not in self.extracted)
        rest = self.budget(params, level) - fixed
        score, log = self.args["score"], self.args["log"]
        if score == "equal":
            weights = [float(s) for s in sizes]
        else:
            with torch.no_grad():   # one host read for all the layers' scores, not one per layer
                s = on_host([params[n].abs().mean() if score == "mean" else params[n].abs().max()
                             for n in self.extracted])
            if self.args["transform"] == "share":
                weights = [math.log1p(n * si) if log else n * si for n, si in zip(sizes, s)]
            else:
                s_min = min(x for x in s if x > 0) if any(x > 0 for x in s) else 1.0
                weights = [n * (math.log1p(si / s_min) if log else si / s_min) for n, si in zip(sizes, s)]
        return dict(zip(self.extracted, water_fill(weights, sizes, rest)))

    def group_budgets(self, params, level):
        """One group per extracted layer: inside a layer the k_l largest |w| are kept."""
        return [([name], k) for name, k in self.layer_budgets(params, level).items()]
