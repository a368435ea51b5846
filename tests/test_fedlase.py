"""FedLASE (fedlase/methods/fedlase.py): water-filling by hand, each ablation switch changing exactly what it
should and nothing else, exact per-level budgets, and the smallest-level error.

The tests go through the method's public behaviour only (build_method, layer_budgets, submodel, aggregation,
water_fill), so they hold however the method classes are arranged."""
import itertools
import math
import random

import pytest
import torch

from fedlase.errors import ConfigError
from fedlase.methods import build_method
from fedlase.methods.fedlase import water_fill
from fedlase.models import build_model

LEVELS = [1.0, 1 / 4, 1 / 16, 1 / 64]
FIRST, LAST = "features.0.weight", "classifier.weight"
MIDDLE = ["features.4.weight", "features.8.weight", "features.11.weight"]


# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = [pytest.mark.numerics,
              pytest.mark.usefixtures("one_thread")]   # tiny models run fastest on one thread


# =========================================================================== water_fill by hand

def check_fill(weights, sizes, total, expected):
    k = water_fill(weights, sizes, total)
    assert k == expected
    assert sum(k) == min(total, sum(sizes)) and all(0 <= a <= n for a, n in zip(k, sizes))


def test_water_fill_proportional_and_exact():
    check_fill([1, 1, 2], [100, 100, 100], 40, [10, 10, 20])
    check_fill([1.5, 0.5], [1000, 1000], 8, [6, 2])
    check_fill([1], [50], 17, [17])
    check_fill([1, 2, 3], [100, 100, 100], 0, [0, 0, 0])


def test_water_fill_cap_keeps_a_layer_whole_and_reshares_its_surplus():
    # layer 0's proportional share 45 * 10/12 = 37.5 exceeds its 5: it is kept whole, the other 40 go 1:1
    check_fill([10, 1, 1], [5, 100, 100], 45, [5, 20, 20])
    # two layers capped in the same pass
    check_fill([10, 5, 1], [5, 10, 100], 60, [5, 10, 45])
    # a cascade: after layer 0 is capped, re-sharing 35 in 3:1 caps layer 1 (26.25 > 12); layer 2 gets the rest
    check_fill([10, 3, 1], [5, 12, 100], 40, [5, 12, 23])


def test_water_fill_zero_weights():
    check_fill([0, 1, 1], [10, 10, 10], 10, [0, 5, 5])
    # all weights zero: no signal, shared by size
    check_fill([0, 0, 0], [10, 20, 30], 12, [2, 4, 6])
    check_fill([0.0, 0.0], [3, 1], 4, [3, 1])
    # the only weighted layer is capped: what is left goes to the zero-weight layer (by size)
    check_fill([0, 1], [10, 5], 8, [3, 5])


def test_water_fill_ties_and_remainders():
    # equal weights: 10/3 each; the one left over goes to the earlier layer, then the next
    check_fill([1, 1, 1], [10, 10, 10], 10, [4, 3, 3])
    check_fill([1, 1, 1], [10, 10, 10], 11, [4, 4, 3])
    check_fill([2, 2, 2, 2], [9, 9, 9, 9], 7, [2, 2, 2, 1])
    # not the earlier layer but the largest fractional part: 1.67, 3.33, 5.00 -> floors 1, 3, 5, +1 to layer 0
    check_fill([1, 2, 3], [100, 100, 100], 10, [2, 3, 5])
    # a layer that is full takes no remainder even if its fractional part is the largest
    check_fill([1, 1, 1], [3, 100, 100], 10, [3, 4, 3])


def test_water_fill_layer_larger_than_the_budget():
    check_fill([1], [1000], 7, [7])
    check_fill([1, 1], [1000, 10], 50, [40, 10])
    check_fill([5, 1], [1000, 1000], 12, [10, 2])


def test_water_fill_total_beyond_the_sizes_keeps_everything():
    check_fill([1, 2], [3, 4], 100, [3, 4])
    check_fill([1, 2], [3, 4], 7, [3, 4])
    check_fill([0, 1], [0, 4], 3, [0, 3])   # an empty layer


def test_water_fill_random_cases_are_exact_capped_and_proportional():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        sizes = [rng.randint(0, 200) for _ in range(n)]
        weights = [rng.choice([0.0, rng.random(), rng.random() * 100]) for _ in range(n)]
        total = rng.randint(0, sum(sizes) + 50)
        k = water_fill(weights, sizes, total)
        assert sum(k) == min(total, sum(sizes)) and all(0 <= a <= s for a, s in zip(k, sizes))
        free = [i for i in range(n) if k[i] < sizes[i]]
        # layers not kept whole hold within one of each other's share per unit of weight
        for i, j in itertools.permutations(free, 2):
            if weights[i] > 0 and weights[j] > 0:
                assert (k[i] - 1) / weights[i] <= (k[j] + 1) / weights[j] + 1e-9


# =========================================================================== the method on a small CNN

def level(method, value):
    """The method's own level object for `value` (a float, or whatever the system holds)."""
    system = getattr(method, "system", None)
    levels = list(system.levels) if system is not None else list(getattr(method, "levels", []))
    found = [lv for lv in levels if math.isclose(float(getattr(lv, "value", lv)), value)]
    return found[0] if found else value


def setup(levels=LEVELS, seed=0, **options):
    """The method on the small CNN, and parameters without ties among magnitudes: float32 init draws
    repeat values in a layer of 4,608 weights, so each parameter is redrawn in float64 at its init scale."""
    torch.manual_seed(seed)
    model = build_model("cnn", in_channels=1, num_classes=10, width=0.5, image_size=8)
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(v.shape, dtype=torch.float64, generator=gen) * float(v.detach().std() if v.numel() > 1
                                                                                 else 0.1)
              for k, v in model.named_parameters()}
    return build_method("fedlase", model, options, list(levels)), params


def maskable(method):
    return list(method.maskable)


def budgets(method, params, value):
    return dict(method.layer_budgets(params, level(method, value)))


def submodel(method, params, value, rnd=1):
    return method.submodel(params, level(method, value), rnd)


def test_the_cnn_is_what_the_tests_assume():
    method, params = setup()
    weights = [n for n in maskable(method) if n.endswith("weight")]
    assert weights == [FIRST, *MIDDLE, LAST]
    assert set(budgets(method, params, 1 / 16)) == set(MIDDLE)
    # no ties among the magnitudes of any layer (so "keeps exactly k" is well defined)
    for n in maskable(method):
        assert params[n].abs().flatten().unique().numel() == params[n].numel()


def expected_budgets(params, value, total, score="mean", log=True, transform="share", layers=MIDDLE, fixed=0):
    """The module docstring's rule, written out: weights a_l from the layer scores, then water-filling."""
    sizes = [params[n].numel() for n in layers]
    rest = int(value * total) - fixed
    if score == "equal":
        w = [float(s) for s in sizes]
    else:
        s = [float(params[n].abs().mean() if score == "mean" else params[n].abs().max()) for n in layers]
        if transform == "share":
            w = [math.log1p(n * si) if log else n * si for n, si in zip(sizes, s)]
        else:
            w = [n * (math.log1p(si / min(s)) if log else si / min(s)) for n, si in zip(sizes, s)]
    return dict(zip(layers, water_fill(w, sizes, rest)))


@pytest.mark.parametrize("score", ["mean", "max", "equal"])
@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("transform", ["share", "ratio"])
def test_layer_budgets_follow_the_documented_rule(score, log, transform):
    method, params = setup(score=score, log=log, transform=transform)
    total = sum(params[n].numel() for n in maskable(method))
    fixed = total - sum(params[n].numel() for n in MIDDLE)   # first, last layer and the bias kept whole
    for value in LEVELS:
        got = budgets(method, params, value)
        assert got == expected_budgets(params, value, total, score, log, transform, fixed=fixed)
        assert sum(got.values()) == int(value * total) - fixed


def test_score_changes_the_budgets():
    by_score = {s: setup(score=s) for s in ("mean", "max", "equal")}
    for value in LEVELS[1:]:
        got = {s: budgets(m, p, value) for s, (m, p) in by_score.items()}
        assert got["mean"] != got["max"] != got["equal"] != got["mean"]
        assert len({sum(b.values()) for b in got.values()}) == 1   # same total, shared differently


def test_score_equal_gives_equal_keep_ratios():
    method, params = setup(score="equal")
    sizes = {n: params[n].numel() for n in MIDDLE}
    for value in LEVELS:
        got = budgets(method, params, value)
        ratio = sum(got.values()) / sum(sizes.values())
        for n in MIDDLE:
            assert abs(got[n] - ratio * sizes[n]) < 1   # the same ratio up to rounding
    # equal ignores the magnitudes, so log and transform change nothing
    for log, transform in itertools.product([True, False], ["share", "ratio"]):
        other, _ = setup(score="equal", log=log, transform=transform)
        assert all(budgets(other, params, v) == budgets(method, params, v) for v in LEVELS)


def test_log_changes_the_budgets():
    on, params = setup(log=True)
    off, _ = setup(log=False)
    for value in LEVELS[1:]:
        assert budgets(on, params, value) != budgets(off, params, value)


def test_transform_changes_the_budgets_but_not_without_log():
    share, params = setup(transform="share")
    ratio, _ = setup(transform="ratio")
    share_nolog, _ = setup(transform="share", log=False)
    ratio_nolog, _ = setup(transform="ratio", log=False)
    for value in LEVELS[1:]:
        assert budgets(share, params, value) != budgets(ratio, params, value)
        # without the log, n*s and n*s/s_min are proportional: the same rule
        assert budgets(share_nolog, params, value) == budgets(ratio_nolog, params, value)
        a, b = submodel(share_nolog, params, value), submodel(ratio_nolog, params, value)
        assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)


def test_extract_all_layers():
    default, params = setup()
    everything, _ = setup(extract_all_layers=True)
    names = maskable(default)
    assert set(budgets(everything, params, 1 / 16)) == {FIRST, *MIDDLE, LAST}
    for value in LEVELS[1:]:
        a, b = submodel(default, params, value), submodel(everything, params, value)
        # default: the first and last layers (and the bias) are trained whole
        for n in (FIRST, LAST, "classifier.bias"):
            assert a.kept([n], params) == params[n].numel()
        # all layers: the first and last weights get budgets like the others (the bias is still whole)
        got = budgets(everything, params, value)
        for n in (FIRST, LAST):
            assert int(b.masks[n].sum()) == got[n] <= params[n].numel()
        assert b.kept(["classifier.bias"], params) == params["classifier.bias"].numel()
        if value <= 1 / 16:   # here the classifier is cut, which frees budget for the middle layers
            assert got[LAST] < params[LAST].numel()
            assert all(got[n] > k for n, k in budgets(default, params, value).items())
        # the same budget either way
        assert a.kept(names, params) == b.kept(names, params) == int(value * sum(params[n].numel() for n in names))
    # level 1 keeps everything either way
    for m in (default, everything):
        assert submodel(m, params, 1.0).kept(names, params) == sum(params[n].numel() for n in names)


def aspects(method, params):
    """What a switch may change, per level: the budgets, the masks, the threshold/STE rule, the aggregation."""
    out = {"aggregation": method.aggregation}
    for value in LEVELS:
        sub = submodel(method, params, value)
        out[value, "budgets"] = budgets(method, params, value)
        out[value, "masks"] = {n: m.clone() for n, m in sub.masks.items()}
        out[value, "ste"] = None if sub.thresholds is None else (sub.ste, dict(sub.thresholds))
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("switch, changes", [
    ({"score": "max"}, {"budgets", "masks", "ste"}),
    ({"score": "equal"}, {"budgets", "masks", "ste"}),
    ({"log": False}, {"budgets", "masks", "ste"}),
    ({"transform": "ratio"}, {"budgets", "masks", "ste"}),
    ({"extract_all_layers": True}, {"budgets", "masks", "ste"}),
    ({"ste": "paper"}, {"ste"}),
    ({"ste": "fixed"}, {"ste"}),
    ({"overlap": False}, {"aggregation"}),
])
def test_each_switch_changes_exactly_what_it_should(switch, changes):
    # "ste" here is the threshold rule the client gets: the thresholds move with the budgets
    default, params = setup()
    switched, _ = setup(**switch)
    a, b = aspects(default, params), aspects(switched, params)
    for key in a:
        kind = key if isinstance(key, str) else key[1]
        if kind not in changes:
            assert same(a[key], b[key]), f"{switch} changed {key}"
    for kind in changes:
        keys = [k for k in a if (k if isinstance(k, str) else k[1]) == kind]
        assert any(not same(a[k], b[k]) for k in keys), f"{switch} did not change {kind}"


@pytest.mark.parametrize("ste", ["official", "paper", "fixed"])
def test_ste(ste):
    method, params = setup(ste=ste)
    ref, _ = setup(ste="official")
    for value in LEVELS:
        sub, base = submodel(method, params, value), submodel(ref, params, value)
        # the mask at the start of the round is the same whatever the STE
        assert sub.masks.keys() == base.masks.keys()
        assert all(torch.equal(sub.masks[n], base.masks[n]) for n in sub.masks)
        if ste == "fixed":
            assert sub.thresholds is None   # the mask stays fixed for the round
        else:
            assert sub.ste == ste and set(sub.thresholds) == set(sub.masks)
            for n, tau in sub.thresholds.items():   # the mask is |w| >= tau
                assert torch.equal(sub.masks[n], params[n].abs() >= tau)


@pytest.mark.parametrize("overlap, rule", [(True, "coverage"), (False, "mean")])
def test_overlap_sets_the_aggregation_rule_only(overlap, rule):
    method, params = setup(overlap=overlap)
    ref, _ = setup()
    assert method.aggregation == rule
    for value in LEVELS:
        a, b = submodel(method, params, value), submodel(ref, params, value)
        assert all(torch.equal(a.masks[n], b.masks[n]) for n in b.masks) and a.masks.keys() == b.masks.keys()


@pytest.mark.parametrize("options", [{}, {"score": "max"}, {"score": "equal"}, {"log": False},
                                     {"transform": "ratio"}, {"extract_all_layers": True}, {"ste": "fixed"}])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_level_keeps_exactly_its_budget(options, seed):
    levels = [1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64]
    method, params = setup(levels, seed=seed, **options)
    names = maskable(method)
    total = sum(params[n].numel() for n in names)
    for value in levels:
        sub = submodel(method, params, value, rnd=3)
        assert sub.kept(names, params) == int(value * total)
        for n, k in budgets(method, params, value).items():
            kept = params[n].abs()[sub.masks[n]]
            dropped = params[n].abs()[~sub.masks[n]]
            # each layer keeps exactly its budget, and its k largest magnitudes
            assert int(sub.masks[n].sum()) == k
            if k and dropped.numel():
                assert kept.min() > dropped.max()


def test_submodel_does_not_depend_on_the_round():
    method, params = setup()
    a, b = submodel(method, params, 1 / 16, rnd=1), submodel(method, params, 1 / 16, rnd=7)
    assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)


def test_a_level_too_small_for_the_edge_layers_is_a_config_error():
    # first conv 144 + classifier 1280 + bias 10 = 1434 kept whole; 1/128 of 98,202 allows 767
    with pytest.raises(ConfigError, match="method_args.extract_all_layers") as err:
        setup([1.0, 1 / 4, 1 / 128])
    assert len(str(err.value).splitlines()) == 1 and "1434" in str(err.value)
    # extracting every layer makes that level possible, with its exact budget
    method, params = setup([1.0, 1 / 4, 1 / 128], extract_all_layers=True)
    names = maskable(method)
    total = sum(params[n].numel() for n in names)
    assert submodel(method, params, 1 / 128).kept(names, params) == int(total / 128)
    # 1/64 (1534) is just enough
    setup([1.0, 1 / 64])
