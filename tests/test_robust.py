"""Robust aggregation (fedlase/server_step.py): the default rule (bounded) against one faulty client in ten, where
the old default (screen) fails, each rule on hand-made updates over partially covering clients, simulated
attacks, and bad values that must not crash."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from conftest import host_reads
from fedlase.aggregate import Aggregator
from fedlase.config import load_config
from fedlase.engine import Experiment, Update, run_experiment
from fedlase.errors import ConfigError, UserError
from fedlase.masks import Submodel
from fedlase.methods.fedlase import water_fill
from fedlase.robust_config import check_attack
from fedlase.server_step import attackers, judge, make_rule, screen

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
    nan = Experiment.from_config(load_config(None, [*base, "attack=nan", "attack_args.clients=[1]"]))
    stats = nan.run_round(1)
    assert list(stats["rejected"]) == ["1"] and "non-finite value" in stats["rejected"]["1"] and stats["clients"] == 3
    honest = Experiment.from_config(load_config(None, base))
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
    r = make_rule(rule, args)
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
    assert make_rule().name == "bounded" and make_rule().args["screen"] == 3
    assert make_rule("screen").args["screen"] == 100
    assert torch.equal(_agg("bounded", ups), _agg("adaptive_clip", ups, screen=3.0))
    ups.append(_up(3, [0, 0, 2, 0]))   # 4x the (lower) median norm per coordinate, 0.25; the first is 10x
    assert make_rule("screen").screen(ups, {}, W)[1] == {} and sorted(make_rule().screen(ups, {}, W)[1]) == ["0", "3"]


def test_multikrum_drops_the_update_far_from_the_others_on_shared_coordinates():
    ups = [_up(c, [1 + 0.1 * c, 1, 1, 1]) for c in range(4)] + [_up(4, [-9, 1, 0, 0], [True, True, False, False])]
    r = make_rule("multikrum", {"faulty": 0.2})
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
    exp = Experiment.from_config(cfg)
    u = Update(min(bad), cfg.levels.levels[1], {n: torch.zeros_like(p) for n, p in exp.params.items()}, 0.1)
    sub = exp.method.submodel(exp.params, u.level, 1)
    a, b = exp.receive(u, {u.level: sub}, 1), exp.receive(u, {u.level: sub}, 1)
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


# ---- issue 48: free riders, a running reference, references per level, colluders, centered clipping ------------
ONES = {"w": torch.ones(4)}   # a model of norm 1 per coordinate: near zero is judged against it too


def test_near_zero_updates_leave_the_reference_and_the_step_and_are_reported():
    honest = [_up(c, [0.1 + 0.01 * c] * 4) for c in range(5)]
    free = [_up(5 + c, [1e-13 * (c + 1)] * 4) for c in range(4)] + [_up(9, [0, 0, 0, 0])]
    v = judge(honest + free, {}, ONES, 3.0)
    assert sorted(v.near_zero) == [5, 6, 7, 8, 9] and v.rejected == {}
    assert [u.client for u in v.accepted] == [0, 1, 2, 3, 4] and v.refs == [pytest.approx(0.12)] * 5
    # the default's step is the honest five's: not clipped to zero, not diluted
    both, alone = make_rule(), make_rule()
    kept, _, rms = both.screen(honest + free, {}, ONES)
    new = both.aggregate(ONES, kept, {}, rms, "coverage", "mask", None)[0]["w"]
    kept, _, rms = alone.screen(honest, {}, ONES)
    assert torch.equal(new, alone.aggregate(ONES, kept, {}, rms, "coverage", "mask", None)[0]["w"])
    assert float(new[0]) > 1.1
    # an absurd update among them is still rejected; of two, one absurd, the honest one is not a free rider
    assert list(judge(honest + free + [_up(10, [50.0] * 4)], {}, ONES, 3.0).rejected) == ["10"]
    two = judge([_up(0, [0.1] * 4), _up(1, [3e38] * 4)], {}, ONES, 3.0)
    assert [u.client for u in two.accepted] == [0] and list(two.rejected) == ["1"] and two.near_zero == []


def test_a_level_with_three_clients_has_its_own_reference():
    from fractions import Fraction

    from fedlase.levels import Level
    big, small = Level(0, Fraction(1), 4), Level(1, Fraction(1, 4), 3)
    ups = [dataclasses.replace(_up(c, [0.1] * 4), level=big) for c in range(4)] + \
          [dataclasses.replace(_up(4 + c, [0.25] * 4), level=small) for c in range(3)]
    v = judge(ups, {}, ONES, 3.0)
    assert v.refs == [pytest.approx(0.1)] * 4 + [pytest.approx(0.25)] * 3   # not clipped to the big level's
    v = judge(ups[:5], {}, ONES, 3.0)   # one client of 1/4: the step's reference
    assert v.refs[-1] == pytest.approx(0.1)


def test_free_riders_leave_the_default_as_if_they_had_not_replied(tmp_path):
    """Issue 48: five of ten clients sending x1e-12 of their update switched the default off (7.6% against 96.8%
    at 20 rounds). Their updates are now left out of the step: the run is the one in which they never replied (a
    NaN update is rejected), bit for bit, and they are reported on every line."""
    five = ["attack_args.clients=[1,2,3,4,9]"]
    free, lines = _run(tmp_path, "free", "attack=scale", "attack_args.factor=1e-12", *five)
    absent, _ = _run(tmp_path, "absent", "attack=nan", *five)
    assert free["global_acc"] == absent["global_acc"] > 0.5   # 8 rounds; before: chance
    assert lines[-1]["near_zero"] == [1, 2, 3, 4, 9] and "rejected" not in lines[-1]
    assert lines[-1]["robust_totals"]["near_zero"] == {"1": 4 * 8, "1/4": 8}
    # and `fedlase report` shows the totals per level
    from fedlase.report import make_report
    md = make_report([str(tmp_path / "free")], tmp_path / "report", cost=False).read_text()
    row = [x for x in md.split("## Server step")[1].splitlines() if x.startswith("|")][2]   # after the header
    assert row.endswith("| 8.0 | 32.0 |"), row   # near_zero at 1/4 and at 1


@pytest.mark.parametrize("schedule", ["sync", "fedbuff", "fedasync"])
def test_a_wild_client_is_rejected_under_every_schedule(tmp_path, schedule):
    """Issue 48: under fedasync a step holds one update, whose median is itself: a client at x1e6 was accepted
    (9.7% against 94.0%). Every arrival of the wild client is now rejected, judged against the recent arrivals."""
    from fedlase.simtime import clock_for
    extra = [] if schedule == "sync" else [f"schedule={schedule}", "device_model={}", "population.speed_spread=0.5"]
    rounds = 12 if schedule == "fedasync" else 4   # fedasync: client 0 arrives at steps 1 and 11
    cfg = load_config(None, [*DIGITS, f"rounds={rounds}", "eval_every=1", f"out={tmp_path / 'w'}", "attack=scale",
                             "attack_args.factor=1e6", "attack_args.clients=[0]", *extra])
    final = run_experiment(cfg, progress=False, clock=clock_for)["final"]
    lines = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    if schedule == "sync":
        arrived = [True] * rounds
    else:
        record = [json.loads(x) for x in (tmp_path / "w" / "arrivals.jsonl").read_text().splitlines()]
        arrived = [any(r["client"] == 0 and r["step"] == x["round"] for r in record) for x in lines]
    assert any(arrived[1:])
    assert [("0" in x.get("rejected", {})) for x in lines] == arrived
    assert lines[-1]["robust_totals"]["rejected"]["1"] >= sum(arrived) and final["global_acc"] > 0.3
    if schedule == "fedasync":   # a step its update would have taken is not taken: every step moves the model
        assert all(x["clients"] == 1 for x in lines)
        assert [x.get("not_taken", 0) > 0 for x in lines] == [a or x["round"] == 1 for a, x in zip(arrived, lines)]


def test_an_asynchronous_run_whose_every_update_is_rejected_stops_with_one_line(tmp_path):
    """Steps that would leave the model unchanged are not taken; when none can be, the run says so and stops."""
    from fedlase.simtime import clock_for
    cfg = load_config(None, [*DIGITS, "rounds=2", f"out={tmp_path / 'w'}", "attack=nan", "attack_args.fraction=1",
                             "schedule=fedasync", "device_model={}"])
    with pytest.raises(UserError, match="server steps in a row left the model unchanged"):
        run_experiment(cfg, progress=False, clock=clock_for)


def test_a_resumed_fedasync_run_keeps_its_running_reference_and_totals(tiny_cfg, tmp_path):
    from fedlase import checkpoint
    from fedlase.simtime import clock_for
    fa = ["system={1,1/4}_{2,2}", "rounds=6", "device_model={}", "population.speed_spread=0.5",
          "schedule=fedasync", "schedule_args.concurrency=3", "attack=scale", "attack_args.factor=1e6",
          "attack_args.clients=[1]"]

    def go(name, *more, resume=False):
        run_experiment(tiny_cfg(*fa, *more, out=str(tmp_path / name)), resume=resume, progress=False,
                       clock=clock_for)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return checkpoint.load(tmp_path / name / "checkpoint.pt"), lines
    whole, whole_lines = go("whole")
    stopped, _ = go("split", "rounds=3")
    assert stopped["server"]["recent"]
    split, split_lines = go("split", resume=True)
    assert all(torch.equal(whole["params"][k], split["params"][k]) for k in whole["params"])
    drop = ("train_time", "eval_time")
    assert [{k: v for k, v in x.items() if k not in drop} for x in whole_lines] == \
           [{k: v for k, v in x.items() if k not in drop} for x in split_lines]
    assert whole_lines[-1]["robust_totals"]["rejected"]   # the wild client's, counted across the resume


def test_a_run_killed_between_evaluations_says_at_the_next_what_the_whole_run_says(tiny_cfg, tmp_path, monkeypatch,
                                                                                    caplog):
    """The screen's rejections since the last evaluation (ServerStep.window) are in the checkpoint: killed in round
    3 (its checkpoint: round 2's, rounds 1-2 rejected the wild client's update), resumed, the run logs the
    evaluation line of round 3 the uninterrupted run logs, and ends with the same model and state."""
    from fedlase import checkpoint
    run = ["participation=1", "rounds=4", "eval_every=3", "checkpoint_every=1", "attack=scale",
           "attack_args.factor=1e6", "attack_args.clients=[1]"]

    def said(name, resume=False):
        caplog.clear()
        with caplog.at_level("INFO", logger="fedlase"):
            run_experiment(tiny_cfg(*run, out=str(tmp_path / name)), resume=resume, progress=False)
        return [r.getMessage() for r in caplog.records if "the screen rejected" in r.getMessage()]

    whole = said("whole")
    assert whole[0].startswith("round 3: the screen rejected 3 of 12 updates")   # rounds 1-3, one a round
    real = Experiment.run_round

    def killed(self, rnd):
        if rnd == 3:
            raise RuntimeError("killed")
        return real(self, rnd)

    monkeypatch.setattr(Experiment, "run_round", killed)
    with pytest.raises(RuntimeError, match="killed"):
        said("split")
    monkeypatch.setattr(Experiment, "run_round", real)
    stopped = checkpoint.load(tmp_path / "split" / "checkpoint.pt")["server"]
    assert said("split", resume=True) == whole
    assert stopped["window"]["rejected"] == {"1": 2}
    a, b = (checkpoint.load(tmp_path / name / "checkpoint.pt") for name in ("whole", "split"))
    assert a["server"] == b["server"] and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_colluders_send_a_little_is_enough_and_inner_product_from_the_honest_updates():
    from fedlase.rules import InnerProduct, LittleIsEnough, alie_z
    assert alie_z(10, 3) == pytest.approx(0.5244, abs=1e-4) and alie_z(1, 1) == 0.0
    system = load_config(None, [*DIGITS, "out=x"]).levels
    half = [True, True, False, False]
    ups = [_up(0, [1, 2, 0, 0], half), _up(1, [3, 4, 5, 6]), _up(2, [9, 9, 9, 9]), _up(3, [9, 9, 9, 9], half)]
    args = {"fraction": 0.1, "level": None, "clients": [2, 3]}
    alie = LittleIsEnough({**args, "z": 1.0}, system, 0)
    out = alie.collude(ups, {}, W)
    assert out[:2] == ups[:2]
    # coordinates 0, 1: honest {1, 3}, {2, 4}: mean - std = 2 - 1, 3 - 1; 2, 3: honest {5}, {6}: std 0
    assert out[2].delta["w"].tolist() == [1, 2, 5, 6] and out[3].delta["w"].tolist() == [1, 2, 0, 0]
    ipm = InnerProduct({**args, "eps": 0.5}, system, 0)
    assert ipm.collude(ups, {}, W)[2].delta["w"].tolist() == [-1, -1.5, -2.5, -3]
    assert ipm.collude(ups[2:], {}, W) == ups[2:]   # no honest update to see


def test_centered_clipping_clips_around_the_last_step_and_keeps_it_across_a_checkpoint():
    rule = make_rule("centered_clip")
    assert rule.args == {"screen": 100.0, "tau": 1.0, "iterations": 1}
    ups = [_up(0, [1, 0, 0, 0]), _up(1, [0, 2, 0, 0]), _up(2, [0, 0, 4, 0])]
    kept, _, rms = rule.screen(ups, {}, W)
    # first step: around 0, the radius the (lower) median distance, 2: the third clipped from 4 to 2
    first = rule.aggregate(W, kept, {}, rms, "coverage", "mask", None)
    assert torch.allclose(first[0]["w"], torch.tensor([1, 2, 2, 0]) / 3) and first[1] == {"clipped": {"-": 1}}
    # second step, from the first's center c = [1, 2, 2, 0]/3: the same updates' distances from c
    again = make_rule("centered_clip")
    again.load_state_dict(rule.state_dict())
    c = torch.tensor([1, 2, 2, 0]) / 3
    dist = [float((u.delta["w"] - c).norm()) for u in ups]
    radius = sorted(dist)[1]
    want = c + sum((u.delta["w"] - c) * min(1, radius / d) for u, d in zip(ups, dist)) / 3
    assert torch.allclose(again.aggregate(W, kept, {}, rms, "coverage", "mask", None)[0]["w"], want)


@pytest.mark.parametrize("rule", ["bounded", "centered_clip"])
def test_the_server_step_reads_the_device_per_update_not_per_tensor(tiny_cfg, rule):
    """On a GPU every scalar read is a wait for the device: the screen and the clip read an update's norms and
    its submodel's sizes in one transfer each (fedlase.server_step.on_host), not one per parameter tensor."""
    exp = Experiment.from_config(tiny_cfg("participation=1.0", f"robust={rule}"))
    picked = exp.sample(1)
    subs = exp.submodels([lv for _, lv in picked], 1)
    updates = exp.runner.train(exp, 1, picked, subs).updates
    with host_reads() as reads:
        kept, _, rms = exp.server.screen(updates, subs, exp.params)
        exp.server.new_model(exp.params, kept, subs, rms, 1)
    tensors = sum(len(u.delta) for u in updates)
    assert len(kept) == len(updates) >= 4 and tensors >= 8 * len(updates)
    # the screen: one read of the norms, one of the model's, one per distinct submodel's size; the rule: one per
    # update (its size), and centered clipping one more for the distances (before: one per tensor, >= `tensors`)
    assert len(reads) <= 3 + len(subs) + len(updates), reads


# ---- issue 56: shrunken updates, the running reference, a level's attackers, dp, colluders under fedasync ---------
def test_a_minority_of_shrunken_updates_sets_no_reference():
    """Four of ten updates at x1e-2 pulled the lower median down to the smallest honest update (every honest update
    clipped to it); five of ten made it theirs (every honest update rejected). Small figures (x0.2) are now left
    out of the reference, and x1e-2 ones out of the step too: the verdict is the one without them."""
    honest = [_up(c, [0.1 + 0.01 * c] * 4) for c in range(6)]
    alone = judge(honest, {}, ONES, 3.0)
    for k, factor in ((4, 1e-2), (4, 0.2), (5, 1e-2), (5, 1e-3)):
        small = [_up(6 + c, [factor * 0.12] * 4) for c in range(k)]
        v = judge(honest + small, {}, ONES, 3.0)
        assert v.rejected == {} and v.refs[:6] == alone.refs, (k, factor)
        assert sorted(v.near_zero) == ([] if factor == 0.2 else [6 + c for c in range(k)]), (k, factor)
    # five of a level's nine at x0.2 (above near zero) are its majority, but set no reference: not the level's
    from fractions import Fraction

    from fedlase.levels import Level
    big, quarter = Level(0, Fraction(1), 9), Level(1, Fraction(1, 4), 1)
    level = [dataclasses.replace(_up(c, [0.1 + 0.01 * c] * 4), level=big) for c in range(4)] + \
            [dataclasses.replace(_up(4, [0.12] * 4), level=quarter)] + \
            [dataclasses.replace(_up(5 + c, [0.2 * 0.12] * 4), level=big) for c in range(5)]
    v = judge(level, {}, ONES, 3.0)
    assert v.rejected == {} and v.near_zero == [] and min(v.refs[:5]) > 0.1
    # a large minority is rejected as before, and of two updates the larger is still judged against the smaller
    assert list(judge(honest + [_up(9, [50.0] * 4)], {}, ONES, 3.0).rejected) == ["9"]
    assert list(judge([_up(0, [0.01] * 4), _up(1, [0.1] * 4)], {}, ONES, 3.0).rejected) == ["1"]


RECENT = [("-", 10 + c, 0.1 + 0.01 * c) for c in range(5)]   # a running reference of five honest arrivals


def test_a_buffer_of_a_zero_update_and_a_large_one_is_judged_against_the_recent_arrivals():
    """Item 5: the running reference was used only for a step of one finite update, so FedBuff's [0, x1e3] judged
    the x1e3 update against itself and took it, unclipped."""
    v = judge([_up(0, [0.0] * 4), _up(1, [100.0] * 4)], {}, ONES, 3.0, list(RECENT))
    assert list(v.rejected) == ["1"] and "median" in v.rejected["1"] and v.accepted == [] and v.near_zero == [0]


def test_a_near_zero_fedasync_arrival_is_not_taken_and_kept_out_of_the_running_reference():
    """Item 6: under fedasync a near-zero arrival was taken (it spent a step) and never listed; the run's first one
    entered the running reference, and the next honest arrival was rejected against it."""
    v = judge([_up(0, [1e-13] * 4)], {}, ONES, 3.0, list(RECENT))
    assert v.accepted == [] and v.near_zero == [0] and v.solid == [] and v.rejected == {}
    first = judge([_up(0, [1e-13] * 4)], {}, ONES, 3.0, [])   # nothing yet to be judged among: the model's norm
    assert first.accepted == [] and first.near_zero == [0] and first.solid == []


def test_a_level_reference_is_not_set_by_two_of_its_three_clients():
    """Item 7: two of a level's three clients flipped at x2.5 set its lower median (2.5x the step's), and were
    taken unclipped; a level's reference above the step's is now at most its lower third."""
    from fractions import Fraction

    from fedlase.levels import Level
    big, small = Level(0, Fraction(1), 4), Level(1, Fraction(1, 4), 3)
    ups = [dataclasses.replace(_up(c, [0.1] * 4), level=big) for c in range(4)] + \
          [dataclasses.replace(_up(4, [0.1] * 4), level=small)] + \
          [dataclasses.replace(_up(5 + c, [-0.25] * 4), level=small) for c in range(2)]
    v = judge(ups, {}, ONES, 3.0)
    assert v.rejected == {} and v.refs == [pytest.approx(0.1)] * 7
    rule = make_rule()
    kept, _, rms = rule.screen(ups, {}, ONES)
    assert rule.aggregate(ONES, kept, {}, rms, "coverage", "mask", None)[1] == {"clipped": {"1/4": 2}}


def test_under_dp_no_update_is_near_zero_whatever_the_others_send():
    """Item 8: under dp the near-zero cut made whether an update is counted depend on the others' updates; the
    denominator is public there, so the cut is off: every finite update is counted, whatever the others sent."""
    from fedlase.server_step import ServerStep, Stage

    class Private(Stage):
        screen_by_others = False
    system = load_config(None, [*DIGITS, "out=x"]).levels
    counted = []
    for wild in (0.1, 1e3):
        step = ServerStep.of("bounded", {}, "none", {}, system, 0, "coverage", "mask", None, (Private(),))
        ups = [_up(0, [0.1] * 4), _up(1, [0.12] * 4), _up(2, [0.0] * 4), _up(3, [1e-9] * 4), _up(4, [wild] * 4)]
        kept, rejected, _ = step.screen(ups, {}, ONES)
        assert rejected == {} and step.near_zero == []
        counted.append([u.client for u in kept])
    assert counted == [[0, 1, 2, 3, 4]] * 2


@pytest.mark.parametrize("attack", ["little_is_enough", "inner_product"])
@pytest.mark.parametrize("schedule", [["schedule=fedasync"], ["schedule=fedbuff", "schedule_args.buffer=1"]])
def test_colluders_are_refused_where_a_step_holds_one_update(tmp_path, attack, schedule):
    """Item 9: a step of one update has no honest update to collude with: the run was the honest one, bit for bit."""
    args = [*DIGITS, f"out={tmp_path / 'x'}", *schedule, "device_model={}", f"attack={attack}"]
    with pytest.raises(ConfigError, match="colludes") as e:
        load_config(None, args)
    assert e.value.key == "attack" and "\n" not in str(e.value)
    load_config(None, [*args[:-4], f"out={tmp_path / 'y'}", "schedule=fedbuff", "schedule_args.buffer=2",
                       "device_model={}", f"attack={attack}"])   # a buffer of two holds others


def test_routine_rejections_are_one_line_per_evaluation_and_a_wild_level_is_warned_about(tmp_path, caplog):
    """Issue 57: honest runs printed a line per rejected update (the 3x screen rejects some by design). Each
    rejection is now in the metrics and at DEBUG; the log says them once per evaluation, and warns only where
    more than a fifth of a level's updates were rejected since the last evaluation."""
    import logging
    caplog.set_level(logging.DEBUG, logger="fedlase")
    four = ["rounds=4", "eval_every=2"]
    one = ["attack=scale", "attack_args.factor=50", "attack_args.clients=[0]"]   # 1 of level 1's 9: routine
    _, lines = _run(tmp_path, "one", *four, *one)
    assert all("0" in x["rejected"] for x in lines)
    records = [r for r in caplog.records if r.name == "fedlase"]
    assert [r.levelname for r in records if "rejected client" in r.getMessage()] == ["DEBUG"] * 4
    summary = [r for r in records if "the screen rejected" in r.getMessage()]
    assert [r.levelname for r in summary] == ["INFO", "INFO"] and "1: 2 of 18" in summary[0].getMessage()
    caplog.clear()
    _run(tmp_path, "wild", *four, *FAULTY)   # every update of level 1/4 rejected
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 0   # 2 of 2 per evaluation: fewer than 3
    caplog.clear()
    _run(tmp_path, "wild6", "rounds=6", "eval_every=6", *FAULTY)
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "6 of level 1/4's 6 updates" in loud[0], loud
