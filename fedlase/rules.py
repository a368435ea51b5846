"""The built-in rules and attacks of the server step (fedlase/robust.py: `Rule`, `Attack`, `ServerStep`), each a
class with its options, registered here (loaded with the other built-ins, fedlase/catalog.py).

Rules (each but `none` after the screen):
   none: the plain streaming mean (fedlase/aggregate.py) of every update;
   screen: the streaming mean of the accepted updates (the default);
   clip / adaptive_clip: each update clipped to a norm bound first, then the streaming mean;
   trimmed_mean / median: coordinate-wise, over the clients credited with each coordinate;
   multikrum: the streaming mean of the updates closest to their neighbours on shared coordinates.
Attacks: scale, sign_flip, gaussian, nan (and none), on the clients the WHO options choose."""
from __future__ import annotations

import math

import torch

from .aggregate import Aggregator, aggregate
from .options import Option
from .registry import register_attack, register_rule
from .robust import Attack, Rule, held, low_median
from .robust_config import SCREEN, WHO


# ---- the attacks -------------------------------------------------------------------------------------------------
@register_attack
class NoAttack(Attack):
    """Every client honest."""
    name = "none"

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return delta


@register_attack
class Scale(Attack):
    """The delta times `factor`."""
    name = "scale"
    options = {"factor": Option(10.0, "scale: the delta times factor", low=0, low_open=True), **WHO}

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: d * self.args["factor"] for n, d in delta.items()}


@register_attack
class SignFlip(Attack):
    """The delta times -`factor`."""
    name = "sign_flip"
    options = {"factor": Option(1.0, "sign_flip: the delta times -factor", low=0, low_open=True), **WHO}

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: d * -self.args["factor"] for n, d in delta.items()}


@register_attack
class NaN(Attack):
    """Every value of the delta NaN."""
    name = "nan"
    options = dict(WHO)

    def corrupt(self, delta, sub, full_shapes, rnd, client):
        return {n: torch.full_like(d, float("nan")) for n, d in delta.items()}


@register_attack
class Gaussian(Attack):
    """Gaussian noise added where the client holds coordinates (its mask; on a gathered slice, the slice's
    inner mask), so it stays a well-formed reply; seeded from (run seed, round, client)."""
    name = "gaussian"
    options = {"std": Option(1.0, "gaussian: standard deviation of the noise added on the coordinates a client "
                             "holds", low=0, low_open=True), **WHO}

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


# ---- the rules ---------------------------------------------------------------------------------------------------
def _pairs(updates: list, subs: dict) -> list:
    return [(u.delta, u.sub or subs[u.level]) for u in updates]


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

    def bound(self, size: int, rms: list[float]) -> float:
        return self.args["bound"]

    def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
        clipped, kept = 0, []
        for (delta, sub), r in zip(_pairs(updates, subs), rms):
            size = held(delta, sub, params)
            bound, norm = self.bound(size, rms), r * math.sqrt(size)
            if norm > bound:
                delta = {n: d * (bound / norm) for n, d in delta.items()}
                clipped += 1
            kept.append((delta, sub))
        return aggregate(params, kept, mode, coverage, owners, [u.weight for u in updates]), {"clipped": clipped}


@register_rule
class AdaptiveClip(Clip):
    """Each update's norm per coordinate held clipped to `factor` times the round's median, then the mean."""
    name = "adaptive_clip"
    options = {"screen": SCREEN, "factor": Option(1.0, "adaptive_clip: clip each update's norm per coordinate "
                                                  "held to this multiple of the round's median", low=0,
                                                  low_open=True)}

    def bound(self, size: int, rms: list[float]) -> float:
        return self.args["factor"] * low_median(rms) * math.sqrt(size)


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
    privately = Screened   # under dp: the per-update checks, then the mean (fedlase/robust.py, ServerStep.of)
    dp_safe = True


@register_rule
class Median(Screened):
    """The coordinate-wise median over the clients credited with each coordinate."""
    name = "median"
    weighted = False
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
