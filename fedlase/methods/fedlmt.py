"""FedLMT and pFedLMT (Liu et al.; the authors' code Sherrylife/FedLMT): clients train a low-rank factorized
model, each factorized 3x3 convolution a (1x3) then a (3x1) convolution through rank r
(fedlase/models/factorized.py). See docs/methods.md, "FedLMT and pFedLMT".

Ranks from the budget: a level is a share of the dense model's budgeted parameters (conv and linear weights and
biases, as every method's level). A rank ratio alpha gives each factorized block the rank round(alpha * planes);
the model's share grows with alpha, so the level's alpha is the largest one whose factorized model holds at most
that share, found by bisection on the counted share (`solve_ratio`). Layers that stay full-rank (the stem, 1x1
shortcuts, the classifier, and the blocks before `decom_rule`) and the smallest ratio the authors' rule runs at
(`min_ratio`: every rank >= 1) set a floor: a level below that model's share cannot be met, and is refused when
the run is built, in one line naming the smallest feasible level (as DepthFL refuses its).

fedlmt: every client trains the same model, factorized at the ratio of the weakest level the run serves (or
`rank_ratio`); the server averages the factors (FedAvg on U and V, not on UV^T), like any parameter.

pfedlmt: the blocks before `decom_rule` (and the stem) are a shared full-rank prefix, averaged over the clients of
every level; the factorized blocks (with their BN and shortcuts) and the classifier are each client's own, kept
by the method per (level, client) and never averaged. The global model holds the factors at the top level's rank,
seeded (as the authors' meta_round 0) from the truncated SVD of each composed W in the permuted layout, so a
level's rank-r factors, its first r columns, are that W's best rank-r approximation; a client that has not
trained yet starts from them. It is personalized: a client is evaluated on its own model (the shared prefix and
its own part)."""
from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..levels import as_system
from ..masks import Submodel, maskable_names, slice_block
from ..models import factorized as fz
from ..models.resnet import ResNet18
from ..registry import register_method
from .base import LocalObjective, Method, Option

__all__ = ["FedLMT", "PFedLMT", "min_ratio", "solve_ratio"]

ALPHA_CAP = 3.0   # at this ratio every block's rank is at its cap (3 * min(in, out) <= 3 * planes)


def solve_ratio(share, level: float, low: float) -> float | None:
    """The largest rank ratio alpha in [low, ALPHA_CAP] with share(alpha) <= level (share: non-decreasing in
    alpha), to 1e-9; None when even alpha = low is over."""
    if share(low) > level + 1e-12:
        return None
    lo, hi = low, ALPHA_CAP
    if share(hi) <= level + 1e-12:
        return hi
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid) <= level + 1e-12 else (lo, mid)
    return lo


def min_ratio(plan: dict) -> float:
    """The smallest ratio the authors' rule round(alpha * planes) runs at: every factorized block's rank >= 1,
    i.e. alpha just above 1/(2 * the narrowest block's planes) (ranks 1, 1, 2, 4 on ResNet-18's stages)."""
    return 0.5 * (1 + 1e-9) / min(cout for _, cout, _ in plan.values())


class LowRank(Method):
    """What FedLMT and pFedLMT share: the factorized model, planned on the dense one by `prepare_model_for`.
    The plan (each level's rank ratio and share, the decom_rule: `ranks_for`) is a function of the model's
    shapes and the options, the same on the dense and the factorized model (fedlase/models/factorized.py,
    `budget_share`), so the method plans it again rather than reading it off the model."""

    @classmethod
    def default_rule(cls, model) -> int:
        return 0

    @classmethod
    def _plan(cls, model, args) -> tuple[dict, list[str], int]:
        """(the convolutions factorized, the budgeted parameter names, the decom_rule in force)."""
        rule = cls.default_rule(model) if args["decom_rule"] is None else args["decom_rule"]
        try:
            return fz.layer_plan(model, rule), maskable_names(model), rule
        except ValueError as e:
            if "decom_rule" in str(e):
                raise ConfigError("method_args.decom_rule", str(e).replace("decom_rule ", "")) from None
            raise ConfigError("model", f"{cls.name}: {e}") from None

    @classmethod
    def _ratio(cls, model, plan, budgeted, level, rule) -> float:
        """The level's rank ratio, or the one-line refusal of a level below the floor."""
        low = min_ratio(plan)
        alpha = solve_ratio(lambda a: fz.budget_share(model, plan, a, budgeted), float(level), low)
        if alpha is None:
            floor = fz.budget_share(model, plan, low, budgeted)
            raise ConfigError("system", f"{cls.name} cannot meet level {level.name} on {type(model).__name__}: at "
                              f"its smallest ranks (decom_rule={rule}) the model holds 1/{1 / floor:.1f} of its dense "
                              f"parameters, so the smallest feasible level is 1/{math.floor(1 / floor)}")
        return alpha

    @classmethod
    def _fit(cls, model, options, levels) -> tuple[dict, dict, list[str], int, dict]:
        """(checked options, plan, budgeted names, decom_rule, {level name: its rank ratio}) for `levels`."""
        args = cls.check_args(options)
        plan, budgeted, rule = cls._plan(model, args)
        return args, plan, budgeted, rule, {lvl.name: cls._ratio(model, plan, budgeted, lvl, rule) for lvl in levels}

    @classmethod
    def ranks_for(cls, model, options, system) -> tuple[dict, dict, int, dict]:
        """({level name: rank ratio}, {level name: share of the dense model's budgeted parameters}, decom_rule,
        the convolutions factorized) of `model`, dense or factorized; the one-line refusals of what cannot run."""
        raise NotImplementedError

    @staticmethod
    def is_factorized(model) -> bool:
        return any(isinstance(m, fz.FactorizedConv2d) for m in model.modules())

    def __init__(self, model, system=(1.0,), *, run_seed=None, **options):
        if not self.is_factorized(model):   # a model built without the run's builder is factorized here
            self.prepare_model_for(model, options, as_system(system))
        super().__init__(model, system, run_seed=run_seed, **options)
        # level name -> rank ratio, and -> share of the dense model's budgeted parameters
        self.alphas, self.shares, self.rule, _ = self.ranks_for(model, options, self.system)


@register_method
class FedLMT(LowRank):
    """FedLMT: every client trains one low-rank factorized model at the weakest level's rank; factors averaged."""
    name = "fedlmt"
    options = {
        "decom_rule": Option(0, "the first block factorized (the authors' hybrid rule): blocks before it stay "
                             "full-rank; resnet18 has blocks 0-7 (the authors' `decom_rule s b` is 2s+b), cnn "
                             "blocks 0-2 (its convs after the stem)", kind=int, low=0),
        "rank_ratio": Option(None, "rank ratio alpha (rank = round(alpha * planes) per block); unset: the largest "
                             "alpha whose model fits the run's weakest level", kind=float, low=0),
    }

    @classmethod
    def ranks_for(cls, model, options, system):
        weakest = system.smallest
        args, plan, budgeted, rule, fits = cls._fit(model, options, [weakest])
        fit = fits[weakest.name]
        alpha = fit if args["rank_ratio"] is None else args["rank_ratio"]
        if alpha < min_ratio(plan):
            raise ConfigError("method_args.rank_ratio", f"{alpha} gives a block rank 0 (round(alpha * planes)); "
                              f"the smallest ratio that runs is {min_ratio(plan):.6f}")
        share = fz.budget_share(model, plan, alpha, budgeted)
        if share > float(weakest) + 1e-12:
            raise ConfigError("method_args.rank_ratio", f"{alpha} gives fedlmt's model 1/{1 / share:.1f} of the "
                              f"dense parameters, over the weakest level {weakest.name}; at most {fit:.4f} fits it")
        return {lvl.name: alpha for lvl in system.levels}, {lvl.name: share for lvl in system.levels}, rule, plan

    @classmethod
    def prepare_model_for(cls, model, options, system):
        if cls.is_factorized(model):
            return model
        alphas, _, _, plan = cls.ranks_for(model, options, system)
        return fz.factorize(model, plan, alphas[system.smallest.name])

    def submodel(self, params, level, round):
        return Submodel()   # the same (small) model at every level


class Personal(LocalObjective):
    """pFedLMT's per-client part: plain cross-entropy training (the base class), from and into the client's own
    copy of its factorized blocks and classifier. fedlase.client.ClientTrainer.update calls `params_for` and
    `finish` around local training (LocalObjective's hooks)."""
    personal = True

    def __init__(self, method: PFedLMT, level):
        self.method, self.level = method, level

    def start(self, model, sub, params, buffers, x, batches):   # LocalObjective.start: the submodel as given
        return sub

    def params_for(self, client: int, params: dict, sub: Submodel) -> dict:
        """The global parameters with the client's own part in place of the global one (the seed)."""
        own = self.method.own.get(self.level.name, {}).get(client)
        if own is None:
            return params
        return {**params, **{n: _place(n, v, params[n], sub) for n, v in own.items()}}

    def finish(self, client: int, params: dict, sub: Submodel, delta: dict) -> dict:
        """Keep the client's trained own part (start + delta, at its level's size); return the delta with that
        part zeroed, so the global model's copy (the seed) is not averaged across clients."""
        out, own = dict(delta), {}
        for n in self.method.custom:
            d = delta[n]
            start = params[n]
            if n in sub.slices:
                start = start[slice_block(sub.slices[n])]
                if d.shape != start.shape:   # a full-size (scattered) delta
                    d = d[slice_block(sub.slices[n])]
            own[n] = (start + d).detach().clone()
            out[n] = torch.zeros_like(delta[n])
        self.method.own.setdefault(self.level.name, {})[client] = own
        return out


def _place(name: str, value: torch.Tensor, like: torch.Tensor, sub: Submodel) -> torch.Tensor:
    """`value` (parameter `name` at its level's size) at the full size of `like`: itself where the shapes agree,
    else `like` with the level's slice replaced by it."""
    if value.shape == like.shape:
        return value
    full = like.clone()
    full[slice_block(sub.slices[name])] = value
    return full


@register_method
class PFedLMT(LowRank):
    """pFedLMT: a shared full-rank prefix averaged over all levels; per-client low-rank blocks at the level's rank."""
    name = "pfedlmt"
    runs_on = ("embedded",)
    confined = ("the server keeps each client's own low-rank blocks and swaps them into its training, which a "
                "Flower node never receives")
    personalized = True       # a client is evaluated with its own part (personal_weights)
    options = {
        "decom_rule": Option(None, "the first factorized block; the blocks before it (and the stem) are the shared "
                             "full-rank prefix; unset: the model's (resnet18 5, the authors' `2 1` on CIFAR-10; cnn "
                             "1); resnet18 has blocks 0-7, cnn 0-2", kind=int, low=0),
        "global_eval": Option(True, "true: a level's global accuracy is the mean over its clients of their own "
                              "models' accuracy on the whole test set (one pass per client); false: not computed "
                              "(NaN; the method is personalized: its local accuracy is its figure)", kind=bool,
                              choices=(True, False)),
    }

    @classmethod
    def default_rule(cls, model) -> int:
        return 5 if isinstance(model, ResNet18) else 1

    @classmethod
    def ranks_for(cls, model, options, system):
        _, plan, budgeted, rule, alphas = cls._fit(model, options, system.levels)
        return alphas, {n: fz.budget_share(model, plan, a, budgeted) for n, a in alphas.items()}, rule, plan

    @classmethod
    def prepare_model_for(cls, model, options, system):
        if cls.is_factorized(model):
            return model
        alphas, _, _, plan = cls.ranks_for(model, options, system)
        fz.factorize(model, plan, max(alphas.values()))
        meta = next(model.parameters()).is_meta   # sizes only (fedlase/resources.py): no values to seed
        with torch.no_grad():   # the authors' meta_round 0: the SVD of each composed W, in the permuted layout
            for name in plan if not meta else ():
                fac = model.get_submodule(name)
                first, second = fz.decompose(fz.compose(fac.first.weight, fac.second.weight), fac.first.out_channels)
                fac.first.weight.copy_(first)
                fac.second.weight.copy_(second)
        return model

    def __init__(self, model, system=(1.0,), *, run_seed=None, **options):
        super().__init__(model, system, run_seed=run_seed, **options)
        blocks = fz.factor_blocks(model)
        prefixes = tuple(p for block in fz.block_prefixes(model)[self.rule:] for p in block)
        head = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1] + "."
        # the client's own part: its factorized blocks (with their BN and shortcuts) and the classifier
        self.custom = [n for n, _ in model.named_parameters() if n.startswith(prefixes + (head,))]
        self.factored = {c: model.get_submodule(c) for block in blocks[self.rule:] for c in block}
        self.own: dict[str, dict[int, dict[str, torch.Tensor]]] = {}   # level name -> client -> name -> tensor
        self._subs: dict = {}
        self.global_eval = bool(self.args["global_eval"])   # fedlase/evaluate.py reads it

    def ranks(self, level) -> dict[str, int]:
        """Each factorized convolution's rank at `level` (nested: at most the global model's)."""
        a = self.alphas[level.name]
        return {c: min(fz.rank_for(a, f.first.in_channels, f.second.out_channels), f.first.out_channels)
                for c, f in self.factored.items()}

    def submodel(self, params, level, round):
        key = (level.name, next(iter(params.values())).device)
        if key not in self._subs:
            masks, slices = {}, {}
            for conv, r in self.ranks(level).items():
                first, second = params[f"{conv}.first.weight"], params[f"{conv}.second.weight"]
                if r == first.shape[0]:
                    continue
                keep = torch.arange(r, device=first.device)
                m1 = torch.zeros_like(first, dtype=torch.bool)
                m1[:r] = True
                m2 = torch.zeros_like(second, dtype=torch.bool)
                m2[:, :r] = True
                masks[f"{conv}.first.weight"], slices[f"{conv}.first.weight"] = m1, (keep,)
                masks[f"{conv}.second.weight"], slices[f"{conv}.second.weight"] = m2, (None, keep)
            self._subs[key] = Submodel(masks, slices=slices, local=Personal(self, level))
        return self._subs[key]

    def personal_weights(self, client: int, level, weights: dict, sub: Submodel) -> dict:
        """The weights client `client` is evaluated with at `level`: `weights` (the level's model, sliced or
        masked) with the client's own part, where it has trained one."""
        own = self.own.get(level.name, {}).get(client)
        if own is None:
            return weights
        # sliced=false evaluates the level as masks over the full-size model: zero outside the slice there
        return {**weights, **{n: _place(n, v, torch.zeros_like(weights[n]), sub) for n, v in own.items()}}

    def state_dict(self) -> dict:
        return {"own": self.own}

    def load_state_dict(self, state: dict) -> None:
        self.own = {lvl: {int(c): dict(t) for c, t in per.items()} for lvl, per in state.get("own", {}).items()}
