"""FedLASE with layer-adaptive widths (`method=fedlase_width`): FedLASE's layer budgets spent on whole output
channels, so a client holds and trains a smaller dense model (docs/methods-structured.md, "FedLASE with
layer-adaptive widths").

Each round, for each level l < 1 (level 1 trains the whole model):
1. FedLASE's own per-layer budgets at l (`FedLASE.layer_budgets`, called, not copied: its scores mean/max/equal,
   log smoothing, share/ratio transform and water-filling): k_j for every extracted layer j of n_j weights,
   i.e. a keep ratio rho_j = k_j / n_j. The edge layers (`extract_all_layers=false`) get no ratio: a width
   model cannot keep the first conv whole without keeping its whole output group; they hold what the widths of
   the groups they touch give them, and that is paid from the same budget.
2. Ratio -> a rate per cut dimension: q_j = sqrt(rho_j) when both of j's dims are cut (its size scales with its
   output width times its input width, as HeteroFL's rate sqrt(l)), rho_j when only one is (a classifier's
   inputs).
3. Each channel group g (`channel_groups()`: a residual stage is one group, its blocks' outputs and shortcut are
   added) gets the size-weighted mean w_g of the rates of the extracted layers whose OUTPUT is g (a layer spends
   its share on output channels); a group with no extracted producer takes its consumers' rates, else sqrt(l).
4. A global multiplier m scales every width: group g keeps k_g(m) = clamp(floor(m w_g K_g), 1, K_g) channels.
   The submodel's size S(m) = sum over budgeted tensors of numel * (k_out/K_out) * (k_in/K_in) (every layer's
   size depends on its own width and its input's) is nondecreasing in m, so a bisection finds the largest m
   with S(m) <= B = int(l * budgeted count), FIARSE's budget. One greedy pass then adds a channel to each group,
   largest fractional part first, where it still fits. So the budget is met (S <= B) at every level, unless even
   one channel per group exceeds it (then one channel per group).
   With `budget=both` the same m must also meet a compute budget: the submodel's forward work
   W(m) = sum of numel * uses * (k_out/K_out) * (k_in/K_in), where `uses` is how often one sample's forward pass
   applies each weight coordinate (a conv weight at every output position, a linear weight once; measured
   once by `fedlase.layers.forward_uses`), is at most l times the full model's. A parameter budget alone lets
   the log-smoothed shares give the small early layers of a CNN, which run at the highest resolution, most of
   their channels: the same parameters then cost several times HeteroFL's compute (docs/results.md, issue 30).
   The default, `budget=params`, is the parameter budget alone: measured, it is the more accurate of the two on
   both image regimes, while `budget=both` holds far fewer parameters than HeteroFL at the same level.
5. Inside a group the k_g channels of largest magnitude are kept (`channels=magnitude`: the sum over the
   group's producing weights of each output channel's mean |w|; ties to the lower index), or its first k_g
   (`channels=first`, HeteroFL's window: isolates the effect of the widths alone).

The submodel is a width slice (`width_slices` with these kept channels): the client gathers and trains the smaller
dense tensors, as HeteroFL's and FedRolex's clients do, and the server averages each coordinate over the
clients that hold it. No scaler: the widths differ per group and BN cancels a constant factor anyway."""
from __future__ import annotations

import logging
import math

import torch

from ..errors import ConfigError
from ..layers import forward_uses
from ..levels import level_name
from ..masks import Submodel
from ..registry import register_method
from ..slicing import group_sizes, held, width_rate, width_slices
from .base import Method, Option
from .feddse import top_channels
from .fedlase import FedLASE

log = logging.getLogger("fedlase")
SCORING = ("score", "log", "transform", "extract_all_layers", "edge_layers")   # FedLASE's switches that apply


@register_method
class FedLASEWidth(Method):
    """FedLASE with layer-adaptive widths: FedLASE's layer budgets spent on whole output channels (sliced)."""
    name = "fedlase_width"
    options = {
        **{k: FedLASE.options[k] for k in ("score", "log", "transform")},
        "extract_all_layers": Option(False, "score the first and last layers too (false: they get no ratio of their "
                                     "own and hold what their groups' widths give them)", choices=(True, False)),
        "edge_layers": Option("model", "the layers left unscored: model (the model's edge_layers() if it declares "
                              "them, else its first and last layers) or first_last", choices=("model", "first_last")),
        "budget": Option("params", "what the level bounds: params (parameters only, as FedLASE's masks) or both "
                         "(parameters and forward compute, each at most l of the full model's)",
                         choices=("params", "both")),
        "channels": Option("magnitude", "which channels a group keeps: magnitude (largest mean |w| of their "
                           "output rows) or first (HeteroFL's first channels)", choices=("magnitude", "first")),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.groups = self.facts.channel_groups(self.name)   # traced where the model declares none, or one line
        # FedLASE's layer budgets, from its own code; system (1,) so its masked-only check (edges kept whole
        # must fit the smallest level) does not apply: edge layers here are not kept whole
        self.scorer = FedLASE(model, (1.0,), run_seed=self.seed, **{k: self.args[k] for k in SCORING})
        params = dict(model.named_parameters())
        self.sizes = group_sizes(self.groups, params)
        # budget=both only: each weight's uses in one forward pass (one pass at start-up) and the full model's work
        self.uses = forward_uses(model) if self.args["budget"] == "both" else None
        self.full_work = self._cost(dict(self.sizes), params, self.uses) if self.uses is not None else None
        self._check_smallest(params)
        self._single: set[str] = set()   # levels already said to cut a group to a single channel

    def _cost(self, keep: dict[str, int], params, uses: dict[str, int] | None = None) -> int:
        """Budgeted coordinates held when group g keeps keep[g] of its channels; with `uses`, each coordinate
        weighted by its uses in one forward pass (the forward work)."""
        return held(self.groups, self.sizes, params, self.maskable, keep, uses)

    def _check_smallest(self, params) -> None:
        """Refuse (one line) a system whose smallest level cannot be met: one channel per group already holds more
        than its budget, because layers no width cut reaches (the classes, the image channels, a flatten into a
        linear layer) are kept whole. The widths would otherwise cut every group to one channel and still hand
        the level more than its fraction."""
        lvl = self.system.smallest
        least = {g: 1 for g in self.sizes}
        budget = self.budget(params, lvl)
        cost, work = self._cost(least, params), None
        if self.uses is not None and self._cost(least, params, self.uses) > int(float(lvl) * self.full_work):
            work = "forward work"
        if cost <= budget and work is None:
            return
        whole = sorted((n for n in self.maskable if self.groups.get(n, (None, None)) == (None, None)),
                       key=lambda n: -params[n].numel())
        uncut = sum(params[n].numel() for n in whole)
        what = f"its {work} budget" if work and cost <= budget else f"its {budget:,} budgeted parameters"
        raise ConfigError("system", f"level {lvl.name} of fedlase_width cannot be met: one channel per group "
                          f"already holds {cost:,} parameters, over {what} ({uncut:,} are in layers no width cut "
                          f"reaches: {', '.join(whole[:3]) or 'none'}); use larger levels or a model whose uncut "
                          "layers are smaller")

    def widths(self, params: dict[str, torch.Tensor], level) -> dict[str, int]:
        """Group -> kept channels at this level (steps 1-4 of the module docstring)."""
        lvl = float(level)
        if lvl >= 1:
            return dict(self.sizes)
        budgets = self.scorer.layer_budgets(params, lvl)
        rate = {g: [0.0, 0.0] for g in self.sizes}     # size-weighted sum of producer rates, and their size
        used = {g: [0.0, 0.0] for g in self.sizes}     # the same over consumers (a fallback)
        for n, k in budgets.items():
            out_g, in_g = self.groups.get(n, (None, None))
            size = params[n].numel()
            rho = k / size if size else 0.0
            q = math.sqrt(rho) if out_g is not None and in_g is not None else rho
            for g, acc in ((out_g, rate), (in_g, used)):
                if g is not None:
                    acc[g][0] += size * q
                    acc[g][1] += size
        w = {}
        for g in self.sizes:
            src = rate[g] if rate[g][1] > 0 else used[g]
            w[g] = src[0] / src[1] if src[1] > 0 else width_rate(lvl)
            w[g] = max(w[g], 1e-6)   # a layer given nothing still keeps a channel and scales with m
        budget = self.budget(params, lvl)
        work_budget = int(lvl * self.full_work) if self.uses is not None else None

        def fits(keep: dict[str, int]) -> bool:
            return self._cost(keep, params) <= budget and (
                work_budget is None or self._cost(keep, params, self.uses) <= work_budget)

        def keep_at(m: float) -> dict[str, int]:
            return {g: min(K, max(1, math.floor(m * w[g] * K + 1e-9))) for g, K in self.sizes.items()}

        lo, hi = 0.0, 1.0 / min(w.values()) + 1.0        # keep_at(hi) keeps every channel
        if fits(keep_at(hi)):
            return keep_at(hi)
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(keep_at(mid)) else (lo, mid)
        keep = keep_at(lo)
        # one greedy pass: a channel more for each group, largest fractional part first, where it still fits
        for g in sorted(self.sizes, key=lambda g: -(lo * w[g] * self.sizes[g] - keep[g])):
            if keep[g] < self.sizes[g]:
                keep[g] += 1
                if not fits(keep):
                    keep[g] -= 1
        single = [g for g, k in keep.items() if k == 1 < self.sizes[g]]
        name = level_name(level)
        if single and name not in self._single:   # said once per level and run: widths move every round
            self._single.add(name)
            log.warning("fedlase_width: level %s meets its budget only by cutting %d of %d channel groups to a "
                        "single channel (%s)", name, len(single), len(self.sizes), ", ".join(single[:4]))
        return keep

    @torch.no_grad()
    def channel_scores(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Group -> each channel's magnitude: the sum over the weights whose output is the group of the mean
        |w| of the channel's output row."""
        scores: dict[str, torch.Tensor] = {}
        for n in self.maskable:
            out_g = self.groups.get(n, (None, None))[0]
            if out_g is None or params[n].dim() < 2:
                continue
            s = params[n].detach().abs().flatten(1).mean(1)
            scores[out_g] = scores[out_g] + s if out_g in scores else s
        return scores

    def submodel(self, params, level, round):
        if float(level) >= 1:
            return Submodel()   # the whole model
        counts = self.widths(params, level)
        device = next(iter(params.values())).device
        scores = self.channel_scores(params) if self.args["channels"] == "magnitude" else {}
        keep = {}
        for g, K in self.sizes.items():
            if g in scores:
                keep[g] = top_channels(scores[g], counts[g]).to(device)
            else:
                keep[g] = torch.arange(K, device=device) < counts[g]
        masks, slices = width_slices(self.facts, params, 0.0, keep=keep)
        return Submodel(masks, slices=slices)
