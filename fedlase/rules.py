"""The built-in rules and attacks of the server step (fedlase/server_step.py: `Rule`, `Attack`, `ServerStep`), each a
class with its options, registered here (loaded with the other built-ins, fedlase/catalog.py).

Rules (each but `none` after the screen):
   none: the plain streaming mean (fedlase/aggregate.py) of every update;
   screen: the streaming mean of the accepted updates (the default);
   clip / adaptive_clip: each update clipped to a norm bound first, then the streaming mean;
   trimmed_mean / median: coordinate-wise, over the clients credited with each coordinate;
   multikrum: the streaming mean of the updates closest to their neighbours on shared coordinates;
   centered_clip: each update clipped around the last step (Karimireddy et al. 2021), then the mean.
Attacks: scale, sign_flip, gaussian, nan (and none), and the colluding little_is_enough and inner_product, on the
clients the WHO options choose (every attack takes them: server_step.Attack)."""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch

from .aggregate import Aggregator, aggregate
from .options import Option
from .registry import register_attack, register_rule
from .robust_config import SCREEN
from .server_step import Attack, Rule, held, level_key, low_median, squared_norms


# ---- the attacks -------------------------------------------------------------------------------------------------
@register_attack
class NoAttack(Attack):
    """Every client honest."""
    name = "none"
    chooses_clients = False

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return delta


@register_attack
class Scale(Attack):
    """The delta times `factor`."""
    name = "scale"
    options = {"factor": Option(10.0, "scale: the delta times factor", low=0, low_open=True)}

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: d * self.args["factor"] for n, d in delta.items()}


@register_attack
class SignFlip(Attack):
    """The delta times -`factor`."""
    name = "sign_flip"
    options = {"factor": Option(1.0, "sign_flip: the delta times -factor", low=0, low_open=True)}

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: d * -self.args["factor"] for n, d in delta.items()}


@register_attack
class NaN(Attack):
    """Every value of the delta NaN."""
    name = "nan"

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: torch.full_like(d, float("nan")) for n, d in delta.items()}


@register_attack
class Gaussian(Attack):
    """Gaussian noise added where the client holds coordinates (its mask; on a gathered slice, the slice's
    inner mask), so it stays a well-formed reply; seeded from (run seed, round, client)."""
    name = "gaussian"
    options = {"std": Option(1.0, "gaussian: standard deviation of the noise added on the coordinates a client "
                             "holds", low=0, low_open=True)}

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        from .sampling import Stream, derive_seed
        g = torch.Generator().manual_seed(derive_seed(self.seed, rnd, Stream.ATTACK, client))
        out = {}
        for n, d in delta.items():
            small = d.shape != full_shapes[n]
            mask = (sub.inner() if small else sub).masks.get(n)
            noise = torch.randn(d.shape, generator=g).to(d.device, d.dtype) * self.args["std"]
            out[n] = d + (noise * mask if mask is not None else noise)
        return out


class Colluding(Attack):
    """Colluders who see the step's honest updates (omniscient, as in the papers) and send, on the coordinates
    each holds, a `target` made from the honest updates' coordinate-wise mean and standard deviation over the
    honest clients credited with each coordinate (a coordinate no honest client holds keeps the colluder's own
    value). A step without an honest update, or without a colluder, is left as it is."""
    colludes = True

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return delta   # the step's `collude` replaces it, once the others' are in

    def target(self, mean: torch.Tensor, std: torch.Tensor, n: int, m: int) -> torch.Tensor:
        """What m colluders among n updates send, from the honest mean and std of a parameter."""
        raise NotImplementedError

    def collude(self, updates, subs, params):
        bad = [i for i, u in enumerate(updates) if u.client in self.clients]
        honest = [u for u in updates if u.client not in self.clients]
        if not bad or not honest:
            return updates
        agg = Aggregator(params)   # the held coordinates (mask coverage) count, whatever the run's coverage
        ups = [dense(agg, u.delta, u.sub or subs[u.level]) for u in honest]
        target, seen = {}, {}
        for n in params:
            vals = torch.stack([u[n][0] for u in ups]).double()
            cred = torch.stack([u[n][1] for u in ups])
            c = cred.sum(0).clamp(min=1)
            mean = vals.sum(0) / c
            std = (((vals - mean) * cred).square().sum(0) / c).sqrt()
            target[n], seen[n] = self.target(mean, std, len(updates), len(bad)).to(params[n].dtype), cred.any(0)
        out = list(updates)
        for i in bad:
            u = updates[i]
            sub = u.sub or subs[u.level]
            t, masks = _in_shapes(target, u.delta, sub, params)
            k, _ = _in_shapes(seen, u.delta, sub, params)
            delta = {}
            for n, d in u.delta.items():
                v = torch.where(k[n], t[n], d)
                delta[n] = v * masks[n] if n in masks else v
            out[i] = dataclasses.replace(u, delta=delta)
        return out


@register_attack
class LittleIsEnough(Colluding):
    """"A little is enough" (Baruch, Baruch and Goldberg, NeurIPS 2019): the colluders send mean - z x std of the
    honest updates, coordinate-wise, a shift small enough to hide among them. z unset: their formula, with n
    updates in the step and m colluders, s = floor(n/2 + 1) - m (at least 1) and z = Phi^-1((n - s)/n)."""
    name = "little_is_enough"
    options = {"z": Option(None, "little_is_enough: the shift in honest standard deviations; unset: Baruch et "
                           "al.'s z from the step's updates and colluders", kind=float, low=0)}

    def target(self, mean, std, n, m):
        return mean - self.args["z"] * std if self.args["z"] is not None else mean - alie_z(n, m) * std


def alie_z(n: int, m: int) -> float:
    """Baruch et al.'s z: the largest shift for which the colluders' value still lies inside (n - s) of the n
    updates' spread, s = floor(n/2 + 1) - m the honest updates they need on their side."""
    from statistics import NormalDist
    s = max(n // 2 + 1 - m, 1)
    return NormalDist().inv_cdf((n - s) / n) if n > s else 0.0


@register_attack
class InnerProduct(Colluding):
    """Inner-product manipulation (Xie, Koyejo and Gupta, UAI 2020, "Fall of Empires"): the colluders send -eps
    times the honest updates' mean, so that the aggregate's inner product with the true step turns negative."""
    name = "inner_product"
    options = {"eps": Option(0.1, "inner_product: the colluders send -eps x the honest mean", low=0,
                             low_open=True)}

    def target(self, mean, std, n, m):
        return -self.args["eps"] * mean


# ---- the rules ---------------------------------------------------------------------------------------------------
def _pairs(updates: list, subs: dict) -> list:
    return [(u.delta, u.sub or subs[u.level]) for u in updates]


def references(rule: Rule, rms: list[float]) -> list[float]:
    """Each accepted update's reference norm per coordinate held: the screen's (`Rule.refs`), or, for updates the
    screen did not see (library code calling `aggregate` alone), their lower median."""
    refs = rule.refs
    return list(refs) if refs is not None and len(refs) == len(rms) else [low_median(rms)] * len(rms)


@register_rule
class Mean(Rule):
    """The plain streaming mean (fedlase.aggregate.aggregate) of every update, unscreened; weighted by each
    update's `weight` (a staleness weight under schedule=fedbuff)."""
    name = "none"
    weighted = True
    dp_safe = True

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        return aggregate(params, _pairs(updates, subs), mode, coverage, owners, [u.weight for u in updates]), {}


@register_rule
class Screened(Mean):
    """The streaming mean of the updates the screen accepts (the default)."""
    name = "screen"
    options = {"screen": SCREEN}
    dp_safe = True


@register_rule
class Clip(Screened):
    """Each update clipped to the L2 norm `bound`, then the streaming mean."""
    name = "clip"
    weighted = True   # clipped first, then each update weighted (a staleness weight under schedule=fedbuff)
    dp_safe = True
    options = {"screen": SCREEN, "bound": Option(
        1.0, "clip: the L2 norm each update is clipped to (the scale of the model's updates: see a run's norms in "
        "its rejections' reasons or use adaptive_clip)", low=0, low_open=True)}

    def bound(self, size: int, ref: float) -> float:
        """The L2 bound of an update holding `size` coordinates whose reference norm per coordinate is `ref`."""
        return self.args["bound"]

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        clipped: Counter[str] = Counter()
        kept = []
        for u, (delta, sub), r, ref in zip(updates, _pairs(updates, subs), rms, references(self, rms)):
            size = held(delta, sub, params)
            bound, norm = self.bound(size, ref), r * math.sqrt(size)
            if norm > bound:   # a bound of 0 or NaN (no reference: every update near zero) clips nothing
                delta = {n: d * (bound / norm) for n, d in delta.items()}
                clipped[level_key(u)] += 1
            kept.append((delta, sub))
        return aggregate(params, kept, mode, coverage, owners, [u.weight for u in updates]), {"clipped": dict(clipped)}


@register_rule
class AdaptiveClip(Clip):
    """Each update's norm per coordinate held clipped to `factor` times its reference (the screen's median: its
    level's, or the round's), then the mean."""
    name = "adaptive_clip"
    options = {"screen": SCREEN, "factor": Option(1.0, "adaptive_clip: clip each update's norm per coordinate "
                                                  "held to this multiple of the median (its level's with 3 or "
                                                  "more of the level's clients, else the round's)", low=0,
                                                  low_open=True)}

    def bound(self, size: int, ref: float) -> float:
        return self.args["factor"] * ref * math.sqrt(size) if ref > 0 else math.inf


@register_rule
class Bounded(AdaptiveClip):
    """The default: adaptive_clip behind a tight screen. An update is rejected when its norm per coordinate held
    exceeds `screen` = 3 x the round's median (100 x for every other rule), and the rest are clipped to
    `factor` x that median, then averaged (docs/methods.md, "The default rule: bounded", says why 3).

    Under differential privacy (a stage that may not treat one update by what the others are), its
    median-relative screen and clip give way to dp's own clip at `dp.clip`: it runs as `screen`, whose screen keeps
    only its per-update checks under dp, so the plain mean of the updates that pass them."""
    name = "bounded"
    options = {"screen": Option(3.0, SCREEN.help, low=1), "factor": AdaptiveClip.options["factor"]}
    privately = Screened   # under dp: the per-update checks, then the mean (fedlase/server_step.py, ServerStep.of)
    dp_safe = True


@register_rule
class CenteredClip(Screened):
    """Centered clipping (Karimireddy, He and Jaggi, ICML 2021): each update's difference from a center is
    clipped, and the center moves by their mean, `iterations` times; the first center is the last step (the
    server's momentum), zero at the first step. Over submodels a client's difference is taken on the coordinates
    it holds, and its radius is `tau` times the step's lower median distance per coordinate held (scale-free, as
    `bounded`'s bound), so a small level is not held to a large one's scale. The result is the streaming mean
    of center + clipped difference, so an uncredited coordinate stays where it is."""
    name = "centered_clip"
    weighted = True   # the streaming mean's weights (a staleness weight under schedule=fedbuff)
    compares = True   # its radius: the step's median distance
    options = {"screen": SCREEN,
               "tau": Option(1.0, "centered_clip: clip radius around the center, as a multiple of the step's "
                             "lower median distance per coordinate held", low=0, low_open=True),
               "iterations": Option(1, "centered_clip: clipping iterations per step, 1 to 100 (the paper uses 1-3; the "
                                     "center has long stopped moving by 100)", low=1, high=100)}

    def __init__(self, **args):
        super().__init__(**args)
        self.center: dict | None = None   # the last step's delta, full size

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        pairs, weights = _pairs(updates, subs), [u.weight for u in updates]
        center = self.center or {n: torch.zeros_like(p) for n, p in params.items()}
        clipped: Counter[str] = Counter()
        for it in range(self.args["iterations"]):
            # each update's center on its coordinates (its slice, its mask), and its difference from it
            near = [_restrict(center, delta, sub, params) for delta, sub in pairs]
            diff = [{n: d - c[n] for n, d in delta.items()} for (delta, _), c in zip(pairs, near)]
            sizes = [max(held(delta, sub, params), 1) for delta, sub in pairs]
            dist = [math.sqrt(ss) for ss in squared_norms(diff)]
            radius = self.args["tau"] * low_median([x / math.sqrt(k) for x, k in zip(dist, sizes)])
            moved = []
            for u, d, c, x, k, (_, sub) in zip(updates, diff, near, dist, sizes, pairs):
                bound = radius * math.sqrt(k)
                if x > bound:   # (a radius of 0: every update at the center, nothing to clip)
                    d = {n: v * (bound / x) for n, v in d.items()}
                    if it == self.args["iterations"] - 1:
                        clipped[level_key(u)] += 1
                moved.append(({n: c[n] + v for n, v in d.items()}, sub))
            zero = {n: torch.zeros_like(p) for n, p in params.items()}
            center = aggregate(zero, moved, "coverage", coverage, owners, weights)
        new = aggregate(params, moved, mode, coverage, owners, weights)
        self.center = {n: new[n] - p for n, p in params.items()}
        return new, {"clipped": dict(clipped)}

    def state_dict(self) -> dict:
        return {"center": self.center}

    def load_state_dict(self, state: dict) -> None:
        self.center = state.get("center")


def _in_shapes(full: dict, delta: dict, sub, params: dict) -> tuple[dict, dict]:
    """The full-size tensors `full` in an update's delta shapes (its slice gathered, or full size as they are), and
    the masks of those shapes."""
    small = any(d.shape != params[n].shape for n, d in delta.items())
    part = sub.gather({n: full[n] for n in delta}) if small else {n: full[n] for n in delta}
    return part, (sub.inner() if small else sub).masks


def _restrict(full: dict, delta: dict, sub, params: dict) -> dict:
    """The full-size tensors `full` on the coordinates an update holds, in its delta's shapes (a gathered slice,
    or masked at full size)."""
    part, masks = _in_shapes(full, delta, sub, params)
    return {n: t * masks[n] if n in masks else t for n, t in part.items()}


@register_rule
class Median(Screened):
    """The coordinate-wise median over the clients credited with each coordinate."""
    name = "median"
    weighted = False
    compares = True
    options = {"screen": SCREEN}

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        agg = Aggregator(params, mode, coverage, owners)
        return coordinatewise(agg, _pairs(updates, subs), self.name, self.args.get("trim", 0.0)), {}


@register_rule
class TrimmedMean(Median):
    """The coordinate-wise trimmed mean over the clients credited with each coordinate."""
    name = "trimmed_mean"
    options = {"screen": SCREEN, "trim": Option(0.1, "trimmed_mean: fraction of a coordinate's credited values cut "
                                                "from each end, in [0, 0.5)", low=0, high=0.5, high_open=True)}


@register_rule
class MultiKrum(Screened):
    """The streaming mean of the updates closest to their neighbours on shared coordinates."""
    name = "multikrum"
    weighted = False
    compares = True
    options = {"screen": SCREEN, "faulty": Option(0.2, "multikrum: fraction f/n of a round's updates assumed "
                                                  "faulty, in [0, 0.5)", low=0, high=0.5, high_open=True)}

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        pairs = _pairs(updates, subs)
        chosen = multikrum(Aggregator(params, mode, coverage, owners), pairs, self.args["faulty"])
        info = {"dropped": sorted(updates[i].client for i in range(len(pairs)) if i not in chosen)}
        return aggregate(params, [pairs[i] for i in sorted(chosen)], mode, coverage, owners), info


def dense(agg: Aggregator, delta: dict, sub) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One update as full-size (values, credited) per parameter under the aggregator's coverage rule: values hold
    the delta (times a float credit under `kept`, as the mean adds it) where credited, and 0 elsewhere."""
    out = {}
    for n, block, d, count in agg.terms(delta, sub):
        g = agg.global_params[n]
        cred = torch.ones_like(d, dtype=torch.bool) if isinstance(count, int) else count != 0
        if block is None:
            out[n] = (d.expand_as(g) * cred, cred.expand(g.shape))
        else:
            v, c = torch.zeros_like(g), torch.zeros(g.shape, dtype=torch.bool, device=g.device)
            v[block], c[block] = d * cred, cred
            out[n] = (v, c)
    for n, g in agg.global_params.items():   # a parameter the update leaves out is not credited to it
        if n not in out:
            out[n] = (torch.zeros_like(g), torch.zeros(g.shape, dtype=torch.bool, device=g.device))
    return out


def coordinatewise(agg: Aggregator, pairs: list, rule: str, trim: float) -> dict:
    """Coordinate-wise median or trimmed mean over the clients credited with each coordinate (Yin et al.
    2018). A coordinate credited to c clients: the median of its c values (the mean of the two middle ones
    when c is even); the trimmed mean cuts floor(trim * c) values from each end, so a coordinate held by fewer
    than 1/trim clients keeps all of them (their mean). Memory: every update, full size, per parameter at a
    time (n x the parameter's size, plus the sort). Under `mean` mode the step is scaled by c/|A|, as the
    plain mean's is; an uncredited coordinate stays."""
    ups = [dense(agg, d, s) for d, s in pairs]
    out = {}
    for n, g in agg.global_params.items():
        vals = torch.stack([u[n][0] for u in ups]) if ups else g.unsqueeze(0) * 0
        cred = torch.stack([u[n][1] for u in ups]) if ups else torch.zeros_like(vals, dtype=torch.bool)
        c = cred.sum(0)
        s = torch.where(cred, vals, torch.full_like(vals, math.inf)).sort(0).values   # credited first, sorted
        s = torch.where(torch.isinf(s), torch.zeros_like(s), s)
        idx = torch.arange(len(ups), device=g.device).view(-1, *[1] * g.dim())
        if rule == "median":
            lo, hi = ((c - 1).clamp(min=0) // 2).unsqueeze(0), (c // 2).unsqueeze(0)
            step = (s.gather(0, lo) + s.gather(0, hi)).squeeze(0) / 2
        else:
            t = torch.floor(trim * c.to(torch.float64)).to(c.dtype)
            keep = (idx >= t) & (idx < c - t)
            step = (s * keep).sum(0) / (c - 2 * t).clamp(min=1)
        step = torch.where(c > 0, step, torch.zeros_like(step))
        if agg.mode == "mean":
            step = step * c / max(len(ups), 1)
        out[n] = g + step
    return out


def multikrum(agg: Aggregator, pairs: list, faulty: float) -> set[int]:
    """Multi-Krum (Blanchard et al. 2017) on updates that cover different coordinates: the distance of two
    updates is their mean squared difference over the coordinates both are credited with (a pair sharing none
    has no distance); an update's score is the mean of its k = n - f - 2 smallest distances (fewer if it has
    fewer neighbours; no neighbour: last), and the m = n - f best-scored are kept. Memory: every update, full
    size, at once, and the n x n distances."""
    n = len(pairs)
    f = math.floor(faulty * n)
    if n <= 2 or f == 0:
        return set(range(n))
    ups = [dense(agg, d, s) for d, s in pairs]
    dist = torch.full((n, n), math.inf, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1, n):
            sq, shared = 0.0, 0
            for name in agg.global_params:
                (vi, ci), (vj, cj) = ups[i][name], ups[j][name]
                both = ci & cj
                shared += int(both.sum())
                sq += float(((vi - vj).double().square() * both).sum())
            if shared:
                dist[i, j] = dist[j, i] = sq / shared
    k = max(n - f - 2, 1)
    scores = []
    for i in range(n):
        near = dist[i][torch.isfinite(dist[i])].sort().values[:k]
        scores.append((float(near.mean()) if len(near) else math.inf, i))
    return {i for _, i in sorted(scores)[:n - f]}
