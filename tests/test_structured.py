"""Tests for the structured baselines HeteroFL and FedRolex: width-slice masks, the rolling window, the
scaler, and that a masked dense model computes what the physically sliced smaller model computes."""
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from conftest import counted_over, digits_test_size
from fedlase.engine import run_experiment
from fedlase.errors import ConfigError
from fedlase.evaluate import recompute_bn_stats
from fedlase.methods import build_method
from fedlase.methods.fedrolex import FedRolex
from fedlase.methods.heterofl import HeteroFL
from fedlase.models import ResNet18, SmallCNN

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics

LEVELS = [1.0, 1 / 4, 1 / 16, 1 / 64]


def params_of(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def full_mask(sub, name, params):
    """A submodel's mask of a parameter; absent means the whole parameter."""
    return sub.masks.get(name, torch.ones_like(params[name], dtype=torch.bool))


def kept_out(mask):
    """Output channels (dim 0) that hold any kept coordinate."""
    return set(torch.nonzero(mask.reshape(mask.shape[0], -1).any(1)).flatten().tolist())


def kept_in(mask):
    """Input channels (dim 1) that hold any kept coordinate."""
    return set(torch.nonzero(mask.transpose(0, 1).reshape(mask.shape[1], -1).any(1)).flatten().tolist())


def feeding_edges(model):
    """(consumer, producer) pairs written from the architecture, independently of channel_groups(): the
    consumer's input channels are the producer's output channels. BN parameters are listed with their conv.
    In a ResNet, every output added into the residual stream feeds the next consumers of that stream."""
    edges = []
    if isinstance(model, SmallCNN):
        convs = [f"features.{i}" for i, m in enumerate(model.features) if isinstance(m, nn.Conv2d)]
        for prev, cur in zip(convs, convs[1:]):
            edges.append((f"{cur}.weight", f"{prev}.weight"))
        edges.append(("classifier.weight", f"{convs[-1]}.weight"))
        for i, m in enumerate(model.features):
            if isinstance(m, nn.BatchNorm2d):
                edges += [(f"features.{i}.weight", f"features.{i - 1}.weight"),
                          (f"features.{i}.bias", f"features.{i - 1}.weight")]
        return edges
    stream = ["conv1.weight"]
    edges += [("bn1.weight", "conv1.weight"), ("bn1.bias", "conv1.weight")]
    for s in range(1, 5):
        for b in range(2):
            p = f"layer{s}.{b}"
            edges += [(f"{p}.conv1.weight", x) for x in stream]
            edges += [(f"{p}.conv2.weight", f"{p}.conv1.weight")]
            edges += [(f"{p}.bn1.{k}", f"{p}.conv1.weight") for k in ("weight", "bias")]
            edges += [(f"{p}.bn2.{k}", f"{p}.conv2.weight") for k in ("weight", "bias")]
            if len(getattr(model, f"layer{s}")[b].shortcut):
                edges += [(f"{p}.shortcut.0.weight", x) for x in stream]
                edges += [(f"{p}.shortcut.1.{k}", f"{p}.shortcut.0.weight") for k in ("weight", "bias")]
                stream = [f"{p}.conv2.weight", f"{p}.shortcut.0.weight"]
            else:
                stream = stream + [f"{p}.conv2.weight"]
    edges += [("linear.weight", x) for x in stream]
    return edges


MODELS = {"cnn": lambda: SmallCNN(width=0.5), "resnet18": lambda: ResNet18(width=0.25)}


# --------------------------------------------------------------------------- masks


@pytest.mark.parametrize("arch", MODELS)
def test_heterofl_masks_are_nested_across_levels(arch):
    model = MODELS[arch]()
    method, params = HeteroFL(model, LEVELS), params_of(model)
    subs = [method.submodel(params, lvl, 1) for lvl in LEVELS]   # 1, 1/4, 1/16, 1/64
    for big, small in zip(subs, subs[1:]):
        for name in method.maskable:
            b, s = full_mask(big, name, params), full_mask(small, name, params)
            assert not (s & ~b).any(), name
            if name in small.masks and params[name].dim() > 1:
                assert s.sum() < b.sum(), name   # strictly smaller where sliced


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("method_cls,rnd", [(HeteroFL, 1), (FedRolex, 1), (FedRolex, 7), (FedRolex, 45)])
def test_kept_inputs_are_kept_outputs_of_the_feeding_layer(arch, method_cls, rnd):
    model = MODELS[arch]()
    method, params = method_cls(model, LEVELS), params_of(model)
    for lvl in LEVELS[1:]:
        sub = method.submodel(params, lvl, rnd)
        for consumer, producer in feeding_edges(model):
            c, p = full_mask(sub, consumer, params), full_mask(sub, producer, params)
            got = kept_in(c) if c.dim() > 1 else kept_out(c)
            assert got == kept_out(p), (lvl, consumer, producer)
        for name in method.maskable:   # every mask is a rectangle: kept outputs x kept inputs
            m = full_mask(sub, name, params)
            if m.dim() > 1:
                assert int(m.sum()) == len(kept_out(m)) * len(kept_in(m)) * m[0, 0].numel(), name
        assert kept_out(sub.masks["linear.weight" if arch == "resnet18" else "classifier.weight"]) == set(range(10))


def test_feeding_edges_cover_every_sliced_input():
    for arch, make in MODELS.items():
        model = make()
        consumers = {c for c, _ in feeding_edges(model)}
        sliced_in = {n for n, (_, g) in model.channel_groups().items() if g is not None}
        assert sliced_in <= consumers, arch


@pytest.mark.parametrize("make", [SmallCNN, lambda: ResNet18(num_classes=10)])
def test_kept_fraction_is_close_to_the_level(make):
    model = make()
    method, params = HeteroFL(model, LEVELS), params_of(model)
    total = sum(params[n].numel() for n in method.maskable)
    for lvl in LEVELS:
        frac = method.submodel(params, lvl, 1).kept(method.maskable, params) / total
        # ceil() and the unsliced image channels / classes keep slightly more than the level, never less
        assert lvl <= frac <= 1.07 * lvl, (lvl, frac)


def test_level_maps_to_width_rate():
    model = SmallCNN()   # conv widths 32, 64, 128, 256
    method, params = HeteroFL(model, LEVELS), params_of(model)
    for lvl, rate in zip(LEVELS, [1, 1 / 2, 1 / 4, 1 / 8]):
        m = full_mask(method.submodel(params, lvl, 1), "features.12.weight", params)   # the 256-channel conv
        assert kept_out(m) == set(range(int(256 * rate)))
    m = method.submodel(params, 0.3, 1).masks["features.12.weight"]   # rate sqrt(0.3) = 0.5477
    assert kept_out(m) == set(range(math.ceil(256 * math.sqrt(0.3))))


# --------------------------------------------------------------------------- FedRolex window


def test_fedrolex_window_follows_the_official_formula():
    model = SmallCNN(width=0.25)   # conv widths 8, 16, 32, 64
    method, params = FedRolex(model, LEVELS), params_of(model)
    convs = {"features.0.weight": 8, "features.4.weight": 16, "features.8.weight": 32, "features.11.weight": 64}
    for rnd in [1, 2, 3, 8, 9, 10, 17, 40, 100]:
        r = rnd - 1   # the official round counter starts at 0
        sub = method.submodel(params, 1 / 4, rnd)
        for name, k_total in convs.items():
            k = math.ceil(k_total / 2)
            assert kept_out(sub.masks[name]) == {(-r + i) % k_total for i in range(k)}, (rnd, name)
    # by hand: round 3 (r = 2), 8 channels, keep 4 -> channels 6, 7, 0, 1 (wrapped past the end)
    assert kept_out(method.submodel(params, 1 / 4, 3).masks["features.0.weight"]) == {6, 7, 0, 1}
    assert kept_out(method.submodel(params, 1 / 4, 1).masks["features.0.weight"]) == {0, 1, 2, 3}


def test_fedrolex_evaluates_the_window_of_the_round_just_trained():
    model = SmallCNN(width=0.25)
    method, params = FedRolex(model, LEVELS), params_of(model)
    for rnd in (1, 5, 12):
        a, b = method.submodel(params, 1 / 16, rnd), method.eval_submodel(params, 1 / 16, rnd)
        assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks)
    first, later = (HeteroFL(model, LEVELS).submodel(params, 1 / 4, rnd) for rnd in (1, 9))
    assert all(torch.equal(first.masks[n], later.masks[n]) for n in first.masks)   # HeteroFL never rolls


# --------------------------------------------------------------------------- scaler


@pytest.mark.parametrize("arch", MODELS)
def test_scaler_scales_conv_outputs_in_training_only(arch):
    # the scaler is folded into the conv weights (Submodel.scales): every BN's input is its conv's unscaled
    # output times 1/rate in training (the official placement), and evaluation never scales
    torch.manual_seed(0)
    model = MODELS[arch]()
    params = params_of(model)
    on = HeteroFL(model, LEVELS).submodel(params, 1 / 16, 1)
    off = HeteroFL(model, LEVELS, scaler=False).submodel(params, 1 / 16, 1)
    assert set(on.scales) == set(model.scaler_names()) and set(on.scales.values()) == {4.0} and off.scales == {}
    assert on.buffers == {} and off.buffers == {}
    assert on.masks.keys() == off.masks.keys() and all(torch.equal(on.masks[n], off.masks[n]) for n in on.masks)
    x = torch.randn(6, 1 if arch == "cnn" else 3, 16, 16)
    bufs = dict(model.named_buffers())
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, i, name=name: seen.__setitem__(name, i[0]))
             for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]

    def run(sub, train):
        model.train(train)
        seen.clear()
        out = functional_call(model, (sub.apply(params, train=train), bufs), (x,))
        return out, dict(seen)

    (train_on, bn_on), (train_off, bn_off) = run(on, True), run(off, True)
    assert len(bn_on) == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    for bn in bn_on:   # BN normalises, so each BN's input is the conv output: x4 exactly (a power of two)
        if bn in ("bn1", "features.1"):
            assert torch.equal(bn_on[bn], bn_off[bn] * 4.0), bn
    for h in hooks:
        h.remove()
    assert not torch.equal(train_on, train_off)   # BN normalises the scale away, but for its eps
    assert torch.equal(run(on, False)[0], run(off, False)[0])   # evaluation never scales


def test_models_apply_no_scaler_themselves():
    torch.manual_seed(0)
    model = SmallCNN(width=0.25).train()
    x = torch.randn(5, 1, 28, 28)
    y = functional_call(model, ({}, {}), (x,))
    ref = model.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(model.features(x), 1), 1))
    assert torch.equal(y, ref)
    for m in (SmallCNN(), ResNet18()):
        assert not any("width_scale" in n for n, _ in m.named_buffers())
        convs = {f"{n}.weight" for n, mod in m.named_modules() if isinstance(mod, nn.Conv2d)}
        assert set(m.scaler_names()) == convs   # every conv (all bias-free) carries the scaler


# --------------------------------------------------------------------------- masked == physically sliced


def sliced_params(sub, params, small):
    """The sliced weights of `sub`, shaped for the smaller model. Kept channels are taken in index order,
    a consistent permutation of FedRolex's window order, which leaves the network's function unchanged."""
    out = {}
    for name, p in small.named_parameters():
        full = params[name]
        out[name] = full[sub.masks[name]].reshape(p.shape) if name in sub.masks else full
        assert out[name].shape == p.shape, name
    return out


def randomized(model, seed=0):
    """Random weights everywhere, BN affine parameters included (so masking them matters)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) for n, p in model.named_parameters()}


CASES = [  # (make(width, bn), full width, method, level, round)
    (lambda w, bn: SmallCNN(width=w, bn=bn, image_size=16), 0.25, HeteroFL, 1 / 4, 1),
    (lambda w, bn: SmallCNN(width=w, bn=bn, image_size=16), 0.25, HeteroFL, 1 / 16, 1),
    (lambda w, bn: SmallCNN(width=w, bn=bn, image_size=16), 0.25, FedRolex, 1 / 4, 11),   # wrapped window
    (lambda w, bn: ResNet18(width=w, bn=bn, in_channels=1), 1 / 8, HeteroFL, 1 / 4, 1),
    (lambda w, bn: ResNet18(width=w, bn=bn, in_channels=1), 1 / 8, FedRolex, 1 / 16, 6),
]


@pytest.mark.parametrize("make,width,method_cls,level,rnd", CASES)
@pytest.mark.parametrize("bn", ["static", "batch"])
def test_masked_forward_equals_sliced_model(make, width, method_cls, level, rnd, bn):
    torch.manual_seed(0)
    big, small = make(width, bn), make(width * math.sqrt(level), bn)
    params = randomized(big)
    sub = method_cls(big, LEVELS, scaler=False).submodel(params, level, rnd)
    weights, small_weights = sub.apply(params), sliced_params(sub, params, small)
    g = torch.Generator().manual_seed(1)
    x_train, x = torch.randn(64, 1, 16, 16, generator=g), torch.randn(16, 1, 16, 16, generator=g)
    big_bufs, small_bufs = dict(big.named_buffers()), dict(small.named_buffers())
    with torch.no_grad():
        if bn == "static":   # HeteroFL's sBN: stats of the slice recomputed, then evaluation
            big_bufs = recompute_bn_stats(big, weights, big_bufs, x_train, 16)
            small_bufs = recompute_bn_stats(small, small_weights, small_bufs, x_train, 16)
            big.eval(), small.eval()
        else:   # batch statistics in a training-mode forward
            big.train(), small.train()
        want = functional_call(small, (small_weights, small_bufs), (x,))
        got = functional_call(big, (weights, big_bufs), (x,))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


# --------------------------------------------------------------------------- options and end to end


def test_options_are_validated():
    model = SmallCNN(width=0.25)
    with pytest.raises(ConfigError, match="method_args.scaler"):
        build_method("heterofl", model, {"scaler": 1}, LEVELS)
    with pytest.raises(ConfigError, match="method_args.roll"):
        build_method("fedrolex", model, {"roll": 2}, LEVELS)
    with pytest.raises(ConfigError, match="channel_groups"):
        HeteroFL(nn.Sequential(nn.Linear(3, 2)), LEVELS, scaler=False)
    class NoScaler(nn.Module):   # a sliceable model that names no layers for the scaler
        def channel_groups(self):
            return {}
    no_scale = NoScaler()
    with pytest.raises(ConfigError, match="scaler_names"):
        HeteroFL(no_scale, LEVELS, scaler=True)
    assert HeteroFL(no_scale, LEVELS).scaler is False   # unset: nothing named, nothing scaled
    HeteroFL(no_scale, LEVELS, scaler=False)


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_two_round_run_on_digits(tiny_cfg, method):
    cfg = tiny_cfg(f"method={method}", "system={1,1/4,1/16,1/64}_{1,1,1,1}", "bn=static")
    last = run_experiment(cfg, progress=False)["final"]
    accs = [v["global_acc"] for v in last["levels"].values()] + [v["local_acc"] for v in last["levels"].values()]
    assert len(last["levels"]) == 4 and all(math.isfinite(a) for a in accs)
    assert all(counted_over(v["global_acc"], digits_test_size()) for v in last["levels"].values())
    kept = [v["kept"] for v in last["levels"].values()]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]


def test_static_slices_are_built_once_and_rolling_ones_every_round():
    model = SmallCNN(width=0.5)
    params = {n: p.detach() for n, p in model.named_parameters()}
    het, rolex = HeteroFL(model, [1.0, 0.25]), FedRolex(model, [1.0, 0.25])
    small = build_method("fedavg_small", model, {}, [1.0, 0.25])
    assert het.submodel(params, 0.25, 1) is het.submodel(params, 0.25, 7)            # static: one build
    assert small.submodel(params, 1.0, 1) is small.submodel(params, 0.25, 3)          # one slice for all
    a, b = rolex.submodel(params, 0.25, 1), rolex.submodel(params, 0.25, 2)
    assert a is not b and any(not torch.equal(a.masks[n], b.masks[n]) for n in a.masks)
    fresh = HeteroFL(model, [1.0, 0.25]).submodel(params, 0.25, 1)                     # same as uncached
    cached = het.submodel(params, 0.25, 9)
    assert all(torch.equal(fresh.masks[n], cached.masks[n]) for n in fresh.masks)
    assert fresh.slices.keys() == cached.slices.keys()
    for n, idx in fresh.slices.items():
        assert all((i is None and j is None) or torch.equal(i, j) for i, j in zip(idx, cached.slices[n]))
