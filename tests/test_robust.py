"""Robust aggregation (fedlase/robust.py): the default rule (bounded) against one faulty client in ten, where
the old default (screen) fails, each rule on hand-made updates over partially covering clients, simulated
attacks, and bad values that must not crash."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fedlase.aggregate import Aggregator
from fedlase.config import load_config
from fedlase.engine import Experiment, Update, run_experiment
from fedlase.errors import ConfigError
from fedlase.masks import Submodel
from fedlase.methods.fedlase import water_fill
from fedlase.robust import Robust, attackers, screen
from fedlase.robust_config import check_attack

# The run: ten clients, the one of level 1/4 faulty; one local step, so that it takes seconds.
DIGITS = ["dataset=digits", "model=cnn", "system={1,1/4}_{9,1}", "participation=1", "local_steps=1", "lr=0.1",
          "rounds=8", "eval_every=8", "threads=1", "device=cpu", "checkpoint_every=0"]
FAULTY = ["attack=scale", "attack_args.factor=1e30", "attack_args.level=1/4", "attack_args.fraction=1"]


def _run(tmp_path, name, *args):
    cfg = load_config(None, [*DIGITS, f"out={tmp_path / name}", *args])
    final = run_experiment(cfg, progress=False)["final"]
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return final, lines


@pytest.fixture(scope="module")
def honest(tmp_path_factory):
    """The honest run under the default rule (one per module: two tests compare with it)."""
    return _run(tmp_path_factory.mktemp("honest"), "honest", "method=fedlase")[0]


def test_one_client_scaled_by_1e30_is_rejected_and_without_the_screen_destroys_the_model(tmp_path, honest):
    screened, lines = _run(tmp_path, "screened", "method=fedlase", *FAULTY)
    assert honest["global_acc"] > 0.8
    assert abs(screened["global_acc"] - honest["global_acc"]) <= 0.02
    assert all(set(x["rejected"]) == {"9"} and "median" in x["rejected"]["9"] for x in lines), lines
    off, lines = _run(tmp_path, "off", "method=fedlase", "robust=none", *FAULTY)   # and FedLASE does not crash
    assert off["global_acc"] < 0.3 and all("rejected" not in x for x in lines)


def test_one_client_x50_leaves_the_default_within_2_points_and_breaks_the_old_screen_only_default(tmp_path, honest):
    """Issue 39: a client whose update is 50x too large (a wrong learning rate, no malice) passes a 100x screen
    and, averaged in, costs tens of points; the default (bounded: 3x screen, updates clipped to the median)
    holds the honest run within 2 points. Measured on these 8 rounds: 0 and -36 points (at 20 rounds, 0 and -29:
    docs/results.md, "A default rule that a faulty client cannot break")."""
    x50 = ["attack=scale", "attack_args.factor=50", "attack_args.level=1/4", "attack_args.fraction=1"]
    default, _ = _run(tmp_path, "default", "method=fedlase", *x50)
    assert abs(default["global_acc"] - honest["global_acc"]) <= 0.02
    old, _ = _run(tmp_path, "old", "method=fedlase", "robust=screen", *x50)
    assert old["global_acc"] < honest["global_acc"] - 0.02


def test_nan_updates_and_nan_losses_are_rejected_and_leave_the_honest_round(tmp_path):
    base = [*DIGITS, "rounds=1", "system={1,1/4}_{2,2}", f"out={tmp_path / 'r'}"]
    nan = Experiment(load_config(None, [*base, "attack=nan", "attack_args.clients=[1]"]))
    stats = nan.run_round(1)
    assert list(stats["rejected"]) == ["1"] and "non-finite value" in stats["rejected"]["1"] and stats["clients"] == 3
    honest = Experiment(load_config(None, base))
    sample = honest.sample
    honest.sample = lambda r: [(c, lv) for c, lv in sample(r) if c != 1]
    honest.run_round(1)
    assert all(torch.equal(nan.params[n], honest.params[n]) for n in honest.params)
    sub = Submodel()
    ups = [Update(0, None, {"w": torch.ones(2)}, float("nan"), sub), Update(1, None, {"w": torch.ones(2)}, 0.5, sub)]
    kept, rejected, _ = screen(ups, {}, {"w": torch.zeros(2)}, 100.0)
    assert [u.client for u in kept] == [1] and "non-finite loss" in rejected["0"]


# ---- the rules on hand-made updates -------------------------------------------------------------------------------
W = {"w": torch.zeros(4)}


def _up(client, values, held=None, loss=0.1):
    """An update of `values` on the coordinates `held` (a mask over W's 4; None: all)."""
    v = torch.tensor(values, dtype=torch.float32)
    sub = Submodel() if held is None else Submodel(masks={"w": torch.tensor(held)})
    return Update(client, None, {"w": v if held is None else v * sub.masks["w"]}, loss, sub)


def _agg(rule, updates, mode="coverage", **args):
    r = Robust(rule, args)
    kept, _, rms = r.screen(updates, {}, W)
    return r.aggregate(W, kept, {}, rms, mode, "mask", None)[0]["w"]


PARTIAL = [_up(0, [1, 1, 1, 1]), _up(1, [2, 2, 0, 0], [True, True, False, False]),
           _up(2, [3, 5, 0, 0], [True, True, False, False]), _up(3, [10, 0, 0, 0], [True, False, False, False]),
           _up(4, [-1, 4, 4, 0], [True, True, True, False])]


def test_median_over_the_clients_credited_with_each_coordinate():
    # coordinate 0: {1,2,3,10,-1} -> 2; 1: {1,2,5,4} -> (2+4)/2; 2: {1,4} -> 2.5; 3: {1} -> 1
    assert torch.equal(_agg("median", PARTIAL), torch.tensor([2, 3, 2.5, 1]))
    # mean mode: the coverage step times credited/|A|, as the plain mean's is
    assert torch.allclose(_agg("median", PARTIAL, "mean"), torch.tensor([2, 3 * 4 / 5, 2.5 * 2 / 5, 1 / 5]))


def test_trimmed_mean_cuts_floor_trim_times_count_from_each_end():
    # trim 0.25: coordinate 0 (5 values) cuts 1 each end -> mean(1,2,3); 1 (4 values) -> mean(2,4);
    # 2 and 3 (under 4 values) cut nothing -> their mean
    assert torch.allclose(_agg("trimmed_mean", PARTIAL, trim=0.25), torch.tensor([2, 3, 2.5, 1]))
    plain = Aggregator(W)
    for u in PARTIAL:
        plain.add(u.delta, u.sub)
    assert torch.allclose(_agg("trimmed_mean", PARTIAL, trim=0.0), plain.result()["w"])


def test_a_sliced_delta_counts_as_its_scattered_block():
    sub = Submodel(masks={"w": torch.tensor([True, True, False, False])}, slices={"w": (torch.tensor([0, 1]),)})
    small = [Update(0, None, {"w": torch.tensor([1.0, 2.0])}, 0.1, sub)]
    assert torch.equal(_agg("median", PARTIAL[:2] + small), _agg("median", PARTIAL[:2] + [_up(0, [1, 2, 0, 0],
                                                                                        [True, True, False, False])]))


def test_clipping_fixed_and_adaptive():
    ups = [_up(0, [3, 4, 0, 0]), _up(1, [0, 0, 0, 0.5]), _up(2, [0, 0, 0.5, 0])]
    # bound 1: the first (norm 5) becomes [0.6, 0.8, 0, 0]; the others are within it
    assert torch.allclose(_agg("clip", ups, bound=1.0), torch.tensor([0.2, 0.8 / 3, 0.5 / 3, 0.5 / 3]))
    # adaptive, factor 2: bound 2 x the median norm (0.5) = 1, the same here
    assert torch.allclose(_agg("adaptive_clip", ups, factor=2.0), _agg("clip", ups, bound=1.0))
    # bounded (the default) is adaptive_clip at factor 1 behind a 3x screen; the others keep the 100x screen
    assert Robust().name == "bounded" and Robust().args["screen"] == 3 and Robust("screen").args["screen"] == 100
    assert torch.equal(_agg("bounded", ups), _agg("adaptive_clip", ups, screen=3.0))
    ups.append(_up(3, [0, 0, 2, 0]))   # 4x the (lower) median norm per coordinate, 0.25; the first is 10x
    assert Robust("screen").screen(ups, {}, W)[1] == {} and sorted(Robust().screen(ups, {}, W)[1]) == ["0", "3"]


def test_multikrum_drops_the_update_far_from_the_others_on_shared_coordinates():
    ups = [_up(c, [1 + 0.1 * c, 1, 1, 1]) for c in range(4)] + [_up(4, [-9, 1, 0, 0], [True, True, False, False])]
    r = Robust("multikrum", {"faulty": 0.2})
    kept, _, rms = r.screen(ups, {}, W)
    new, info = r.aggregate(W, kept, {}, rms, "coverage", "mask", None)
    assert info == {"dropped": [4]} and torch.allclose(new["w"], torch.tensor([1.15, 1, 1, 1]))


def test_the_screen_rejects_an_absurd_norm_even_among_two_and_keeps_honest_spread():
    ups = [_up(0, [1, 1, 1, 1]), _up(1, [3e38, 3e38, 0, 0], [True, True, False, False])]
    kept, rejected, _ = screen(ups, {}, W, 100.0)
    assert [u.client for u in kept] == [0] and list(rejected) == ["1"]
    ups = [_up(0, [1, 1, 1, 1]), _up(1, [50, 0, 0, 0], [True, False, False, False]), _up(2, [0.1, 0.1, 0.1, 0.1])]
    assert screen(ups, {}, W, 100.0)[1] == {}   # 50x the median per coordinate: honest enough


# ---- attacks, options and bad values ----------------------------------------------------------------------------
def test_attackers_are_drawn_from_the_seed_per_level_and_the_noise_is_seeded(tmp_path):
    cfg = load_config(None, [*DIGITS, "system={1,1/4}_{10,30}", f"out={tmp_path / 'a'}", "attack=gaussian",
                             "attack_args.level=1/4", "attack_args.fraction=0.1"])
    args = check_attack(cfg.attack, cfg.attack_args, cfg.levels)
    bad = attackers(cfg.attack, args, cfg.levels, cfg.seed)
    assert len(bad) == 3 and all(c >= 10 for c in bad) and bad == attackers(cfg.attack, args, cfg.levels, 0)
    assert bad != attackers(cfg.attack, args, cfg.levels, 1)
    exp = Experiment(cfg)
    u = Update(min(bad), cfg.levels.levels[1], {n: torch.zeros_like(p) for n, p in exp.params.items()}, 0.1)
    sub = exp.method.submodel(exp.params, u.level, 1)
    a, b = exp._attacked(u, {u.level: sub}, 1), exp._attacked(u, {u.level: sub}, 1)
    n = next(iter(sub.masks))
    assert torch.equal(a.delta[n], b.delta[n]) and bool((a.delta[n][~sub.masks[n]] == 0).all())
    assert float(a.delta[n].std()) > 0


@pytest.mark.parametrize("args, key", [(["robust=median", "robust_args.trim=0.2"], "robust_args.trim"),
                                       (["robust=clip", "robust_args.bound=0"], "robust_args.bound"),
                                       (["robust_args.screen=0.5"], "robust_args.screen"),
                                       (["robust_args.trim=0.2"], "robust_args.trim"),   # not the default's
                                       (["attack=scale", "attack_args.clients=[10]"], "attack_args.clients"),
                                       (["attack=scale", "attack_args.level=1/2"], "attack_args.level"),
                                       (["attack=nan", "attack_args.std=1"], "attack_args.std"),
                                       (["attack=sideways"], "attack")])
def test_bad_robust_and_attack_options_name_their_key(tmp_path, args, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DIGITS, f"out={tmp_path / 'x'}", *args])
    assert e.value.key == key


def test_fedlase_allocation_copes_with_non_finite_scores():
    k = water_fill([math.nan, 1.0, math.inf], [10, 20, 30], 30)
    assert sum(k) == 30 and k == [5, 10, 15]
