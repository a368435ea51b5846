"""DepthFL (Kim et al., ICLR 2023): depth-scaled submodels, a classifier after every stage, mutual
self-distillation between a client's classifiers (see docs/methods.md, "DepthFL").

A client of level l trains the first d stages of the model, d the deepest depth whose share of the model's
budgeted parameters (conv and linear weights and biases, exits included) is at most l, with the exit
classifier after each of its stages (the model's own classifier after the last stage). Its loss sums, over
its classifiers i, the cross-entropy on the labels and w(t) times the mean over the other classifiers j of
KL(softmax(z_j) || softmax(z_i)), z_j detached (T = 1); w(t) = exp(-5 (1 - min(t, R)/R)^2), t = round - 1,
ramps up over R = `kd_rampup` rounds (Flower's DepthFL baseline: 300). A level evaluates its depth-d network,
predicting with the mean of its classifiers' logits (`predict`). Aggregation: each coordinate averaged over the
clients holding it (the protocol of every method here; the baseline's FedDyn correction is not used).

The exits are added to the model by `prepare_model` (fedlase/models/exits.py): `heads=bottleneck` DepthFL's own,
`heads=linear` one linear layer on pooled features. A level below the shallowest network's share is a
one-line ConfigError that names the smallest feasible level."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..masks import Submodel
from ..model_hooks import hook
from ..models.exits import EXIT_KINDS, EXIT_PREDICTIONS, attach_exits, depth_names
from ..registry import register_method
from .base import LocalObjective, Method, Option

EXIT_PROTOCOL = ("stages", "stage_widths", "stage_prefixes", "final_exit", "final_prefixes", "norm")


def kd_weight(round: int, rampup: int) -> float:
    """DepthFL's consistency weight exp(-5 (1 - min(t, R)/R)^2), t = round - 1; R = 0: always 1."""
    if rampup == 0:
        return 1.0
    t = min(round - 1, rampup) / rampup
    return math.exp(-5.0 * (1.0 - t) ** 2)


class DepthObjective(LocalObjective):
    """Every exit's cross-entropy plus, with weight `kd`, the mean KL from each other exit (detached)."""

    def __init__(self, depth: int, kd: float):
        self.depth, self.kd = depth, kd

    def loss(self, forward, weights, buffers, xb, yb):
        z = forward(weights, buffers, xb, depth=self.depth, all_exits=True)    # (depth, B, classes)
        loss = sum(F.cross_entropy(z[i], yb) for i in range(self.depth))
        if self.kd > 0 and self.depth > 1:
            logp = F.log_softmax(z, dim=-1)
            target = logp.detach().exp()
            kl = sum(F.kl_div(logp[i], target[j], reduction="batchmean")
                     for i in range(self.depth) for j in range(self.depth) if j != i)
            loss = loss + self.kd * kl / (self.depth - 1)
        return loss


@register_method
class DepthFL(Method):
    """DepthFL: each level trains the model's first stages with a classifier after each, distilling mutually."""
    name = "depthfl"
    # its own LocalObjective: not vmapped (no batched clients); a Flower node rebuilds it from the level and round
    runs_on = ("embedded", "flower-sim", "flower-deploy")
    options = {
        "heads": Option("bottleneck", "exit classifiers after the inner stages: bottleneck (DepthFL's own: "
                        "attention, separable convs widening to the last stage, linear) or linear (pooling and "
                        "one linear layer)", choices=EXIT_KINDS),
        "distill": Option(True, "mutual self-distillation between a client's classifiers (KL, T=1)",
                          choices=(True, False)),
        "kd_rampup": Option(300, "rounds over which the distillation weight ramps up to 1 as "
                            "exp(-5(1-t/R)^2), t = round-1 (the reference code: 300); 0: weight 1 from the start",
                            low=0),
        "predict": Option("ensemble", "a level predicts with the mean of its classifiers' logits (ensemble, "
                          "DepthFL's) or its deepest classifier (last)", choices=EXIT_PREDICTIONS),
    }

    @classmethod
    def prepare_model(cls, model, options):
        missing = [m for m in EXIT_PROTOCOL if hook(model, m) is None]
        if missing:
            raise ConfigError("method", f"depthfl needs a model with stages; {type(model).__name__} declares no "
                              f"{', '.join(missing)}() (fedlase/models/exits.py)")
        if hook(model, "exit_heads") is None:
            args = cls.check_args(options)
            attach_exits(model, args["heads"], args["predict"])
        return model

    def __init__(self, model, system=(1.0,), *, run_seed=None, **options):
        self.prepare_model(model, options)   # a model built without the run's builder gets its exits here
        super().__init__(model, system, run_seed=run_seed, **options)
        self.num_stages = len(model.stage_prefixes())
        self.shares = [self.share(d) for d in range(1, self.num_stages + 1)]
        self.depths = {lvl: self.depth_for(lvl) for lvl in self.system.levels}
        self._masks: dict = {}

    def members(self, depth: int) -> list[str]:
        prefixes = tuple(depth_names(self.model, depth))
        return [n for n, _ in self.model.named_parameters() if n.startswith(prefixes)]

    def share(self, depth: int) -> float:
        """The share of the budgeted parameters a depth-`depth` network holds."""
        sizes = dict((n, p.numel()) for n, p in self.model.named_parameters())
        held = set(self.members(depth))
        return sum(sizes[n] for n in self.maskable if n in held) / sum(sizes[n] for n in self.maskable)

    def depth_for(self, level) -> int:
        fits = [d for d, s in enumerate(self.shares, 1) if s <= float(level) + 1e-12]
        if not fits:
            s = self.shares[0]
            hint = " (method_args.heads=linear makes depth 1 smaller)" if self.args["heads"] == "bottleneck" else ""
            raise ConfigError("system", f"depthfl cannot meet level {level.name} on {type(self.model).__name__} "
                              f"with {self.args['heads']} heads: depth 1 holds 1/{1 / s:.1f} of the model, so the "
                              f"smallest feasible level is 1/{math.floor(1 / s)}{hint}")
        return max(fits)

    def submodel(self, params, level, round):
        d = self.depths[level]
        kd = kd_weight(round, self.args["kd_rampup"]) if self.args["distill"] else 0.0
        return dataclasses.replace(self._depth_submodel(params, d), local=DepthObjective(d, kd))

    def _depth_submodel(self, params, d: int) -> Submodel:
        """Masks (zero outside the first d stages and their exits) and the slice of `exit_depth` that makes
        the evaluated network d stages deep; built once per depth."""
        if d not in self._masks:
            held = set(self.members(d))
            device = next(iter(params.values())).device
            masks = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in params.items() if n not in held}
            slices = {"exit_depth": (torch.arange(d, device=device),)} if d < self.num_stages else {}
            self._masks[d] = Submodel(masks, slices=slices)
        return self._masks[d]
