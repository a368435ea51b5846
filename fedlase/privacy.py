"""Client-level differential privacy (DP-FedAvg) for submodels: a stage of the server step (fedlase/server_step.py,
`Stage`) and its accountant. docs/methods.md, "Differential privacy", derives what is computed here.

Per round t, with m_t clients sampled (a fixed-size sample without replacement, fedlase/sampling.py):
1. each accepted update is clipped, at the global shapes, to the L2 bound C_t (a non-finite one counts as zero);
2. the rule (none, screen or clip) averages them per coordinate; its realised denominator (the clients credited
   with a coordinate, or |A|) is replaced by the public one, D_j = m_t x sum over levels of (the level's share of
   the population) x (its credit on coordinate j): the expected number of sampled clients credited with j;
3. Gaussian noise of standard deviation z C_t on the sum, that is z C_t / D_j on coordinate j of the new model.
With `adaptive`, C follows a quantile of the update norms (Andrew et al. 2021) from a noisy count of the
unclipped updates; the sum's noise multiplier is then (z^-2 - (2 sigma_b)^-2)^(-1/2) so that the two together
spend what z alone would (the accountant composes both). The noise is drawn from (run seed, round), so a resumed
run equals an uninterrupted one.

Accounting: Google's dp_accounting, RDP accountant, `SampledWithoutReplacementDpEvent` (what fedlase's sampling
is) under the REPLACE_ONE neighbouring relation it requires: replacing one client's data moves the clipped sum by
up to 2C, so the Gaussian event's multiplier is z/2 (the count: sensitivity 1, multiplier sigma_b)."""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from .aggregate import Aggregator
from .sampling import Stream, derive_seed, sample_clients
from .server_step import Stage

log = logging.getLogger("fedlase")


def l2(delta: dict) -> float:
    """The L2 norm of a delta, summed in float64 (a gathered slice's equals its scattered one's)."""
    ss = sum(float(d.double().square().sum()) for d in delta.values())
    return math.sqrt(ss) if math.isfinite(ss) else math.nan


ROUNDING = 1e-6   # a delta clipped in float32 has norm bound x (1 +- ~1e-7): clipping it again changes nothing


def clip(delta: dict, bound: float) -> tuple[dict, float]:
    """(the delta scaled to L2 norm at most `bound`, its norm before); a non-finite delta becomes zeros (it
    then adds nothing, which is within the bound). A delta within float rounding of the bound (one a Flower node
    clipped already) is left as it is, so the server's second clip gives the embedded engine's very values."""
    norm = l2(delta)
    if not math.isfinite(norm):
        return {n: torch.zeros_like(d) for n, d in delta.items()}, norm
    if norm <= bound * (1 + ROUNDING):
        return delta, norm
    return {n: d * (bound / norm) for n, d in delta.items()}, norm


# ---- accounting ----------------------------------------------------------------------------------------------
def sum_multiplier(z: float, count_noise: float | None) -> float:
    """The noise multiplier on the sum: z, or under adaptive clipping what is left of z once the count's noise
    sigma_b took its share (Andrew et al. 2021, Theorem 1: z_sum^-2 + (2 sigma_b)^-2 = z^-2)."""
    if count_noise is None or z == 0:
        return z
    return (z ** -2 - (2 * count_noise) ** -2) ** -0.5


def round_event(population: int, sampled: int, z: float, count_noise: float | None = None):
    """One round's DpEvent: m of N clients sampled without replacement, then the Gaussian sum (replace-one
    sensitivity 2C, noise z_sum C: multiplier z_sum / 2) and, with adaptive clipping, the Gaussian count
    (sensitivity 1, noise sigma_b)."""
    import dp_accounting as dpa
    if z == 0:
        return dpa.NonPrivateDpEvent()
    parts = [dpa.GaussianDpEvent(sum_multiplier(z, count_noise) / 2)]
    if count_noise is not None:
        parts.append(dpa.GaussianDpEvent(count_noise))
    inner = parts[0] if len(parts) == 1 else dpa.ComposedDpEvent(parts)
    return dpa.SampledWithoutReplacementDpEvent(population, sampled, inner)


def fresh_accountant():
    import dp_accounting as dpa
    from dp_accounting import rdp
    return rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)


_ROUND_RDP: dict[tuple, tuple] = {}   # (N, m, z, sigma_b) -> (orders, one round's RDP): same in every run


class Accountant:
    """Epsilon at `delta` after a run's first t rounds, round t sampling `sizes(t)` of `population` clients.
    Each distinct sample size's RDP is computed once by dp_accounting (about 0.4 s: the without-replacement bound
    is summed per order); t rounds add their RDP, converted to epsilon by the library."""

    def __init__(self, population: int, sizes: Callable[[int], int], z: float, count_noise: float | None,
                 delta: float):
        self.population, self.sizes, self.z, self.count_noise, self.delta = population, sizes, z, count_noise, delta
        self.total = [None]   # cumulative RDP after round t, t = 0.. (index 0: nothing spent)

    def per_round(self, sampled: int):
        key = (self.population, sampled, self.z, self.count_noise)
        if key not in _ROUND_RDP:
            acc = fresh_accountant()
            acc.compose(round_event(self.population, sampled, self.z, self.count_noise))
            _ROUND_RDP[key] = acc.orders, acc.rdp
        return _ROUND_RDP[key]

    def epsilon(self, rounds: int) -> float:
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
        if rounds == 0:
            return 0.0
        while len(self.total) <= rounds:
            self.orders, r = self.per_round(self.sizes(len(self.total)))
            self.total.append(r if self.total[-1] is None else self.total[-1] + r)
        return float(compute_epsilon(self.orders, self.total[rounds], self.delta)[0])


def calibrate(population: int, sizes: list[int], target: float, delta: float, count_noise: float | None) -> float:
    """The smallest noise multiplier z whose epsilon after the rounds of `sizes` (round t samples sizes[t-1]) is
    at most `target`, by dp_accounting's calibration over whole events."""
    import dp_accounting as dpa
    groups = {m: sizes.count(m) for m in sorted(set(sizes))}

    def event(z):
        return dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(round_event(population, m, z, count_noise), k)
                                    for m, k in groups.items()])
    # under adaptive clipping z must stay below 2 sigma_b (sum_multiplier)
    bracket = dpa.ExplicitBracketInterval(1e-3, 2 * count_noise * (1 - 1e-9)) if count_noise else None
    return float(dpa.calibrate_dp_mechanism(fresh_accountant, event, target, delta, bracket, tol=1e-3))


# ---- the stage --------------------------------------------------------------------------------------------------
class Privacy(Stage):
    """The server step's DP stage (module docstring). `submodel(params, level, rnd)`: a level's submodel of the
    round (for the levels nobody sampled: the denominator counts every level)."""
    screen_by_others = False   # the screen keeps only its per-update checks (fedlase/server_step.py, ServerStep.screen)

    def __init__(self, args: dict, seed: int, plan, rounds: int, mode: str, coverage: str, owners,
                 submodel: Callable):
        self.args, self.seed, self.plan, self.mode, self.owners = args, seed, plan, mode, owners
        self.sizes: dict[int, int] = {}
        self.coverage, self.submodel = coverage, submodel
        system = plan.system
        self.shares = [(lv, lv.count / system.num_clients) for lv in system.levels]
        count_noise = args["count_noise"] if args["adaptive"] else None
        z = args["noise_multiplier"]
        if z is None:
            log.info("dp: finding the noise multiplier for epsilon %g (dp_accounting's calibration: seconds to a "
                     "minute)", args["target_epsilon"])
            z = calibrate(system.num_clients, [self.sampled(t) for t in range(1, rounds + 1)],
                          args["target_epsilon"], args["delta"], count_noise)
            log.info("dp: noise_multiplier %.4g gives epsilon %g at delta %g after %d rounds", z,
                     args["target_epsilon"], args["delta"], rounds)
        self.z, self.count_noise, self.z_sum = z, count_noise, sum_multiplier(z, count_noise)
        self.accountant = Accountant(system.num_clients, self.sampled, z, count_noise, args["delta"])
        self.bound = args["clip"]    # C_t: moves under adaptive clipping (checkpointed)
        self.round: dict = {}        # this round's figures, from `updates` to `model` and the metrics line

    def sampled(self, rnd: int) -> int:
        """m_t: how many clients round `rnd` samples (public: drawn from the run's seed, not from data)."""
        if rnd not in self.sizes:
            self.sizes[rnd] = len(sample_clients(self.plan, rnd))
        return self.sizes[rnd]

    def denominators(self, params: dict, subs: dict, rnd: int) -> dict[str, torch.Tensor]:
        """D_j per parameter: the expected number of the round's sampled clients credited with coordinate j,
        from each level's credit (its mask, or `kept` credit) and share of the population. Under `mean` mode
        m_t wherever some level is credited (the |A| it replaces), 0 where none is."""
        credit = Aggregator(params, "coverage", "kept" if self.coverage == "kept" else "mask", self.owners)
        zeros = {n: torch.zeros_like(p) for n, p in params.items()}
        out = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        for lv, share in self.shares:
            sub = subs.get(lv) or self.submodel(params, lv, rnd)
            for n, _, _, c in credit.terms(zeros, sub):
                out[n] += share * (c.double() if isinstance(c, torch.Tensor) else float(c))
        m = self.sampled(rnd)
        if self.mode == "mean":
            return {n: (d > 0).double() * m for n, d in out.items()}
        return {n: d * m for n, d in out.items()}

    def updates(self, updates, subs, params, rnd):
        bound, clipped, out, under = self.bound, 0, [], 0
        for u in updates:
            delta, norm = clip(u.delta, bound)
            clipped += not norm <= bound * (1 + ROUNDING)
            under += norm <= bound
            out.append(dataclasses.replace(u, delta=delta))
        # what the rule will divide by (its realised credit, or |A|), to be replaced by the public denominator
        counts = {n: torch.full_like(p, max(len(out), 1)) for n, p in params.items()}
        if self.mode == "coverage":
            agg = Aggregator(params, self.mode, self.coverage, self.owners)
            counts = {n: torch.zeros_like(p) for n, p in params.items()}
            for u in out:
                for n, block, _, c in agg.terms(u.delta, u.sub or subs[u.level]):
                    if block is None:
                        counts[n] += c
                    else:
                        counts[n][block] += c
        denom = self.denominators(params, subs, rnd)
        scale = {n: torch.where(denom[n] > 0, counts[n].clamp(min=1).double() / denom[n].clamp(min=1e-12), 0.0)
                 for n in params}
        self.round = {"clip": bound, "clipped": clipped, "scale": scale, "denom": denom}
        if self.args["adaptive"]:   # Andrew et al. 2021: C <- C exp(-eta (noisy fraction unclipped - gamma))
            g = torch.Generator().manual_seed(derive_seed(self.seed, rnd, Stream.PRIVACY, 1))
            noisy = (under + float(torch.randn((), generator=g, dtype=torch.float64)) * self.count_noise)
            frac = noisy / self.sampled(rnd)
            self.bound = bound * math.exp(-self.args["clip_lr"] * (frac - self.args["target_quantile"]))
        return out

    def model(self, old, new, rnd):
        r = self.round
        g = torch.Generator().manual_seed(derive_seed(self.seed, rnd, Stream.PRIVACY, 0))
        sd = self.z_sum * r["clip"]
        out = {}
        for n, p in new.items():   # in the model's parameter order: the draws are the same on every engine
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * sd
            d = r["denom"][n].cpu()
            step = (p - old[n]).double().cpu() * r["scale"][n].cpu() + torch.where(d > 0, noise / d.clamp(min=1e-12),
                                                                                    0.0)
            out[n] = old[n] + step.to(p.device, p.dtype)
        return out

    def info(self, rnd: int) -> dict:
        eps = self.accountant.epsilon(rnd)
        line = {"delta": self.args["delta"], "noise_multiplier": self.z, "clip": self.round.get("clip", self.bound)}
        if "clipped" in self.round:
            line["clipped"] = self.round["clipped"]
        self.round = {}
        return {"epsilon": eps, "dp": line}

    def halt(self, rnd: int) -> str | None:
        top = self.args["max_epsilon"]
        if top is None:
            return None
        eps = self.accountant.epsilon(rnd)
        if eps <= top:
            return None
        return (f"dp.max_epsilon={top:g}: round {rnd} would take epsilon to {eps:.4g} at delta "
                f"{self.args['delta']:g}; the run stops after round {rnd - 1}")

    def state_dict(self) -> dict:
        return {"clip": self.bound, "noise_multiplier": self.z}

    def load_state_dict(self, state: dict) -> None:
        self.bound = state.get("clip", self.bound)
        z = state.get("noise_multiplier", self.z)
        if z != self.z:   # target_epsilon calibrated for another `rounds`: the run goes on with its own z
            self.z, self.z_sum = z, sum_multiplier(z, self.count_noise)
            self.accountant = Accountant(self.plan.system.num_clients, self.sampled, z, self.count_noise,
                                         self.args["delta"])


def client_bound(server) -> float | None:
    """The clip bound a round's clients must meet (a Flower node clips to it before it replies), or None."""
    for stage in server.stages:
        if isinstance(stage, Privacy):
            return stage.bound
    return None


def stages_for(cfg, method, plan, mode: str, coverage: str, owners, device) -> tuple[Stage, ...]:
    """The server step's stages a config asks for: the DP stage under `dp`, else none."""
    if not cfg.dp:
        return ()
    return (Privacy(cfg.dp, cfg.seed, plan, cfg.rounds, mode, coverage, owners,
                    lambda params, lv, rnd: method.submodel(params, lv, rnd).to(device)),)
