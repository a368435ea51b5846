"""FedLASE with layer-adaptive widths (fedlase/methods/fedlase_width.py): the budget is met at every level, residual
stages keep one set of channels, the sliced training equals the masked one, and a run goes end to end."""
import json
import math

import pytest
import torch

from conftest import counted_over, digits_test_size
from fedlase.engine import run_experiment
from fedlase.methods.fedlase_width import FedLASEWidth
from fedlase.models import ResNet18, SmallCNN
from fedlase.registry import METHODS

LEVELS = [1, 1 / 4, 1 / 16, 1 / 64]
MODELS = {"cnn": lambda: SmallCNN(width=0.25, image_size=8), "resnet18": lambda: ResNet18(width=0.125)}


def _method(arch, **options):
    torch.manual_seed(0)
    model = MODELS[arch]()
    return FedLASEWidth(model, LEVELS, **options), {n: p.detach() for n, p in model.named_parameters()}


def test_registered_through_the_public_registry():
    assert METHODS.get("fedlase_width") is FedLASEWidth


@pytest.mark.parametrize("score", ["mean", "equal"])
@pytest.mark.parametrize("arch", MODELS)
def test_budget_met_at_every_level(arch, score):
    method, params = _method(arch, score=score, budget="params")
    for level in LEVELS:
        sub = method.submodel(params, level, 1)
        kept, budget = sub.kept(method.maskable, params), method.budget(params, level)
        assert kept <= budget, (level, kept, budget)
        # measured: within 1% of the budget at every level on both tiny models; channels are coarse, so allow 10%
        assert kept >= 0.9 * budget, (level, kept, budget)
        if level < 1:
            assert sub.slices   # trained as the smaller dense model


@pytest.mark.parametrize("arch", MODELS)
def test_budget_both_bounds_parameters_and_forward_work(arch):
    # budget=both: at every level the parameters and the forward work are each at most l of the full model's,
    # and one of the two is nearly spent; budget=params alone lets the small early layers (which run at the
    # highest resolution) take more than l of the work at the smallest level
    method, params = _method(arch, budget="both")
    loose, _ = _method(arch)   # the default: budget=params
    full_work = method.full_work
    assert full_work == method._cost(dict(method.sizes), params, method.uses)
    assert method.uses != {n: 1 for n in method.uses}   # convs are counted at every output position
    for level in LEVELS[1:]:
        keep = method.widths(params, level)
        kept, work = method._cost(keep, params), method._cost(keep, params, method.uses)
        assert kept <= method.budget(params, level) and work <= level * full_work, (level, kept, work)
        assert max(kept / method.budget(params, level), work / (level * full_work)) >= 0.75, (level, kept, work)
    assert loose.uses is None   # the default needs no forward pass
    work = loose._cost(loose.widths(params, 1 / 64), params, method.uses)
    assert work > full_work / 64


def test_layer_scores_set_the_widths():
    # the default (log-smoothed mean scores) and equal scores give other widths at the same budget; equal
    # scores give every layer the same ratio, so the widths come out near HeteroFL's uniform rate
    method, params = _method("cnn")
    equal, _ = _method("cnn", score="equal")
    adaptive, uniform = method.widths(params, 1 / 16), equal.widths(params, 1 / 16)
    assert adaptive != uniform
    for g, k in uniform.items():
        assert abs(k - math.ceil(method.sizes[g] / 4)) <= 1, (g, k)


def _rows(m):
    return m.flatten(1).any(1) if m.dim() > 1 else m


def _cols(m):
    return m.transpose(0, 1).flatten(1).any(1)


@pytest.mark.parametrize("channels", ["magnitude", "first"])
def test_residual_stages_keep_one_set_of_channels(channels):
    method, params = _method("resnet18", channels=channels)
    sub = method.submodel(params, 1 / 16, 1)
    seen: dict[str, torch.Tensor] = {}
    for name, (out_g, in_g) in method.groups.items():
        if name not in sub.masks:   # a tensor no group cuts (the classifier's bias)
            continue
        m = sub.masks[name]
        for g, kept in ((out_g, _rows(m)), (in_g, _cols(m) if m.dim() > 1 else None)):
            if g is None or kept is None:
                continue
            if g in seen:
                assert torch.equal(seen[g], kept), (name, g)
            seen[g] = kept
    stage = seen["stage0"]   # the stem, stage 1's blocks and their identity shortcuts: one group
    assert 0 < int(stage.sum()) < stage.numel()
    if channels == "first":
        assert torch.equal(stage, torch.arange(stage.numel()) < int(stage.sum()))


def test_channels_ranked_by_magnitude():
    method, params = _method("cnn")
    params = dict(params)
    w = params["features.4.weight"].clone()
    w[-1] *= 100   # the last channel of block1 becomes the largest: it must be kept
    params["features.4.weight"] = w
    sub = method.submodel(params, 1 / 64, 1)
    assert bool(_rows(sub.masks["features.4.weight"])[-1])


SHAPES = {"cnn": (32, 1, 8, 8), "resnet18": (32, 3, 16, 16)}


@pytest.mark.numerics
@pytest.mark.parametrize("budget, steps", [("params", 4), ("both", 1)])
@pytest.mark.parametrize("level", [1 / 4, 1 / 16])
@pytest.mark.parametrize("arch", MODELS)
def test_sliced_training_equals_masked_training(arch, level, budget, steps):
    # the same submodel trained as the gathered small model and as masks over the full one. Magnitude-ranked
    # channels are not contiguous, so the kernels sum in another order: measured (2026-12-01, one AVX-512 Xeon)
    # relative gap 6e-7 (CNN) and 1.5e-6 (ResNet-18) after 4 steps; bound 1e-4. (Whole rounds of the tiny
    # ResNet-18 on 8x8 digits are no test of this: there a 1e-7 change of the start grows to a 25% gap in two
    # rounds, HeteroFL's too. The narrower widths of budget=both on it grow 1e-6 after one step to 6e-3 after
    # two, as batch-statistics BN over a few channels amplifies rounding; so that budget is checked on one step.)
    from fedlase.client import local_work
    from fedlase.train import local_train
    method, params = _method(arch, budget=budget)
    model = method.model
    buffers = dict(model.named_buffers())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(*SHAPES[arch], generator=gen), torch.randint(0, 10, (32,), generator=gen)
    batches = ([torch.arange(16), torch.arange(16, 32)] * 2)[:steps]
    work = local_work(steps=steps, batch_size=16, lr=0.05)
    sub = method.submodel(params, level, 1)
    assert sub.slices
    sliced, _ = local_train(model, params, buffers, sub, x, y, batches, work)
    masked, _ = local_train(model, params, buffers, sub.masked(), x, y, batches, work)
    gap = sum(float(((sliced[n] - masked[n]).double() ** 2).sum()) for n in params)
    moved = sum(float((masked[n].double() ** 2).sum()) for n in params)
    assert moved > 1e-6
    assert (gap / moved) ** 0.5 < 1e-4
    for n, m in sub.masks.items():   # nothing trains outside the slice
        assert not bool(sliced[n][~m].any()), n


def test_runs_end_to_end_on_digits(tiny_cfg, tmp_path):
    cfg = tiny_cfg("method=fedlase_width", "system={1,1/4,1/16,1/64}_{1,1,1,1}", "participation=1.0")
    summary = run_experiment(cfg, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines if "train_loss" in x][-1] == 2
    levels = summary["final"]["levels"]
    assert len(levels) == 4
    assert all(counted_over(lv["global_acc"], digits_test_size()) for lv in levels.values())
    kept = sorted(lv["kept"] for lv in levels.values())   # budgeted coordinates each level holds
    assert kept[0] <= kept[-1] / 64 < kept[-1]
