"""A level's parameter budget is met, refused in one line, or its real share stated (issue 48, item 12).

The case: a ConvMixer-like model of a user's own, loaded as a user's model is (fedlase.register_model), whose
flatten-to-linear head (kept whole: a flatten has no channel-to-channel form) is most of its parameters. At level
1/4 no width cut can bring it under a quarter of the model: fedlase_width refuses the level, the methods that
define a level by its width (HeteroFL's sqrt) say what each level really holds, at the start of the run and in
`fedlase cost`."""
import logging
import re

import pytest
from torch import nn

import fedlase
from fedlase import cost
from fedlase.cost import format_cost_table, level_costs
from fedlase.engine import build_parts
from fedlase.errors import ConfigError
from fedlase.registry import METHODS, MODELS, temporary

WIDTH_DEFINED = ("heterofl", "fedrolex", "fjord", "feddse", "fedavg_small")   # a level is a width rate


class Residual(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x) + x


def convmixer(cfg, data, dim=32, depth=2, pooled=False):
    """Patches of 2x2, `depth` blocks of a residual depthwise 3x3 conv and a pointwise conv (GELU, BN after
    each); then either a flatten of the 7x7 map into the classifier (15,690 of its 18,922 parameters) or
    global pooling (`pooled`: a classifier of 330)."""
    blocks = [nn.Sequential(Residual(nn.Sequential(nn.Conv2d(dim, dim, 3, groups=dim, padding=1), nn.GELU(),
                                                   nn.BatchNorm2d(dim))),
                            nn.Conv2d(dim, dim, 1), nn.GELU(), nn.BatchNorm2d(dim)) for _ in range(depth)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dim, data.num_classes)] if pooled else \
        [nn.Flatten(), nn.Linear(dim * 7 * 7, data.num_classes)]
    return nn.Sequential(nn.Conv2d(data.in_channels, dim, 2), nn.GELU(), nn.BatchNorm2d(dim), *blocks, *head)


@pytest.fixture
def mixer():
    with temporary(MODELS):
        fedlase.register_model("mixer_t", convmixer, kind="image")
        fedlase.register_model("pooled_mixer_t", lambda cfg, data: convmixer(cfg, data, pooled=True), kind="image")
        yield


def config(method, system="{1,1/4}_{6,6}", model="mixer_t", out="unused"):
    return fedlase.make_config(dataset="digits", model=model, method=method, system=system, rounds=1,
                               local_steps=1, threads=1, device="cpu", checkpoint_every=0, out=out)


def budgeted(parts) -> tuple[dict, int]:
    params = {n: p.detach() for n, p in parts.model.named_parameters()}
    return params, sum(params[n].numel() for n in parts.method.maskable)


def test_fedlase_width_refuses_a_level_its_uncut_layers_exceed(mixer, tmp_path):
    with pytest.raises(ConfigError, match=r"^system: level 1/4 of fedlase_width cannot be met: one channel per "
                       r"group already holds 15,781 parameters, over its 4,650 budgeted parameters \(15,722 are in "
                       r"layers no width cut reaches: 6.weight, ") as e:
        fedlase.run(config("fedlase_width", out=str(tmp_path / "r")))
    assert "\n" not in str(e.value)
    # the numbers: the budget is FIARSE's int(l * budgeted), the head alone is more than three times it
    parts = build_parts(config("fedavg"))
    params, total = budgeted(parts)
    assert total // 4 == 4650 and params["6.weight"].numel() + params["6.bias"].numel() == 15690
    # where every group can keep a channel within the budget, the level is met (and never silently at one channel)
    ok = build_parts(config("fedlase_width", "{1,1/16}_{1,1}", "pooled_mixer_t"))
    params, _ = budgeted(ok)
    small = ok.method.submodel(params, ok.levels[1], 1)
    assert small.kept(ok.method.maskable, params) <= ok.method.budget(params, ok.levels[1])


def test_fedlase_width_says_when_it_cuts_a_group_to_one_channel(mixer, caplog):
    parts = build_parts(config("fedlase_width", "{1,1/64}_{1,1}", "pooled_mixer_t"))
    params, _ = budgeted(parts)
    with caplog.at_level(logging.WARNING, logger="fedlase"):
        for rnd in (1, 2):   # said once per level, not every round
            sub = parts.method.submodel(params, parts.levels[1], rnd)
    assert sub.kept(parts.method.maskable, params) <= parts.method.budget(params, parts.levels[1])
    lines = [r.getMessage() for r in caplog.records if "single channel" in r.getMessage()]
    assert lines == ["fedlase_width: level 1/64 meets its budget only by cutting 3 of 3 channel groups to a single "
                     "channel (0.weight:0, 3.1.weight:0, 4.1.weight:0)"]
    assert int(sub.masks["3.1.weight"].flatten(1).any(1).sum()) == 1   # one output channel of 32


@pytest.mark.parametrize("method", WIDTH_DEFINED)
def test_a_width_defined_level_states_what_it_really_holds(mixer, method, caplog):
    with caplog.at_level(logging.INFO, logger="fedlase"):
        parts = build_parts(config(method))
    params, total = budgeted(parts)
    quarter = parts.levels[1]
    # what the level's clients hold, counted on its submodel's masks (FedAvg-small: the smallest level's slice)
    kept = parts.method.eval_submodel(params, quarter, 1).kept(parts.method.maskable, params)
    assert kept > 3 * parts.method.budget(params, quarter)
    line = next(r for r in caplog.records if r.getMessage().startswith(f"{method} defines a level by its width"))
    assert line.levelno == logging.WARNING   # above the level's budget: a warning, not a note
    assert f"1/4 {kept:,} ({100 * kept / total:.3g}%, above its 25%)" in line.getMessage()


def test_a_width_cut_to_a_single_channel_is_said(mixer, caplog):
    # rate sqrt(1/1024) = 1/32 of 32 channels: every group keeps one
    with caplog.at_level(logging.INFO, logger="fedlase"):
        build_parts(config("heterofl", "{1,1/1024}_{1,1}", "pooled_mixer_t"))
    line = next(r for r in caplog.records if r.getMessage().startswith("heterofl defines a level by its width"))
    assert line.levelno == logging.WARNING
    assert line.getMessage().endswith("; cut to a single channel: 0.weight:0 (1 of 32) at 1/1024, 3.1.weight:0 "
                                      "(1 of 32) at 1/1024, 4.1.weight:0 (1 of 32) at 1/1024")


def test_fedlase_cost_states_the_share_each_level_keeps(mixer, monkeypatch):
    monkeypatch.setattr(cost, "_payload", lambda *a: (0, 0))   # the bytes are not under test (Flower loads slowly)
    parts = build_parts(config("heterofl"))
    params, total = budgeted(parts)
    costs = level_costs(parts.model, parts.method, parts.trainer, parts.levels, parts.level_clients)
    assert [c.share for c in costs] == [c.kept / total for c in costs] and costs[1].share > 0.9
    table = format_cost_table(costs, "heterofl")
    row = next(ln for ln in table.splitlines() if ln.startswith("| 1/4 "))
    assert f"| {costs[1].kept:,} ({100 * costs[1].share:.3g}%) |" in row


def test_every_method_meets_the_level_refuses_it_or_states_it(mixer, caplog):
    # FedAvg is the upper bound by definition: every client holds the whole model whatever its level
    for method in sorted(set(METHODS.names()) - {"fedavg"}):
        caplog.clear()
        try:
            with caplog.at_level(logging.INFO, logger="fedlase"):
                parts = build_parts(config(method))
        except ConfigError as e:
            assert "\n" not in str(e), method
            continue
        params, total = budgeted(parts)
        quarter = parts.levels[1]
        kept = parts.method.eval_submodel(params, quarter, 1).kept(parts.method.maskable, params)
        stated = re.search(rf"1/4 {kept:,} \(", caplog.text)
        assert kept <= parts.method.budget(params, quarter) or stated, method


def test_a_papers_model_is_stated_within_a_hair_of_its_levels(caplog):
    # the CNN: only the image channels and the classes are uncut, so HeteroFL's sqrt keeps about l
    with caplog.at_level(logging.INFO, logger="fedlase"):
        parts = build_parts(fedlase.make_config(dataset="digits", method="heterofl", system="{1,1/4,1/16}_{1,1,1}",
                                                width=0.5, threads=1, device="cpu", out="unused"))
    params, total = budgeted(parts)
    for lvl in parts.levels[1:]:
        kept = parts.method.submodel(params, lvl, 1).kept(parts.method.maskable, params)
        assert float(lvl) < kept / total < 1.05 * float(lvl)
        assert f"{lvl.name} {kept:,} (" in caplog.text
