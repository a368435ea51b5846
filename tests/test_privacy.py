"""Client-level differential privacy (fedlase/privacy.py; docs/methods.md, "Differential privacy"): the noise per
coordinate against the derivation, the public denominator, the accountant against dp_accounting used as its
documentation shows, the budget stop, a resumed run, and what DP composes with or refuses."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import TINY
from fedlase.config import load_config
from fedlase.engine import Experiment, Update, run_experiment
from fedlase.errors import ConfigError
from fedlase.robust_config import default_delta

pytestmark = pytest.mark.numerics

DP = ["dp.clip=0.5", "dp.noise_multiplier=2"]


def library_epsilon(population: int, sampled: int, z: float, rounds: int, delta: float) -> float:
    """epsilon as dp_accounting's documentation composes it: an RDP accountant, the event self-composed over the
    rounds, get_epsilon(delta). Replace-one neighbours (what a fixed-size sample needs): sensitivity 2C, so the
    Gaussian's multiplier is z / 2."""
    import dp_accounting
    from dp_accounting import rdp
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(population, sampled,
                                                           dp_accounting.GaussianDpEvent(z / 2))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return acc.get_epsilon(delta)


def expected_denominators(exp, subs, rnd) -> dict[str, torch.Tensor]:
    """D_j = m x sum over levels of (its share of the clients) x (its mask holds j), written out here."""
    system, m = exp.sampling.system, len(exp.sample(rnd))
    out = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in exp.params.items()}
    for lv in system.levels:
        sub = subs.get(lv) or exp.method.submodel(exp.params, lv, rnd)
        for n in out:
            held = sub.masks[n].double() if n in sub.masks else torch.ones_like(out[n])
            out[n] += m * lv.count / system.num_clients * held
    return out


def test_the_noise_per_coordinate_is_z_c_over_the_public_denominator(tiny_cfg):
    """Zero updates through the stage: what moves the model is the noise alone, z C / D_j on coordinate j, with
    D_j the expected number of sampled clients holding j (HeteroFL's nested slices: two values of D)."""
    exp = Experiment.from_config(tiny_cfg("method=heterofl", "coverage=mask", *DP))
    stage, rnd = exp.server.stages[0], 1
    picked = exp.sample(rnd)
    subs = exp.submodels([lv for _, lv in picked], rnd)
    zeros = [Update(c, lv, {n: torch.zeros_like(p) for n, p in exp.params.items()}, 0.0) for c, lv in picked]
    stage.updates(zeros, subs, exp.params, rnd)
    new = stage.model(exp.params, {n: p.clone() for n, p in exp.params.items()}, rnd)
    want = expected_denominators(exp, subs, rnd)
    assert all(torch.equal(stage.round["denom"][n], want[n]) for n in want)
    values = torch.cat([d.flatten() for d in want.values()])
    steps = torch.cat([(new[n] - exp.params[n]).double().flatten() for n in want])
    groups = sorted(set(values.tolist()) - {0.0})
    assert len(groups) == 2   # coordinates of both levels, and of the full level only
    for d in groups:
        s = steps[values == d]
        sd = 2 * 0.5 / d   # z C / D
        assert len(s) > 1000
        # a normal sample's standard deviation is within 4 standard errors (sd / sqrt(2n)) of the truth
        assert abs(s.std().item() - sd) < 4 * sd / math.sqrt(2 * len(s)), (d, s.std().item(), sd)
        assert abs(s.mean().item()) < 4 * sd / math.sqrt(len(s))
    assert torch.all(steps[values == 0] == 0)   # a coordinate no level holds gets nothing, noise included


@pytest.mark.parametrize("rule,bound", [(["robust=screen"], 0.05), (["robust=clip", "robust_args.bound=0.02"], 0.02),
                                        (["method_args.overlap=false"], 0.05),
                                        ([], 0.05)])   # the default, bounded: its median clip gives way to dp's
def test_without_noise_the_step_is_the_clipped_sum_over_the_public_denominator(tiny_cfg, rule, bound):
    """z = 0: the new model is the old one plus the sum of the clipped updates over D_j, whatever the realised
    count (one round of real training, computed again here). robust=clip composes: a smaller bound of its own
    clips the clipped updates again; the default rule (bounded) is then the plain mean. Under the `mean` mode
    (overlap=false) D_j is m wherever a level holds j."""
    exp = Experiment.from_config(tiny_cfg("method=fiarse", "coverage=mask", "dp.clip=0.05", "dp.noise_multiplier=0",
                                          *rule))
    old = {n: p.clone() for n, p in exp.params.items()}
    picked = exp.sample(1)
    subs = exp.submodels([lv for _, lv in picked], 1)
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in old.items()}
    for c, lv in picked:
        delta, _ = exp.trainer.update(c, old, exp.buffers, subs[lv], 1)
        norm = math.sqrt(sum(float(d.double().square().sum()) for d in delta.values()))
        assert norm > 0.05   # every update is clipped at this bound
        for n, d in delta.items():
            total[n] += (d * (bound / norm)).double()
    stats = exp.run_round(1)
    assert stats["dp"]["clipped"] == len(picked) and stats["epsilon"] == math.inf
    want = expected_denominators(exp, subs, 1)
    if exp.method.aggregation == "mean":
        want = {n: (d > 0).double() * len(picked) for n, d in want.items()}
    for n, p in exp.params.items():
        step = torch.where(want[n] > 0, total[n] / want[n].clamp(min=1e-12), 0.0)
        assert torch.allclose((p - old[n]).double(), step, atol=1e-7), n


def test_epsilon_in_every_line_matches_the_library_and_max_epsilon_stops_the_run(tiny_cfg, tmp_path):
    """The metrics' epsilon equals dp_accounting's as documented (fixed-size sample without replacement), and
    max_epsilon between round 2's and round 3's stops the run after round 2, with that model evaluated."""
    n, m, z, delta = 4, 2, 2.0, 1e-5
    eps = [library_epsilon(n, m, z, t, delta) for t in (1, 2, 3)]
    cap = (eps[1] + eps[2]) / 2
    summary = run_experiment(tiny_cfg(*DP, "rounds=5", f"dp.max_epsilon={cap}"), progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    assert [x["epsilon"] for x in lines] == pytest.approx(eps[:2], rel=1e-9)
    assert lines[0]["dp"]["delta"] == delta   # the default delta: min(1e-5, n^-1.1), well below 1/n
    assert summary["rounds"] == 2 and "max_epsilon" in summary["stopped"] and summary["final"]["round"] == 2
    # resumed with more rounds, it stops at once again
    again = run_experiment(tiny_cfg(*DP, "rounds=6", f"dp.max_epsilon={cap}"), resume=True, progress=False)
    assert again["rounds"] == 2


def test_adaptive_clipping_spends_what_z_alone_would(tiny_cfg):
    """The sum's and the count's noise together (composed by the accountant) cost the epsilon of z alone."""
    fixed = Experiment.from_config(tiny_cfg(*DP)).server.stages[0]
    adaptive = Experiment.from_config(tiny_cfg(*DP, "dp.adaptive=true", "dp.count_noise=5")).server.stages[0]
    assert adaptive.z_sum > 2 and fixed.z_sum == 2
    assert adaptive.accountant.epsilon(3) == pytest.approx(fixed.accountant.epsilon(3), rel=1e-6)


def test_a_resumed_dp_run_is_bit_identical(tiny_cfg, tmp_path):
    """Noise drawn per round from the run's seed, the adaptive bound checkpointed: stopped after round 1 and
    resumed, a run ends with the uninterrupted run's model, bounds and epsilons."""
    args = [*DP, "dp.adaptive=true", "dp.count_noise=5"]
    run_experiment(tiny_cfg(*args, "rounds=3", out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg(*args, "rounds=1", out=str(tmp_path / "part")), progress=False)
    run_experiment(tiny_cfg(*args, "rounds=3", out=str(tmp_path / "part")), resume=True, progress=False)
    ckpt = {k: torch.load(tmp_path / k / "checkpoint.pt", weights_only=True) for k in ("whole", "part")}
    a, b = ckpt["whole"], ckpt["part"]
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert a["server"] == b["server"] and a["server"]["stages"][0]["clip"] != 0.5   # the bound moved
    lines = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
             for k in ("whole", "part")}
    assert [(x["epsilon"], x["dp"]["clip"]) for x in lines["whole"]] == \
        [(x["epsilon"], x["dp"]["clip"]) for x in lines["part"]]


def _round_seen_by_dp(cfg) -> tuple[dict, list]:
    """(round 1's metrics fields, the updates dp's stage received: after the attack, before its clip)."""
    exp = Experiment.from_config(cfg)
    stage, seen = exp.server.stages[0], []
    clip = stage.updates
    stage.updates = lambda updates, *rest: seen.extend(updates) or clip(updates, *rest)
    stats = exp.run_round(1)
    assert all(bool(torch.isfinite(p).all()) for p in exp.params.values())
    return stats, seen


def test_attacks_apply_and_dp_clips_them(tiny_cfg):
    """A scaled attacker reaches dp's stage scaled and is clipped, not rejected (the screen keeps only its
    per-update checks under dp); a NaN attacker under robust=none reaches it as NaN and adds nothing (a
    non-finite update counts as clipped, to zero); the model stays finite."""
    _, honest = _round_seen_by_dp(tiny_cfg(*DP))
    for attack in (["attack=scale", "attack_args.factor=1e6"], ["attack=nan", "robust=none"]):
        stats, seen = _round_seen_by_dp(tiny_cfg(*DP, *attack, "attack_args.clients=[0,1,2,3]"))
        assert stats["clients"] == len(seen) == len(honest) and "rejected" not in stats, stats
        assert stats["dp"]["clipped"] == len(seen)   # every attacker was clipped
        for u, h in zip(seen, honest):   # the attack ran: what the server received is the corrupted delta
            assert u.client == h.client and any(d.any() for d in h.delta.values())
            for n, d in u.delta.items():
                assert torch.equal(d, h.delta[n] * 1e6) if attack[0] == "attack=scale" else bool(d.isnan().all())


REFUSED = [(["robust=median"], "robust"), (["robust=trimmed_mean"], "robust"), (["robust=multikrum"], "robust"),
           (["robust=adaptive_clip"], "robust"), (["method=feddse"], "method"), (["label_split=true"], "label_split"),
           (["dp.adaptive=true", "engine=flower-sim"], "dp.adaptive"), (["schedule=fedbuff"], "schedule"),
           (["schedule=fedasync"], "schedule"), (["bn=static"], "bn"), (["eval_finetune=1"], "eval_finetune")]


@pytest.mark.parametrize("extra,key", REFUSED, ids=[r[0][0] for r in REFUSED])
def test_what_dp_does_not_cover_is_refused_in_one_line(tmp_path, extra, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINY, f"out={tmp_path}", *DP, *extra])
    assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)


def test_a_rule_says_itself_whether_dp_may_run_with_it():
    """`dp_safe` is declared by each rule and never inherited: a rule built on `screen` that aggregates otherwise
    is refused under dp until it says it is safe."""
    from fedlase.registry import RULES
    from fedlase.rules import Screened
    assert {n for n, r in RULES.items() if r.dp_safe} >= {"none", "screen", "clip", "bounded"}
    assert not any(RULES.get(n).dp_safe for n in ("median", "trimmed_mean", "multikrum", "adaptive_clip"))

    class Mine(Screened):
        name = "mine"

    class Safe(Screened):
        name = "safe"
        dp_safe = True

    assert Screened.dp_safe and not Mine.dp_safe and Safe.dp_safe


def test_the_default_delta_is_well_below_one_over_the_clients():
    assert default_delta(4) == 1e-5 and default_delta(10**5) == pytest.approx(10**-5.5)
    assert all(default_delta(n) <= n ** -1.1 for n in (2, 100, 10**4, 10**6))


def test_clip_alone_and_both_noise_settings_are_refused(tmp_path):
    for extra, key in ((["dp.clip=1"], "dp.noise_multiplier"), (["dp.noise_multiplier=1"], "dp.clip"),
                       ([*DP, "dp.target_epsilon=3"], "dp.noise_multiplier")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*TINY, f"out={tmp_path}", *extra])
