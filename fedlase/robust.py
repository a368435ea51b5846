"""Robust aggregation of submodel updates, and simulated faulty or malicious clients.

The server step of every engine (fedlase/engine.py: `Experiment.run_round`, after the round runner returns):

1. `attack` (simulation only): the chosen clients' deltas are corrupted as the server receives them.
2. The screen (every `robust` rule but `none`): an update is rejected, with its reason, when a value of its delta
   or its loss is not finite, or when its norm per coordinate held exceeds `robust_args.screen` times the
   round's median of that figure (docs/methods.md, "Robust aggregation", says why this rule and this bound).
3. The rule (`robust`) turns the accepted updates into the new global model, per coordinate, under the run's
   `coverage` and aggregation mode (fedlase/aggregate.py):
   bounded (the default): adaptive_clip behind a screen at 3x the median instead of 100x;
   screen: the streaming mean (the default before issue 39; what fedlase always computed, once the screen passed);
   clip / adaptive_clip: each update clipped to a norm bound first, then the streaming mean;
   trimmed_mean / median: coordinate-wise, over the clients credited with each coordinate;
   multikrum: the streaming mean of the updates closest to their neighbours on shared coordinates.

Everything here is deterministic: a client's attack noise is seeded from (run seed, round, client) and the
attacked set from the run seed, so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from .aggregate import Aggregator, aggregate
from .robust_config import check_robust

log = logging.getLogger("fedlase")

ATTACK_STREAM = 4   # the seed stream of attack draws, after sampling (0-2) and the methods' (3)


def attackers(kind: str, args: dict, system, seed: int) -> frozenset[int]:
    """The attacking clients: the named ones, or round(fraction x pool) (at least one) drawn from the run seed
    among all clients or those of `level` (by client index, as `system` assigns them under fixed assignment)."""
    if kind == "none":
        return frozenset()
    if args["clients"] is not None:
        return frozenset(args["clients"])
    pool = list(range(system.num_clients))
    if args["level"] is not None:
        index = system.find(args["level"]).index
        pool = [c for c in pool if system.client_level[c] == index]
    from .sampling import derive_seed
    rng = np.random.default_rng(derive_seed(seed, 0, ATTACK_STREAM))
    k = max(1, round(args["fraction"] * len(pool)))
    return frozenset(int(c) for c in rng.choice(pool, size=k, replace=False))


def corrupt(kind: str, args: dict, delta: dict, sub, full_shapes: dict, seed: int, rnd: int, client: int) -> dict:
    """One attacking client's delta as the server receives it. Gaussian noise goes only where the client holds
    coordinates (its mask; on a gathered slice, the slice's inner mask), so it stays a well-formed reply."""
    if kind in ("scale", "sign_flip"):
        f = args["factor"] if kind == "scale" else -args["factor"]
        return {n: d * f for n, d in delta.items()}
    if kind == "nan":
        return {n: torch.full_like(d, float("nan")) for n, d in delta.items()}
    from .sampling import derive_seed
    g = torch.Generator().manual_seed(derive_seed(seed, rnd, ATTACK_STREAM, client))
    out = {}
    for n, d in delta.items():
        small = d.shape != full_shapes[n]
        mask = (sub.inner() if small else sub).masks.get(n)
        noise = torch.randn(d.shape, generator=g).to(d.device, d.dtype) * args["std"]
        out[n] = d + (noise * mask if mask is not None else noise)
    return out


# ---- the screen ------------------------------------------------------------------------------------------------
def held(delta: dict, sub, full: dict) -> int:
    """Coordinates a client holds: its mask's count per masked parameter, the whole size of the others."""
    return sum(int(sub.masks[n].sum()) if n in sub.masks else full[n].numel() for n in delta)


def norms(updates: list, subs: dict, full: dict) -> tuple[list[float], list[float]]:
    """Each update's L2 norm and norm per coordinate held (norm / sqrt(held)), summed in float64 so that a
    float32 delta of 3e38 gives a finite figure; a NaN or Inf anywhere makes both non-finite."""
    sizes: dict[int, int] = {}
    l2, rms = [], []
    for u in updates:
        sub = u.sub or subs[u.level]
        if id(sub) not in sizes:
            sizes[id(sub)] = max(held(u.delta, sub, full), 1)
        ss = sum(float(d.double().square().sum()) for d in u.delta.values())
        l2.append(math.sqrt(ss) if math.isfinite(ss) else math.inf if ss == math.inf else math.nan)
        rms.append(l2[-1] / math.sqrt(sizes[id(sub)]))
    return l2, rms


def low_median(values: list[float]) -> float:
    """The lower median (of two middle values, the smaller): with two updates, one absurd, the honest one."""
    s = sorted(values)
    return s[(len(s) - 1) // 2] if s else math.nan


def screen(updates: list, subs: dict, full: dict, factor: float | None) -> tuple[list, dict, list[float]]:
    """(accepted updates, {client id as str: reason} of the rejected, the accepted updates' norms per coordinate).
    factor None: no screen at all (robust=none)."""
    l2, rms = norms(updates, subs, full)
    if factor is None:
        return list(updates), {}, rms
    rejected, keep = {}, []
    for i, u in enumerate(updates):
        if not math.isfinite(u.loss):
            rejected[str(u.client)] = f"non-finite loss ({u.loss})"
        elif not math.isfinite(rms[i]):
            rejected[str(u.client)] = "non-finite value in its update"
        else:
            keep.append(i)
    ref = low_median([rms[i] for i in keep])
    accepted = []
    for i in keep:
        if ref > 0 and rms[i] > factor * ref:
            rejected[str(updates[i].client)] = (f"update norm per coordinate {rms[i]:.3g} is {rms[i] / ref:.3g}x "
                                                f"the round's median {ref:.3g} (limit {factor:g}x)")
        else:
            accepted.append(i)
    for c, why in rejected.items():
        log.warning("rejected client %s's update: %s", c, why)
    return [updates[i] for i in accepted], rejected, [rms[i] for i in accepted]


# ---- the rules ---------------------------------------------------------------------------------------------------
@dataclass
class Robust:
    """The run's server rule: `robust` and its checked `robust_args`; `aggregate` is the engine's server step."""
    rule: str = "bounded"
    args: dict | None = None

    def __post_init__(self):
        self.args = check_robust(self.rule, self.args or {})

    def screen(self, updates, subs, params):
        return screen(updates, subs, params, None if self.rule == "none" else self.args["screen"])

    def aggregate(self, params: dict, updates: list, subs: dict, rms: list[float], mode: str, coverage: str,
                  owners) -> tuple[dict, dict]:
        """(new global params, what the rule did for the metrics line) from the screened updates. Every rule but
        the coordinate-wise ones ends in the streaming mean (fedlase.aggregate.aggregate) of the pairs it keeps."""
        pairs = [(u.delta, u.sub or subs[u.level]) for u in updates]
        info: dict = {}
        if self.rule in ("clip", "adaptive_clip", "bounded"):
            ref = low_median(rms)
            clipped, kept = 0, []
            for (delta, sub), r in zip(pairs, rms):
                size = held(delta, sub, params)
                bound = self.args["bound"] if self.rule == "clip" else self.args["factor"] * ref * math.sqrt(size)
                norm = r * math.sqrt(size)
                if norm > bound:
                    delta = {n: d * (bound / norm) for n, d in delta.items()}
                    clipped += 1
                kept.append((delta, sub))
            pairs, info = kept, {"clipped": clipped}
        elif self.rule in ("trimmed_mean", "median"):
            agg = Aggregator(params, mode, coverage, owners)
            return coordinatewise(agg, pairs, self.rule, self.args["trim"]), info
        elif self.rule == "multikrum":
            chosen = multikrum(Aggregator(params, mode, coverage, owners), pairs, self.args["faulty"])
            info["dropped"] = sorted(updates[i].client for i in range(len(pairs)) if i not in chosen)
            pairs = [pairs[i] for i in sorted(chosen)]
        return aggregate(params, pairs, mode, coverage, owners), info


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
