"""Tests for fedlase.masks and the FIARSE method: maskable parameters, the global top-k threshold mask, the
straight-through gradient of the threshold mask (both `ste` modes), and per-forward mask re-evaluation."""
import pytest
import torch
from torch import nn

from fedlase.masks import Submodel, kth_largest, maskable_names, threshold_mask
from fedlase.methods import build_method
from fedlase.models import build_model

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics


def model_params(name: str, seed: int = 0):
    """A small model and continuous random weights (float64 normals: float32 inits hold tied magnitudes)."""
    model = build_model(name, in_channels=3, num_classes=10, width=0.0625 if name == "resnet18" else 0.25,
                        image_size=32)
    g = torch.Generator().manual_seed(seed)
    return model, {k: torch.randn(v.shape, dtype=torch.float64, generator=g) for k, v in model.named_parameters()}


# --------------------------------------------------------------------------- maskable parameters

def test_maskable_names_are_conv_and_linear_only():
    # Prepare
    model, params = model_params("cnn")
    # Execute
    names = maskable_names(model)
    # Assert: conv weights (bias-free), classifier weight and bias; no BatchNorm parameter
    bn = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d) for p in ("weight", "bias")}
    assert names == ["features.0.weight", "features.4.weight", "features.8.weight", "features.11.weight",
                     "classifier.weight", "classifier.bias"]
    assert bn and not bn & set(names)
    assert set(names) | bn == set(params)


def test_kth_largest():
    v = torch.tensor([3.0, -1.0, 7.0, 5.0, 0.5])
    assert [kth_largest(v, k) for k in range(1, 6)] == [7.0, 5.0, 3.0, 0.5, -1.0]
    with pytest.raises(ValueError):
        kth_largest(v, 0)
    with pytest.raises(ValueError):
        kth_largest(v, 6)


# --------------------------------------------------------------------------- FIARSE masks

@pytest.mark.parametrize("model_name", ["cnn", "resnet18"])
def test_fiarse_mask_is_one_global_topk(model_name):
    # Prepare
    model, params = model_params(model_name)
    maskable = maskable_names(model)
    total = sum(params[n].numel() for n in maskable)
    all_abs = torch.cat([params[n].abs().flatten() for n in maskable])
    assert all_abs.unique().numel() == total   # continuous random weights: no ties
    method = build_method("fiarse", model, {}, [1.0, 0.25, 1 / 16, 1 / 64])
    for gamma in (1.0, 0.5, 0.25, 1 / 16, 1 / 64, 0.013):
        # Execute
        sub = method.submodel(params, gamma, 1)
        # Assert: exactly int(gamma * maskable) coordinates kept
        k = int(gamma * total)
        assert sub.kept(maskable, params) == k
        assert sum(int(m.sum()) for m in sub.masks.values()) == k
        # BN parameters are outside the budget: no mask, no threshold
        assert set(sub.masks) == set(maskable) and set(sub.thresholds) == set(maskable)
        # one threshold for every layer: the k-th largest |w| over all maskable parameters (by a full sort)
        tau = float(torch.sort(all_abs, descending=True).values[k - 1])
        assert set(sub.thresholds.values()) == {tau}
        for n in maskable:
            assert sub.masks[n].dtype == torch.bool and sub.masks[n].shape == params[n].shape
            assert torch.equal(sub.masks[n], params[n].abs() >= tau)
        assert sub.ste == "official"


def test_fiarse_full_level_keeps_everything_and_first_last_layers_compete():
    # Prepare
    model, params = model_params("cnn")
    method = build_method("fiarse", model, {}, [1.0, 1 / 64])
    # Execute
    full, small = method.submodel(params, 1.0, 1), method.submodel(params, 1 / 64, 1)
    # Assert: level 1 keeps all; at 1/64 the first and last layers are masked like any other (FIARSE)
    assert all(bool(m.all()) for m in full.masks.values())
    assert not small.masks["features.0.weight"].all() and not small.masks["classifier.weight"].all()


def test_fiarse_fixed_ste_gives_a_fixed_mask():
    model, params = model_params("cnn")
    sub = build_method("fiarse", model, {"ste": "fixed"}, [1.0, 0.25]).submodel(params, 0.25, 1)
    assert sub.thresholds is None and sub.kept(maskable_names(model), params) == int(
        0.25 * sum(params[n].numel() for n in maskable_names(model)))
    paper = build_method("fiarse", model, {"ste": "paper"}, [1.0, 0.25]).submodel(params, 0.25, 1)
    assert paper.ste == "paper" and paper.thresholds is not None


def test_fiarse_masks_follow_the_weights():
    # Prepare: make a few tiny weights of the classifier the largest of the model
    model, params = model_params("cnn")
    method = build_method("fiarse", model, {}, [1.0, 0.25])
    params["classifier.weight"][0, :3] = torch.tensor([50.0, -60.0, 70.0])
    # Execute
    sub = method.submodel(params, 1 / 1000, 1)
    # Assert
    assert sub.masks["classifier.weight"][0, :3].all()


# --------------------------------------------------------------------------- the straight-through gradient

TAU = 0.5


def _weights():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, dtype=torch.float64, generator=g)
    w[:4] = torch.tensor([TAU, -TAU, 0.0, 1e-3], dtype=torch.float64)   # on the threshold, zero, tiny
    up = torch.randn(200, dtype=torch.float64, generator=g)             # random upstream gradient g
    return w, up


def _reparam(w, tau):
    """A differentiable reference whose derivative is 1 + 2 tau |w| / (|w| + tau)^2 everywhere:
    w + sign(w) * (2 tau log(|w| + tau) + 2 tau^2 / (|w| + tau)) (differentiate in |w| to check)."""
    a = w.abs()
    return w + torch.sign(w) * (2 * tau * torch.log(a + tau) + 2 * tau ** 2 / (a + tau))


@pytest.mark.parametrize("ste", ["official", "paper"])
def test_threshold_mask_forward_is_w_times_mask(ste):
    w, _ = _weights()
    out = threshold_mask(w, TAU, ste)
    assert torch.equal(out, torch.where(w.abs() >= TAU, w, torch.zeros_like(w)))


def test_official_gradient_is_the_masked_gradient():
    # Prepare
    w, up = _weights()
    w = w.requires_grad_(True)
    mask = (w.abs() >= TAU).double()
    # Execute
    (grad,) = torch.autograd.grad((threshold_mask(w, TAU, "official") * up).sum(), w)
    (ref,) = torch.autograd.grad((w * mask.detach() * up).sum(), w)
    # Assert: the explicit formula g * 1[|w| >= tau], and autograd of w * mask
    assert torch.equal(grad, up * mask)
    assert torch.equal(grad, ref)
    assert grad[0] == up[0] and grad[1] == up[1] and grad[2] == 0 and grad[3] == 0   # |w| = tau is kept


def test_paper_gradient_matches_the_formula_and_autograd():
    # Prepare
    w, up = _weights()
    w = w.requires_grad_(True)
    a = w.detach().abs()
    mask = (a >= TAU).double()
    formula = up * mask * (1 + 2 * TAU * a / (a + TAU) ** 2)
    # Execute
    (grad,) = torch.autograd.grad((threshold_mask(w, TAU, "paper") * up).sum(), w)
    (ref,) = torch.autograd.grad((mask * _reparam(w, TAU) * up).sum(), w)
    # Assert
    assert torch.allclose(grad, formula, rtol=1e-12, atol=0)
    assert torch.allclose(grad, ref, rtol=1e-12, atol=1e-15)
    # at |w| = tau the factor is 1 + 2 tau^2 / (2 tau)^2 = 1.5; below tau the gradient is 0
    assert grad[0].item() == pytest.approx(1.5 * up[0].item()) and grad[1].item() == pytest.approx(1.5 * up[1].item())
    assert grad[2] == 0 and grad[3] == 0
    # the paper's factor is never below the official one (it lies in [1, 1.5])
    kept = mask.bool()
    assert ((grad[kept] / up[kept]) >= 1).all() and ((grad[kept] / up[kept]) <= 1.5 + 1e-12).all()


def test_paper_gradient_by_hand():
    w = torch.tensor([2.0, -1.0, 0.25], requires_grad=True)
    (grad,) = torch.autograd.grad(threshold_mask(w, 1.0, "paper").sum(), w)
    # |w| = 2: 1 + 2*1*2/9 = 13/9; |w| = 1: 1 + 2/4 = 1.5; |w| = 0.25 < tau: 0
    assert torch.allclose(grad, torch.tensor([13 / 9, 1.5, 0.0]))


def test_bad_ste_mode():
    with pytest.raises(ValueError):
        threshold_mask(torch.ones(2), 0.5, "bogus")


# --------------------------------------------------------------------------- Submodel.apply

def test_apply_fixed_threshold_and_unmasked():
    # Prepare
    params = {"a": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.1, 0.9]), "c": torch.tensor([5.0])}
    sub_fixed = Submodel({"a": torch.tensor([True, False, True])})
    sub_thr = Submodel({"b": torch.tensor([False, True])}, thresholds={"b": 0.5})
    # Execute
    fixed, thr = sub_fixed.apply(params), sub_thr.apply(params)
    # Assert
    assert torch.equal(fixed["a"], torch.tensor([1.0, 0.0, 3.0])) and torch.equal(fixed["b"], params["b"])
    assert torch.equal(thr["b"], torch.tensor([0.0, 0.9])) and torch.equal(thr["c"], params["c"])
    assert sub_fixed.kept(["a", "c"], params) == 3


def test_threshold_mask_is_reevaluated_at_every_forward():
    # Prepare: both coordinates start above tau
    w = torch.tensor([0.6, 0.8], requires_grad=True)
    sub = Submodel({"w": torch.tensor([True, True])}, thresholds={"w": 0.5})
    (g1,) = torch.autograd.grad(sub.apply({"w": w})["w"].sum(), w)
    # Execute: push the first weight below tau (as a local step would), forward again
    with torch.no_grad():
        w[0] = 0.4
    out = sub.apply({"w": w})["w"]
    (g2,) = torch.autograd.grad(out.sum(), w)
    # Assert: it dropped out of the forward and gets no gradient, though the start mask still holds it
    assert torch.equal(g1, torch.tensor([1.0, 1.0]))
    assert torch.equal(out.detach(), torch.tensor([0.0, 0.8])) and torch.equal(g2, torch.tensor([0.0, 1.0]))
    # a fixed mask keeps it
    fixed = Submodel({"w": torch.tensor([True, True])})
    (g3,) = torch.autograd.grad(fixed.apply({"w": w})["w"].sum(), w)
    assert torch.equal(g3, torch.tensor([1.0, 1.0]))
