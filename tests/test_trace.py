"""Channel groups derived by tracing (fedlase/models/trace.py): equal to the hand-written ones of the built-in CNN
and ResNet-18, right on residual blocks fedlase has never seen, concatenations and flattens kept whole, the
sliced-or-masked decision, one-line refusals, and a user's own MLP under every method. The transformer's
comparison is in tests/test_text.py, beside the other tiny BERTs."""
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fedlase
from fedlase.errors import ConfigError
from fedlase.levels import System
from fedlase.methods.heterofl import HeteroFL
from fedlase.model_facts import ModelFacts
from fedlase.models import ResNet18, SmallCNN
from fedlase.models.trace import trace_groups
from fedlase.registry import DATASETS, METHODS, MODELS, temporary

LEVELS = (1.0, 0.25)


def canonical(groups: dict, model: nn.Module) -> dict:
    """Groups renamed g0, g1, ... in order of first appearance (the model's parameter order, dim 0 before dim 1),
    with the parameters no group cuts left out: two mappings that cut the same channels together compare equal."""
    names: dict[str, str] = {}
    return {p: tuple(None if g is None else names.setdefault(g, f"g{len(names)}") for g in groups[p])
            for p, _ in model.named_parameters() if groups.get(p, (None, None)) != (None, None)}


def traced(model: nn.Module, shape: tuple) -> dict:
    return trace_groups(model, torch.randn(2, *shape))


def derive(model: nn.Module, shape: tuple) -> ModelFacts:
    """The model's facts as a width method sees them: two samples kept, groups and `sliceable` derived."""
    facts = ModelFacts.of(model, SimpleNamespace(x_train=torch.randn(2, *shape)))
    facts.channel_groups("heterofl")
    return facts


# ---- the built-in models: derived == hand-written ------------------------------------------------------------
@pytest.mark.parametrize("model, shape", [(SmallCNN(in_channels=1, width=0.25, image_size=8), (1, 8, 8)),
                                          (ResNet18(in_channels=3, width=0.125), (3, 8, 8))],
                         ids=["cnn", "resnet18"])
def test_derived_groups_equal_the_hand_written_ones(model, shape):
    assert canonical(traced(model, shape), model) == canonical(model.channel_groups(), model)


# ---- a model fedlase has never seen: torchvision-style residual blocks -------------------------------------------
class BasicBlock(nn.Module):   # torchvision's layout: conv-bn-relu-conv-bn, identity added, relu
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c // 2, 3, padding=1, bias=False), nn.BatchNorm2d(c // 2)
        self.conv2, self.bn2 = nn.Conv2d(c // 2, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


class Bottleneck(nn.Module):   # 1x1 reduce, 3x3 (stride), 1x1 expand, projected shortcut (`downsample`)
    def __init__(self, cin, mid, cout):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, 2, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, 2, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.downsample(x))


class TinyTorchvisionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.pool = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.layer2 = nn.Sequential(Bottleneck(8, 4, 16))
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.pool(torch.relu(self.bn1(self.conv1(x))))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def test_unseen_residual_blocks_get_the_groups_written_by_hand():
    # written from the architecture: the stem and layer1's block outputs are added (one group, S), each block's
    # inner conv has its own; layer2's expand conv and its projected shortcut are added (E); the classes are never cut
    S, E = "S", "E"
    want = {"conv1.weight": (S, None), "bn1.weight": (S, None), "bn1.bias": (S, None)}
    for b in range(2):
        p, inner = f"layer1.{b}", f"inner{b}"
        want |= {f"{p}.conv1.weight": (inner, S), f"{p}.bn1.weight": (inner, None), f"{p}.bn1.bias": (inner, None),
                 f"{p}.conv2.weight": (S, inner), f"{p}.bn2.weight": (S, None), f"{p}.bn2.bias": (S, None)}
    p = "layer2.0"
    want |= {f"{p}.conv1.weight": ("R", S), f"{p}.bn1.weight": ("R", None), f"{p}.bn1.bias": ("R", None),
             f"{p}.conv2.weight": ("M", "R"), f"{p}.bn2.weight": ("M", None), f"{p}.bn2.bias": ("M", None),
             f"{p}.conv3.weight": (E, "M"), f"{p}.bn3.weight": (E, None), f"{p}.bn3.bias": (E, None),
             f"{p}.downsample.0.weight": (E, S), f"{p}.downsample.1.weight": (E, None),
             f"{p}.downsample.1.bias": (E, None), "fc.weight": (None, E)}
    model = TinyTorchvisionNet()
    facts = derive(model, (3, 8, 8))
    assert canonical(facts.channel_groups(), model) == canonical(want, model)
    assert facts.sliceable() is True   # global pooling before fc: the slice trains as the smaller tensors


def test_concatenated_and_flattened_channels_stay_whole():
    class Inception(nn.Module):   # two branches concatenated; a flatten of a 4x4 map into a linear layer
        def __init__(self):
            super().__init__()
            self.stem, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.b1, self.b2 = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 3, padding=1)
            self.mix = nn.Conv2d(8, 6, 1)
            self.head = nn.Sequential(nn.Linear(6 * 16, 12), nn.ReLU(), nn.Linear(12, 3))

        def forward(self, x):
            x = torch.relu(self.bn(self.stem(x)))
            x = torch.relu(self.mix(torch.cat([self.b1(x), self.b2(x)], 1)))
            return self.head(torch.flatten(nn.functional.avg_pool2d(x, 2), 1))

    g = traced(Inception(), (1, 8, 8))
    stem = g["stem.weight"][0]
    assert stem is not None and g["bn.weight"] == g["stem.bias"] == (stem, None)
    assert g["b1.weight"] == g["b2.weight"] == (None, stem)   # the branches' outputs are concatenated: whole
    assert "b1.bias" not in g and "mix.bias" not in g          # so is mix's input; mix's output is flattened
    assert g["head.0.weight"][1] is None and g["head.0.weight"][0] is not None
    assert g["head.2.weight"] == (None, g["head.0.weight"][0])

    class Rolled(nn.Module):   # channels moved by half the width: sizes agree, indices do not
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.fc3(torch.relu(self.fc2(torch.cat([h[:, 4:], h[:, :4]], 1))))

    g = traced(Rolled(), (4,))
    assert "fc1.weight" not in g and g["fc2.weight"] == ("fc2.weight:0", None)


def test_a_forward_that_cannot_take_the_smaller_tensors_trains_masked():
    class Normed(nn.Module):   # LayerNorm over the cut channels: the small LN is not the masked one
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.norm(self.fc1(x))))

    model = Normed()
    facts = derive(model, (6,))
    assert facts.channel_groups()["norm.weight"] == facts.channel_groups()["fc1.weight"]
    assert facts.sliceable() is False
    quarter = System.parse("{1,1/4}_{1,1}").levels[1]
    sub = HeteroFL.build(model, LEVELS, facts).submodel(dict(model.named_parameters()), quarter, 1)
    assert not sub.slices and int(sub.masks["fc1.weight"].any(1).sum()) == 4   # masks: half of the 8 channels


# ---- channels moved between layers: the trace sees them one to one, the masked forward does not ----------------
SHUFFLES = {
    "view_transpose": lambda h: h.view(h.shape[0], 2, h.shape[1] // 2, *h.shape[2:]).transpose(1, 2).reshape(h.shape),
    "flip": lambda h: h.flip(1),
    "roll": lambda h: torch.roll(h, 1, dims=1),
    "index": lambda h: h[:, torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])],
}


def shuffled_net(kind: str) -> nn.Module:
    class Shuffled(nn.Module):   # conv-bn-relu, its 8 channels moved, conv-bn-relu, global pooling, classifier
        def __init__(self):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            h = SHUFFLES[kind](torch.relu(self.b1(self.c1(x)))) if kind else torch.relu(self.b1(self.c1(x)))
            return self.fc(torch.relu(self.b2(self.c2(h))).mean((2, 3)))

    # a class per kind: the trace's cache is keyed by the model's class and shapes
    return type(f"Shuffled_{kind or 'none'}", (Shuffled,), {})()


@pytest.mark.parametrize("kind", sorted(SHUFFLES))
def test_a_channel_shuffle_is_refused_in_one_line(kind):
    model = shuffled_net(kind)
    # the trace alone takes the moved channels for one to one: c2 reads c1's group
    assert traced(model, (1, 8, 8))["c2.weight"] == ("c2.weight:0", "c1.weight:0")
    with pytest.raises(ConfigError, match=r"model: heterofl slices channels; model Shuffled_\w+ declares no "
                       r"channel_groups\(\) and tracing it failed \(c2 reads [1-4] of its 4 kept input channels "
                       r"from no kept channel and [1-4] dropped ones from kept channels: channels move between "
                       r"layers") as e:
        derive(model, (1, 8, 8))
    assert "\n" not in str(e.value)


def test_the_same_net_without_the_shuffle_slices():
    facts = derive(shuffled_net(""), (1, 8, 8))
    assert facts.sliceable() is True


def test_a_masked_model_whose_channels_stay_in_place_passes_the_check():
    class FixedView(nn.Module):   # a view with a fixed size fails the slice trial; its channels stay in place
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.relu(self.fc1(x)).view(-1, 8)
            return self.fc3(torch.relu(self.fc2(h)))

    facts = derive(FixedView(), (6,))
    assert facts.sliceable() is False and facts.channel_groups()["fc2.weight"][1] is not None


# ---- the check at every set of kept channels a run uses (issue 56 items 10-11) ----------------------------------
def moved_net(move, norm=None, squash=None) -> nn.Module:
    """conv, `norm`, `squash`, its 8 channels moved by `move`, conv, global pooling, classifier (1x8x8 inputs);
    a class per call (the trace's cache is keyed by the model's class and shapes)."""
    class Moved(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.fc = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, 10)
            self.norm = norm() if norm else nn.Identity()

        def forward(self, x):
            h = self.norm(self.c1(x))
            h = move((squash or torch.relu)(h))
            return self.fc(torch.relu(self.c2(h)).mean((2, 3)))
    return type(f"Moved{next(_SERIAL)}", (Moved,), {})()


_SERIAL = iter(range(10 ** 6))
WITHIN_HALVES = torch.tensor([3, 2, 1, 0, 7, 6, 5, 4])


def pair_swap(h):   # computed from the tensor's size: it runs on the smaller tensors too
    return h.view(h.shape[0], h.shape[1] // 2, 2, *h.shape[2:]).flip(2).reshape(h.shape)


def test_a_permutation_within_the_halves_is_refused_at_the_level_it_breaks():
    """[3,2,1,0,7,6,5,4] keeps the prefix half in place, so the trace's own check passes; at 1/16 (2 of 8
    channels) c2 reads dropped channels on its kept inputs: refused in one line when HeteroFL is built."""
    model = moved_net(lambda h: h.index_select(1, WITHIN_HALVES))
    facts = derive(model, (1, 8, 8))
    HeteroFL.build(model, System.parse("{1,1/4}_{1,1}"), facts)   # half width: in place
    with pytest.raises(ConfigError, match=r"model: heterofl slices channels; model Moved\d+ declares no "
                       r"channel_groups\(\) and tracing it failed \(c2 reads 2 of its 2 kept input channels from "
                       r"no kept channel and 2 dropped ones from kept channels: channels move between layers") as e:
        HeteroFL.build(model, System.parse("{1,1/4,1/16}_{1,1,1}"), facts)
    assert "\n" not in str(e.value)


def test_a_pair_swap_is_refused_under_fedrolexs_rolled_windows():
    """A pair swap computed from the size runs on the smaller tensors and keeps every prefix window in place
    (HeteroFL takes it, sliced); FedRolex's window rolled by one keeps channels 7, 0, 1, 2, whose smaller tensors
    pair 2 with 7: refused in one line when FedRolex is built, for every level."""
    from fedlase.methods.fedrolex import FedRolex
    model = moved_net(pair_swap)
    facts = derive(model, (1, 8, 8))
    assert facts.sliceable() is True
    system = System.parse("{1,1/4,1/16}_{1,1,1}")
    HeteroFL.build(model, system, facts)
    with pytest.raises(ConfigError, match=r"model: fedrolex slices channels; .* tracing it failed \(as the smaller "
                       r"tensors it differs from its masks with \d+ of its \d+ channels kept: channels move") as e:
        FedRolex.build(model, system, facts)
    assert "\n" not in str(e.value)


def test_fedlase_widths_chosen_channels_are_checked_when_first_used():
    """fedlase_width keeps the channels its scores choose, which no build-time window foresees: the
    within-halves permutation passes at the prefix half and is refused at the first submodel whose channels
    it moves."""
    from fedlase.methods.fedlase_width import FedLASEWidth
    model = moved_net(lambda h: h.index_select(1, WITHIN_HALVES))
    facts = derive(model, (1, 8, 8))
    method = FedLASEWidth.build(model, System.parse("{1,1/16}_{1,1}"), facts, channels="first")
    with pytest.raises(ConfigError, match=r"c2 reads \d+ of its \d+ kept input channels from no kept channel"):
        method.submodel(dict(model.named_parameters()), method.system.levels[1], 1)


@pytest.fixture
def gn_sigmoid():
    """A model that moves no channel, whose dropped channels read 0.5 under the masks (GroupNorm, then a
    sigmoid), registered for a run on digits."""
    with temporary(MODELS):
        fedlase.register_model("gn_sigmoid_t", lambda cfg, data: moved_net(lambda h: h, norm=lambda: nn.GroupNorm(2, 8),
                                                                          squash=torch.sigmoid))
        yield


@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_a_model_whose_dropped_channels_read_a_constant_is_accepted_and_trains(gn_sigmoid, method, tmp_path):
    """GroupNorm over the cut channels trains masked; a dropped channel reads sigmoid(0) = 0.5, a constant its
    consumer's masked weights ignore: accepted (it was refused as "dropped as live") and trained."""
    cfg = fedlase.make_config(dataset="digits", model="gn_sigmoid_t", method=method, system="{1,1/4,1/16}_{1,1,1}",
                              rounds=2, local_steps=1, batch_size=16, threads=1, device="cpu", checkpoint_every=0,
                              out=str(tmp_path / method))
    levels = fedlase.run(cfg)["final"]["levels"]
    assert all(math.isfinite(v["global_acc"]) for v in levels.values())
    assert levels["1/16"]["kept"] < levels["1/4"]["kept"] < levels["1"]["kept"]


# ---- own hooks win; failures are one line ------------------------------------------------------------------------
def test_a_models_own_hooks_win_and_built_ins_never_import_torch_pruning():
    sys.modules.pop("torch_pruning", None)
    HeteroFL(SmallCNN(width=0.25), LEVELS)
    assert "torch_pruning" not in sys.modules

    class Declared(nn.Sequential):
        sliceable = False   # its own choice, kept although the trace would allow slicing

    facts = derive(Declared(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), (4,))
    assert facts.known_groups() is not None and facts.sliceable() is False


def test_a_model_that_cannot_be_traced_gets_one_line():
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            with torch.no_grad():
                return self.fc(x)

    with pytest.raises(ConfigError, match=r"model: heterofl slices channels; model NoGrad declares no "
                       r"channel_groups\(\) and tracing it failed \(.*\): write channel_groups\(\)") as e:
        derive(NoGrad(), (4,))
    assert "\n" not in str(e.value)

    class UnitsOnly(nn.Sequential):
        def group_units(self):
            return {}
    with pytest.raises(ConfigError, match=r"declares group_units\(\) but no channel_groups\(\)"):
        HeteroFL(UnitsOnly(nn.Linear(4, 2)), LEVELS)


# ---- a user's own MLP on tabular data, registered through the public API, under every method ---------------------
def _load_tabular(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 30, generator=g)
    y = (x @ torch.randn(30, 5, generator=g)).argmax(1)   # five classes, learnable from the features
    return fedlase.Dataset("tabular", x[:96], y[:96], x[96:], y[96:], num_classes=5)


def _mlp(cfg, data):
    return nn.Sequential(nn.Linear(30, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 5))


@pytest.fixture
def tabular():
    with temporary(DATASETS, MODELS):
        fedlase.register_dataset("tabular_t", _load_tabular, num_classes=5, shape=(30,))
        fedlase.register_model("mlp_t", _mlp)
        yield


REFUSED = {"depthfl": r"depthfl needs a model with stages; Sequential declares no stages",
           # low-rank 3x3 convolutions: an MLP has none to factorize
           "fedlmt": r"fedlmt: Sequential declares no blocks to factorize",
           "pfedlmt": r"pfedlmt: Sequential declares no blocks to factorize",
           # a hypernetwork over its two declared architectures (refused at validation)
           "recipfl": r"method recipfl runs on model lenet or resnet18 only",
           # adapter methods aggregate LoRA adapters, which a run without `lora` has none of
           **{m: r"aggregates LoRA adapters; set lora" for m in ("hetlora", "flexlora", "flora", "lora_fedavg")}}


def test_a_users_mlp_trains_under_every_method_that_can_serve_it(tabular, tmp_path):
    run = dict(dataset="tabular_t", model="mlp_t", system="{1,1/4}_{1,1}", rounds=2, local_steps=1,
               batch_size=16, threads=1, device="cpu", checkpoint_every=0)
    for method in METHODS.names():
        if method in REFUSED:
            with pytest.raises(ConfigError, match=REFUSED[method]):
                fedlase.run(fedlase.make_config(**run, method=method, out=str(tmp_path / method)))
            continue
        cfg = fedlase.make_config(**run, method=method, out=str(tmp_path / method))
        levels = fedlase.run(cfg)["final"]["levels"]
        assert all(math.isfinite(v["global_acc"]) for v in levels.values()), method
        if method not in ("fedavg", "fedavg_small"):   # every client trains the same model under these two
            assert levels["1/4"]["kept"] < levels["1"]["kept"], method
    # FedLASE keeps the first and last layers whole: a 1/64 level cannot hold them (its own one-line reason)
    with pytest.raises(ConfigError, match=r"level 0.015625 allows 1172 parameters, fewer than the 9477 of the first "
                       "and last layers"):
        fedlase.run(fedlase.make_config(**{**run, "system": "{1,1/64}_{1,1}"}, method="fedlase",
                                        out=str(tmp_path / "f64")))


def test_the_mlp_trains_as_the_smaller_dense_model(tabular):
    from fedlase.client import build_model_for
    cfg = fedlase.make_config(dataset="tabular_t", model="mlp_t", method="heterofl", system="{1,1/4}_{1,1}",
                              out="unused")
    data = _load_tabular(cfg)
    model = build_model_for(cfg, data)
    method = HeteroFL.build(model, cfg.levels, ModelFacts.of(model, data))
    sub = method.submodel(dict(model.named_parameters()), cfg.levels.levels[1], 1)
    small = sub.gather(dict(model.named_parameters()))
    assert method.facts.sliceable() is True   # width rate 1/2 of a 1/4 level: hidden layers of 128
    assert [tuple(small[f"{i}.weight"].shape) for i in (0, 2, 4)] == [(128, 30), (128, 128), (5, 128)]


# ---- what fedlase learns about a model is kept beside it (fedlase/model_facts.py), never set on it -----------------
def _attributes(model: nn.Module) -> tuple[set, set]:
    return set(model.__dict__), set(vars(type(model)))


@pytest.mark.parametrize("method, model_name", [("fjord", "mlp_t"), ("fedlase_width", "mlp_t"),
                                                ("fedlmt", "cnn_t"), ("pfedlmt", "cnn_t")])
def test_building_a_run_sets_no_attribute_on_the_model(tabular, method, model_name, tmp_path):
    from fedlase.engine import build_parts
    from fedlase.models import build_model
    seen = []

    def recorded(dense):
        def build(cfg, data):   # the model as its builder made it, before the method prepares or reads it
            model = dense(cfg, data)
            seen.append((model, _attributes(model)))
            return METHODS.get(cfg.method).prepare_model_for(model, cfg.method_args, cfg.levels)
        return build

    fedlase.register_model("cnn_t", recorded(lambda cfg, d: build_model("cnn", d.in_channels, d.num_classes, cfg.width,
                                                                        cfg.bn, d.image_size)))
    fedlase.register_model("mlp_t", recorded(_mlp), replace=True)
    dataset = "tabular_t" if model_name == "mlp_t" else "digits"
    cfg = fedlase.make_config(dataset=dataset, model=model_name, method=method, system="{1,1/4}_{1,1}", width=0.25,
                              threads=1, device="cpu", out=str(tmp_path / "run"))
    p = build_parts(cfg)
    params = dict(p.model.named_parameters())
    for lvl in p.levels:
        p.method.submodel(params, lvl, 1)
    model, before = seen[-1]   # (the config's validation builds one on torch's meta device first)
    assert p.model is model and p.method.facts is p.facts
    assert _attributes(model) == before
    if model_name == "mlp_t":   # traced: the groups and the samples are in the facts, not on the model
        assert p.facts.known_groups() and p.facts.example is not None and not hasattr(model, "channel_groups")
    else:   # the low-rank plan is the method's: each level's rank ratio, nested
        assert p.method.alphas["1"] >= p.method.alphas["1/4"] > 0


def test_a_plugin_method_of_any_signature_reads_the_runs_facts_in_its_constructor():
    class Explicit(fedlase.Method):   # today's signature without **options: built through Method.build unchanged
        name = "explicit_t"

        def __init__(self, model, system, run_seed=None):
            super().__init__(model, system, run_seed=run_seed)
            self.groups = self.facts.channel_groups(self.name)

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    facts = ModelFacts.of(model, SimpleNamespace(x_train=torch.randn(3, 4)))
    method = Explicit.build(model, LEVELS, facts, run_seed=1)
    assert method.facts is facts and method.seed == 1 and method.groups["0.weight"] == ("0.weight:0", None)
    with pytest.raises(ConfigError, match=r"explicit_t slices channels; model Sequential declares no "
                       r"channel_groups\(\) and was built outside a run"):
        Explicit(model, LEVELS)   # built directly: the model's own hooks alone, no sample to trace with
