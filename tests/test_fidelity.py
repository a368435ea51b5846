"""Fidelity to the official codes (issue 12): the server's coverage rule (FIARSE's `nonzero` and the structural
`kept`), the paper straight-through gradient at tau = 0, the interleaved balanced-Dirichlet fill, the official
evaluation order, and the structured baselines' gradient clipping and label-split masking."""
import numpy as np
import pytest
import torch
from torch import nn

from fedlase.aggregate import COVERAGES, Aggregator, aggregate, channel_owners, kept_credit
from fedlase.client import local_work
from fedlase.data.partition import balanced_dirichlet, partition
from fedlase.evaluate import global_eval_set, predict
from fedlase.masks import Submodel, threshold_mask
from fedlase.models import build_model
from fedlase.train import (
    LocalWork,
    class_keep,
    classifier_names,
    label_mask_logits,
    label_split_masks,
    local_train,
    restrict_submodel,
)

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics

T = torch.tensor


# --------------------------------------------------------------------------- coverage rule

def test_official_rule_divides_by_the_clients_that_moved():
    # Prepare: coordinate 0 is held by all three clients, client 2 returns exactly 0 there;
    # coordinate 1 is held by clients 1 and 3, neither moves it; coordinate 2 is held by nobody
    glob = {"w": T([10.0, 20.0, 30.0])}
    full = T([True, True, False])
    updates = [({"w": T([2.0, 0.0, 0.0])}, Submodel({"w": full})),
               ({"w": T([0.0, 0.0, 0.0])}, Submodel({"w": T([True, False, False])})),
               ({"w": T([4.0, 0.0, 0.0])}, Submodel({"w": full}))]
    # Execute
    official = aggregate(glob, updates, coverage="nonzero")
    by_mask = aggregate(glob, updates, coverage="mask")
    # Assert: official step = sum / 2 = 3 (the zero is not averaged in); the mask rule divides by 3.
    # A coordinate nobody moved stays (the official 0/0 -> nan_to_num -> 0), as does one nobody held.
    assert torch.equal(official["w"], T([13.0, 20.0, 30.0]))
    assert torch.equal(by_mask["w"], T([12.0, 20.0, 30.0]))


def test_official_rule_counts_unmasked_parameters_by_their_deltas_too():
    # A BatchNorm-like parameter has no mask: the mask rule counts every client, the official rule only the
    # clients whose value changed.
    glob = {"bn": T([1.0, 1.0])}
    updates = [({"bn": T([0.5, 0.0])}, Submodel()), ({"bn": T([0.25, 0.0])}, Submodel()),
               ({"bn": T([0.0, 0.3])}, Submodel())]
    assert torch.equal(aggregate(glob, updates, coverage="nonzero")["bn"], T([1.375, 1.3]))
    assert torch.allclose(aggregate(glob, updates, coverage="mask")["bn"], T([1.25, 1.1]))


def random_round(model: nn.Module, clients: int = 4, seed: int = 0):
    """Masked deltas whose every credited coordinate is nonzero: weight masks random but keeping at least one
    weight in every output channel, deltas nonzero (|N(0,1)| + 0.1, random sign) exactly on the masks."""
    g = torch.Generator().manual_seed(seed)
    glob = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    updates = []
    for _ in range(clients):
        masks = {}
        for n, p in glob.items():
            if p.dim() > 1:
                m = torch.rand(p.shape, generator=g) < 0.3
                flat = m.view(m.shape[0], -1)
                flat[torch.arange(m.shape[0]), torch.randint(flat.shape[1], (m.shape[0],), generator=g)] = True
                masks[n] = m
        delta = {}
        for n, p in glob.items():
            d = (torch.randn(p.shape, generator=g).abs() + 0.1) * torch.randn(p.shape, generator=g).sign()
            delta[n] = d * masks[n] if n in masks else d
        updates.append((delta, Submodel(masks)))
    return glob, updates


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
@pytest.mark.parametrize("mode", ["coverage", "mean"])
def test_coverage_changes_nothing_when_every_credited_delta_is_nonzero(name, mode):
    # Prepare
    model = build_model(name, in_channels=3, num_classes=10, width=0.0625 if name == "resnet18" else 0.25,
                        image_size=32)
    glob, updates = random_round(model)
    owners = channel_owners(model)
    # Execute
    results = [aggregate(glob, updates, mode, cov, owners) for cov in COVERAGES]
    # Assert: bit for bit the same model under every rule
    for other in results[1:]:
        assert all(torch.equal(results[0][n], other[n]) for n in glob)


class ConvBN(nn.Sequential):
    """A conv (2 out channels, with bias) and its BN, declaring their channel group as the bundled models do."""

    def __init__(self):
        super().__init__(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))

    def channel_groups(self):
        return {"0.weight": ("g", None), "0.bias": ("g", None), "1.weight": ("g", None), "1.bias": ("g", None)}


def test_kept_credits_a_channel_only_when_it_keeps_a_weight():
    # Prepare: conv (2 out channels) with bias, then its BN. Client A keeps only channel 0's weights, client B
    # both channels. Every returned delta is nonzero, also A's on channel 1's bias/BN (a dead channel still
    # moves its BN shift).
    model = ConvBN()
    owners = channel_owners(model)
    assert owners == {"0.bias": ["0.weight"], "1.weight": ["0.weight"], "1.bias": ["0.weight"]}
    glob = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    a_mask = {"0.weight": T([True, False]).view(2, 1, 1, 1)}
    b_mask = {"0.weight": T([True, True]).view(2, 1, 1, 1)}
    a = ({"0.weight": T([1.0, 0.0]).view(2, 1, 1, 1), "0.bias": T([1.0, 5.0]), "1.weight": T([1.0, 5.0]),
          "1.bias": T([1.0, 5.0])}, Submodel(a_mask))
    b = ({"0.weight": T([3.0, 2.0]).view(2, 1, 1, 1), "0.bias": T([3.0, 2.0]), "1.weight": T([3.0, 2.0]),
          "1.bias": T([3.0, 2.0])}, Submodel(b_mask))
    # Execute
    new = aggregate(glob, [a, b], coverage="kept", owners=owners)
    # Assert: channel 0 averages both clients (2); channel 1 takes only B's value (A's 5 is dropped)
    for n in ("0.bias", "1.weight", "1.bias"):
        assert torch.equal(new[n], T([2.0, 2.0])), n
    assert torch.equal(new["0.weight"].flatten(), T([2.0, 2.0]))
    # the mask rule would average A's 5 into channel 1: (5 + 2) / 2
    assert torch.equal(aggregate(glob, [a, b], coverage="mask")["1.bias"], T([2.0, 3.5]))


def test_kept_credits_a_residual_bn_while_its_stage_channel_lives():
    # A residual stage: two producers of group "s" (a block conv and a shortcut conv), each followed by its BN.
    # The client drops the block conv's channel 1 but the shortcut keeps it: the stage's channel 1 is alive, so
    # the block BN's shift there (a constant added to a live signal) is credited; channel 1 of neither: not.
    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 2, 1, bias=False), nn.BatchNorm2d(2)
            self.short, self.sbn = nn.Conv2d(1, 2, 1, bias=False), nn.BatchNorm2d(2)

        def channel_groups(self):
            return {n: ("s", None) for n in ("conv.weight", "bn.weight", "bn.bias", "short.weight", "sbn.weight",
                                             "sbn.bias")}
    owners = channel_owners(Stage())
    assert owners["bn.bias"] == owners["sbn.weight"] == ["conv.weight", "short.weight"]
    conv = T([True, False]).view(2, 1, 1, 1)
    live = kept_credit(Submodel({"conv.weight": conv, "short.weight": T([True, True]).view(2, 1, 1, 1)}),
                       ["bn.bias"], owners)
    dead = kept_credit(Submodel({"conv.weight": conv, "short.weight": conv}), ["bn.bias"], owners)
    assert torch.equal(live["bn.bias"], T([True, True])) and torch.equal(dead["bn.bias"], T([True, False]))
    # an owner kept whole (no mask) keeps every channel: no credit mask at all
    assert kept_credit(Submodel({"conv.weight": conv}), ["bn.bias"], owners) == {}


def test_kept_credit_ands_a_masked_bias_with_its_channel():
    sub = Submodel({"l.weight": T([[True, False], [False, False], [True, True]]), "l.bias": T([False, True, True])})
    credit = kept_credit(sub, ["l.weight", "l.bias"], {"l.bias": ["l.weight"]})
    assert torch.equal(credit["l.bias"], T([False, False, True]))
    assert torch.equal(credit["l.weight"], sub.masks["l.weight"])


def test_channel_owners_of_the_bundled_models():
    # from the models' channel_groups(): a BN follows every weight of its output group
    cnn = channel_owners(build_model("cnn", in_channels=1, num_classes=10, width=0.25, image_size=28))
    assert cnn["features.1.weight"] == cnn["features.1.bias"] == ["features.0.weight"]
    assert cnn["classifier.bias"] == ["classifier.weight"]
    res = channel_owners(build_model("resnet18", in_channels=3, num_classes=10, width=0.0625, image_size=32))
    assert res["bn1.weight"] == ["conv1.weight", "layer1.0.conv2.weight", "layer1.1.conv2.weight"]
    assert res["layer1.0.bn1.bias"] == ["layer1.0.conv1.weight"]   # a block's inner group: its first conv only
    assert res["layer1.0.bn2.bias"] == res["bn1.weight"]           # stage 1 shares the stem's channels
    assert res["layer2.0.shortcut.1.weight"] == ["layer2.0.conv2.weight", "layer2.0.shortcut.0.weight",
                                                 "layer2.1.conv2.weight"]
    assert res["linear.bias"] == ["linear.weight"]
    # a model that declares no channel groups: its BN has no owner (credited by its mask), its bias has its layer
    assert channel_owners(nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))) == {"0.bias": ["0.weight"]}


def test_bad_coverage_arguments():
    with pytest.raises(ValueError, match="coverage"):
        Aggregator({"w": torch.zeros(1)}, coverage="nonsense")
    with pytest.raises(ValueError, match="owners"):
        Aggregator({"w": torch.zeros(1)}, coverage="kept")


# --------------------------------------------------------------------------- ste=paper at tau = 0

def test_paper_gradient_is_finite_at_tau_zero():
    # Prepare: level 1 gives tau = 0; exact zeros among the weights
    w = T([0.0, 0.5, -2.0, 0.0], requires_grad=True)
    up = T([1.0, 2.0, 3.0, 4.0])
    # Execute
    (grad,) = torch.autograd.grad((threshold_mask(w, 0.0, "paper") * up).sum(), w)
    # Assert: every weight is kept (|w| >= 0) and the factor is 1 everywhere (2 * 0 * |w| / |w|^2 = 0 off
    # zero; its limit at |w| = tau = 0), so the gradient is the upstream one, with no NaN
    assert torch.equal(grad, up)


def test_paper_gradient_away_from_zero_is_the_formula():
    w = T([0.0, 0.3, -0.7, 1.5], dtype=torch.float64, requires_grad=True)
    tau = 0.5
    (grad,) = torch.autograd.grad(threshold_mask(w, tau, "paper").sum(), w)
    a = w.detach().abs()
    expect = (a >= tau) * (1 + 2 * tau * a / (a + tau) ** 2)
    assert torch.equal(grad, expect)


def test_paper_gradient_with_a_tensor_tau():
    # batched paths pass one threshold per stacked client
    w = T([[0.0, 1.0], [0.0, 1.0]], requires_grad=True)
    tau = T([[0.0], [1.0]])
    (grad,) = torch.autograd.grad(threshold_mask(w, tau, "paper").sum(), w)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad, T([[1.0, 1.0], [0.0, 1.5]]))


# --------------------------------------------------------------------------- balanced Dirichlet fill

@pytest.fixture(scope="module")
def fmnist_labels():
    """60,000 labels, 10 balanced classes, in shuffled order (Fashion-MNIST's shape)."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(10), 6000))


def label_mix(labels, part, c=10):
    return np.bincount(labels[part], minlength=c) / len(part)


@pytest.mark.parametrize("seed", [0, 3])
def test_balanced_dirichlet_every_client_is_close_to_its_own_draw(fmnist_labels, seed):
    # Prepare / Execute: 100 clients, alpha 0.3 (seed 3 over-demands three classes by 26-36%)
    parts, draws = balanced_dirichlet(fmnist_labels, 100, 0.3, seed)
    # Assert: the same parts as `partition`, 600 each, disjoint
    same = partition(fmnist_labels, 100, "balanced_dirichlet", alpha=0.3, seed=seed)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same))
    assert {len(p) for p in parts} == {600}
    assert len(np.unique(np.concatenate(parts))) == 60000 // 100 * 100
    assert draws.shape == (100, 10) and np.allclose(draws.sum(1), 1)
    tv = np.array([0.5 * np.abs(label_mix(fmnist_labels, p) - d).sum() for p, d in zip(parts, draws)])
    # What the class supply forces: a class demanded r times its supply can give each client at most about
    # 1/r of what its draw asks, so a client loses about p_c (1 - 1/r) of it. Beyond that, only sampling
    # noise (600 draws: ~0.03-0.08) separates a client from its draw.
    demand = draws.sum(0) * 600 / 6000
    forced = (draws * np.maximum(0.0, 1 - 1 / demand)).sum(1)
    assert (tv <= forced + 0.1).all(), np.round(tv - forced, 3)
    assert tv.max() < 0.3
    # No client is left with leftovers: the last quarter (the smallest level when levels go by index) is
    # as close to its draws as the rest (the fill by index gave it 0.28-0.47 against 0.03-0.09)
    assert tv[75:].mean() <= tv[:75].mean() + 0.03


def test_balanced_dirichlet_exhausted_pools_and_zero_mass():
    # Tiny alpha: draws put (numerically) all mass on one class, pools run dry, demand moves elsewhere
    y = np.repeat(np.arange(4), [5, 5, 5, 25])
    parts, draws = balanced_dirichlet(y, 8, 0.01, 0)
    assert {len(p) for p in parts} == {5}
    assert len(np.unique(np.concatenate(parts))) == 40


# --------------------------------------------------------------------------- evaluation order

def test_global_eval_set_orders():
    x = torch.arange(10.0).view(10, 1)
    y = torch.arange(10)
    # test: the stored tensors themselves
    xs, ys = global_eval_set("test", x, y)
    assert xs is x and ys is y
    # clients: local parts joined in client order (repeats allowed, unused samples left out)
    xs, ys = global_eval_set("clients", x, y, [torch.tensor([3, 7]), torch.tensor([0]), torch.tensor([7, 9])])
    assert torch.equal(ys, T([3, 7, 0, 7, 9]))
    assert torch.equal(xs.flatten(), T([3.0, 7.0, 0.0, 7.0, 9.0]))
    with pytest.raises(ValueError):
        global_eval_set("clients", x, y, [])
    with pytest.raises(ValueError):
        global_eval_set("shuffled", x, y)


def test_batch_statistics_bn_makes_the_order_matter():
    # A batch-statistics BN model: predictions in batches of 20 over label-skewed blocks differ from one batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3))
    weights = dict(model.named_parameters())
    x = torch.cat([torch.randn(20, 2) + 3, torch.randn(20, 2) - 3])
    one = predict(model, weights, {}, x, 40)
    twenty = predict(model, weights, {}, x, 20)
    assert not torch.equal(one, twenty)
    # and batching is what predict does: batch by batch equals separate calls
    halves = [predict(model, weights, {}, x[i:i + 20], 20) for i in (0, 20)]
    assert torch.equal(twenty, torch.cat(halves))


def test_predict_label_split_metric():
    # classes outside the client's get logit 0 before the argmax (the official local metric)
    model = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(3))
    weights = dict(model.named_parameters())
    x = T([[2.0, 5.0, 1.0], [-1.0, 5.0, -2.0]])   # logits = x
    # row 1: class 1 is absent -> [2, 0, 1] -> 0; row 2: [-1, 0, -2]: the absent class wins with its 0
    assert torch.equal(predict(model, weights, {}, x, 10, classes=T([0, 2])), T([0, 1]))
    assert torch.equal(predict(model, weights, {}, x, 10), T([1, 1]))


# --------------------------------------------------------------------------- clipping and label split

def tiny_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g) * 5
    y = torch.tensor([0, 2, 4] * 5 + [0])
    return model, params, x, y


def test_clip_norm_none_is_the_default_and_changes_nothing():
    model, params, x, y = tiny_setup()
    sub = Submodel({"0.weight": torch.rand(6, 4) < 0.5})
    batches = [torch.arange(8), torch.arange(8, 16)]
    base = local_train(model, params, {}, sub, x, y, batches, local_work(lr=0.1))
    big = local_train(model, params, {}, sub, x, y, batches, local_work(lr=0.1, clip_norm=1e9))
    assert local_work().clip_norm is None
    assert all(torch.equal(base[0][n], big[0][n]) for n in params) and base[1] == big[1]


def test_clip_norm_clips_the_masked_gradient():
    # Prepare: one SGD step, so delta = -lr * clipped gradient
    model, params, x, y = tiny_setup()
    mask = torch.rand(6, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    sub = Submodel({"0.weight": mask})
    eff = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    loss = nn.functional.cross_entropy(torch.func.functional_call(model, sub.apply(eff), (x,)), y)
    grads = torch.autograd.grad(loss, list(eff.values()))
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm > 0.5
    # Execute
    delta, _ = local_train(model, params, {}, sub, x, y, [torch.arange(16)], local_work(lr=0.1, clip_norm=0.5))
    # Assert: the step is the submodel's gradient scaled to norm 0.5, still zero outside the mask
    scale = 0.5 / (norm + 1e-6)
    for (n, _), g in zip(eff.items(), grads):
        assert torch.allclose(delta[n], -0.1 * g * scale, atol=1e-7), n
    assert not delta["0.weight"][~mask].any()


def test_label_mask_logits_sets_absent_classes_to_zero():
    logits = T([[1.0, -2.0, 3.0, -4.0]])
    assert torch.equal(label_mask_logits(logits, T([0, 3])), T([[1.0, 0.0, 0.0, -4.0]]))
    assert torch.equal(label_mask_logits(logits, T([True, False, False, True])), T([[1.0, 0.0, 0.0, -4.0]]))
    assert torch.equal(class_keep(T([1]), 3), T([False, True, False]))


def test_label_split_training_and_its_mask_form_agree():
    # Prepare: the client holds classes 0, 2, 4 of 5
    model, params, x, y = tiny_setup()
    present = torch.unique(y)
    batches = [torch.arange(8), torch.arange(8, 16)]
    work = local_work(lr=0.1, clip_norm=1.0)
    # Execute: (a) the loss masks the absent logits; (b) the classifier's absent rows are masked in the submodel
    w, b = classifier_names(model)
    assert (w, b) == ("2.weight", "2.bias")
    extra = label_split_masks(params, w, b, present)
    restricted = restrict_submodel(Submodel(), extra)
    d_loss, l_loss = local_train(model, params, {}, Submodel(), x, y, batches, work, classes=present)
    d_mask, l_mask = local_train(model, params, {}, restricted, x, y, batches, work)
    d_both, _ = local_train(model, params, {}, restricted, x, y, batches, work, classes=present)
    # Assert: the absent rows get no gradient under (a), so both forms train the same client
    absent = T([False, True, False, True, False])
    assert not d_loss[w][absent].any() and not d_loss[b][absent].any()
    for n in params:
        assert torch.allclose(d_loss[n], d_mask[n], atol=1e-7) and torch.equal(d_mask[n], d_both[n]), n
    assert abs(l_loss - l_mask) < 1e-6
    # and (b)'s masks make the aggregation count the client only on its own rows
    glob = {n: torch.zeros_like(p) for n, p in params.items()}
    other = ({n: torch.ones_like(p) for n, p in params.items()}, Submodel())
    new = aggregate(glob, [(d_mask, restricted), other])
    assert torch.equal(new[b][absent], torch.ones(2))


def test_restrict_submodel_ands_existing_masks():
    sub = Submodel({"w": T([[True, True], [True, False]])}, ste="paper")
    out = restrict_submodel(sub, {"w": T([[False, True], [True, True]]), "b": T([True, False])})
    assert torch.equal(out.masks["w"], T([[False, True], [True, False]]))
    assert torch.equal(out.masks["b"], T([True, False]))
    assert out.ste == "paper" and sub.masks.keys() == {"w"}


def test_client_settings_read_the_typed_config(tiny_cfg):
    # the client gets its settings as one typed record; clip_norm unset means no clipping
    from fedlase.client import ClientSettings
    s = ClientSettings.from_config(tiny_cfg())
    assert s.work == LocalWork(2, None, 16, "sgd", 0.05, 0.0, 0.0, (0.9, 0.999), None, "fp32")
    assert (s.seed, s.sliced, s.label_split) == (0, True, False)
    s = ClientSettings.from_config(tiny_cfg("clip_norm=1", "sliced=false", "label_split=true", "seed=3"))
    assert (s.work.clip_norm, s.seed, s.sliced, s.label_split) == (1.0, 3, False, True)


# =========================================================================== label_split wired into the engine
def test_label_split_trains_and_credits_only_the_clients_classes(tiny_cfg):
    from fedlase.engine import Experiment
    from fedlase.train import classifier_names
    exp = Experiment.from_config(tiny_cfg("method=heterofl", "partition=pathological", "classes_per_client=2",
                                          "label_split=true"))
    weight, bias = classifier_names(exp.model)
    old = {k: v.clone() for k, v in exp.params.items()}
    picked = exp.sample(1)
    exp.run_round(1)
    moved = (exp.params[weight] != old[weight]).any(dim=1)
    trained = torch.zeros_like(moved)
    for client, _ in picked:
        trained[exp.trainer.classes[client]] = True
    assert moved.any() and not (moved & ~trained).any()   # rows of classes no sampled client holds stay
    sub = exp.trainer.submodel(picked[0][0], exp.submodels([picked[0][1]], 1)[picked[0][1]], exp.params)
    rows = sub.masks[weight].any(dim=1)
    assert rows.sum() == exp.trainer.classes[picked[0][0]].sum()


def test_label_split_off_changes_nothing(tiny_cfg, tmp_path):
    from fedlase.engine import run_experiment
    a = run_experiment(tiny_cfg("method=heterofl", out=str(tmp_path / "a")), progress=False)["final"]
    b = run_experiment(tiny_cfg("method=heterofl", "label_split=false", out=str(tmp_path / "b")),
                       progress=False)["final"]
    assert a["levels"] == b["levels"] and a["train_loss"] == b["train_loss"]
