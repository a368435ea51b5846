"""Tests for local training (fedlase.train) and the embedded engine (fedlase.engine): masked deltas, threshold
vs fixed masks, sampling, per-level evaluation, fairness, checkpoint/resume, and one end-to-end run per method."""
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import TINY, counted_over, digits_test_size
from fedlase.client import local_work
from fedlase.config import load_config
from fedlase.engine import Experiment, RoundResult, SequentialRounds, run_experiment
from fedlase.errors import UserError
from fedlase.evaluate import fairness
from fedlase.levels import Level, level_name
from fedlase.masks import Submodel, maskable_names
from fedlase.methods import build_method
from fedlase.models import build_model
from fedlase.registry import METHODS
from fedlase.sampling import Sampling, client_job, derive_seed, sample_clients
from fedlase.train import client_batches, local_train

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = [pytest.mark.numerics,
              pytest.mark.usefixtures("one_thread")]   # tiny models run fastest on one thread


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


# =========================================================================== local training

def test_client_batches_cover_passes():
    # Prepare
    gen = torch.Generator().manual_seed(0)
    # Execute: 10 samples, batch 4, 5 steps -> pass 1: 4, 4, 2; pass 2: 4, 4
    batches = client_batches(10, local_work(steps=5, batch_size=4), gen)
    # Assert
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4]
    assert sorted(torch.cat(batches[:3]).tolist()) == list(range(10))
    assert local_work(epochs=1.5, batch_size=4).num_steps(10) == 4      # ceil(1.5 * 10 / 4)
    assert local_work(epochs=0.01, batch_size=4).num_steps(10) == 1
    assert [len(b) for b in client_batches(3, local_work(steps=2, batch_size=8), gen)] == [3, 3]


def _cnn_setup(seed=0):
    torch.manual_seed(seed)
    model = build_model("cnn", in_channels=1, num_classes=10, width=0.25, image_size=8)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    x, y = torch.randn(24, 1, 8, 8), torch.randint(0, 10, (24,))
    return model, params, buffers, x, y


@pytest.mark.parametrize("kind", ["fixed", "threshold"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_delta_is_zero_outside_the_mask(kind, optimizer):
    # Prepare: momentum and weight decay on, so an unmasked optimiser would move every coordinate
    model, params, buffers, x, y = _cnn_setup()
    maskable = maskable_names(model)
    if kind == "fixed":
        g = torch.Generator().manual_seed(1)
        sub = Submodel({n: torch.rand(params[n].shape, generator=g) < 0.3 for n in maskable})
    else:
        method = build_method("fiarse", model, {}, [1.0, 0.25])
        quarter = method.system.find("1/4")
        sub = method.submodel(params, quarter, 1)
        same = method.submodel(params, 0.25, 1)   # a float still names the level
        assert all(torch.equal(sub.masks[n], same.masks[n]) for n in sub.masks)
    work = local_work(steps=4, batch_size=8, optimizer=optimizer, lr=0.1, momentum=0.9, weight_decay=0.1)
    batches = client_batches(len(y), work, torch.Generator().manual_seed(2))
    before = {k: v.clone() for k, v in params.items()}
    # Execute
    delta, loss = local_train(model, params, buffers, sub, x, y, batches, work)
    # Assert
    assert math.isfinite(loss) and set(delta) == set(params)
    for n in maskable:
        m = sub.masks[n]
        assert (delta[n][~m] == 0).all(), n
        assert (delta[n][m] != 0).float().mean() > 0.5, n    # the trained coordinates did move
    for n in set(params) - set(maskable):                       # BatchNorm: unmasked, trained whole
        assert (delta[n] != 0).float().mean() > 0.5, n
    assert all(torch.equal(params[k], before[k]) for k in params)   # the global model is not modified


@pytest.mark.parametrize("bn", ["batch", "static"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_whole_model_training_equals_the_masked_forward(bn, clip):
    # Prepare: the whole model (FedAvg, level 1) trains on a copy of the module, called directly; a mask of all
    # ones takes the functional masked forward (w * 1 == w) and must give the very same delta and loss
    torch.manual_seed(0)
    model = build_model("cnn", in_channels=1, num_classes=10, width=0.25, bn=bn, image_size=8)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    x, y = torch.randn(24, 1, 8, 8), torch.randint(0, 10, (24,))
    work = local_work(steps=4, batch_size=8, lr=0.1, momentum=0.9, weight_decay=0.1, clip_norm=clip)
    batches = client_batches(len(y), work, torch.Generator().manual_seed(2))
    ones = Submodel({n: torch.ones_like(p, dtype=torch.bool) for n, p in params.items()})
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # Execute: twice on the whole path (the copy is reused), once masked
    runs = [local_train(model, params, buffers, sub, x, y, batches, work) for sub in (Submodel(), Submodel(), ones)]
    # Assert
    assert Submodel().is_whole(train=True) and not ones.is_whole()
    for delta, loss in runs[1:]:
        assert loss == runs[0][1] and all(torch.equal(delta[n], runs[0][0][n]) for n in params)
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())   # the caller's module untouched


def _linear_case(sub: Submodel, steps: int):
    """Linear(2 -> 2, no bias) with W = [[-0.6, 0.9], [0.55, 0.9]], one sample x = (1, 0), label 0, SGD lr 0.1.

    logits = (W00, W10); dL/dW00 = -p1, dL/dW10 = p1 with p1 = sigmoid(W10 - W00); column 1 gets no gradient."""
    model = nn.Linear(2, 2, bias=False)
    w0 = torch.tensor([[-0.6, 0.9], [0.55, 0.9]], dtype=torch.float64)
    model = model.double()
    x, y = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([0])
    work = local_work(steps=steps, batch_size=1, lr=0.1)
    delta, _ = local_train(model, {"weight": w0}, {}, sub, x, y, [torch.tensor([0])] * steps, work)
    return delta["weight"]


def test_threshold_mask_drops_a_weight_inside_the_round():
    # Prepare: tau = 0.5; all four weights start above it
    full = torch.ones(2, 2, dtype=torch.bool)
    thr = Submodel({"weight": full}, thresholds={"weight": 0.5})
    fixed = Submodel({"weight": full})
    # Hand computation.
    p1 = sigmoid(0.55 + 0.6)                      # step 1 (same for both)
    w00, w10 = -0.6 + 0.1 * p1, 0.55 - 0.1 * p1    # W10 = 0.474 < tau: drops out of the threshold model
    assert abs(w10) < 0.5 <= abs(w00)
    thr_w00 = w00 + 0.1 * sigmoid(0.0 - w00)      # step 2, threshold: logit 1 is 0, W10 frozen
    fix_p1 = sigmoid(w10 - w00)                   # step 2, fixed mask: W10 keeps training
    fix_w00, fix_w10 = w00 + 0.1 * fix_p1, w10 - 0.1 * fix_p1
    # Execute
    d_thr, d_fix = _linear_case(thr, 2), _linear_case(fixed, 2)
    # Assert: the dropped weight's delta (from step 1) is still returned, the start mask is credited
    assert d_thr[0, 0].item() == pytest.approx(thr_w00 + 0.6, abs=1e-12)
    assert d_thr[1, 0].item() == pytest.approx(w10 - 0.55, abs=1e-12)
    assert d_fix[0, 0].item() == pytest.approx(fix_w00 + 0.6, abs=1e-12)
    assert d_fix[1, 0].item() == pytest.approx(fix_w10 - 0.55, abs=1e-12)
    assert (d_thr[:, 1] == 0).all() and (d_fix[:, 1] == 0).all()


def test_paper_ste_scales_the_local_step():
    # One step, ste=paper: each kept weight's step is scaled by 1 + 2 tau |w| / (|w| + tau)^2.
    full = torch.ones(2, 2, dtype=torch.bool)
    p1 = sigmoid(0.55 + 0.6)
    f = lambda a: 1 + 2 * 0.5 * a / (a + 0.5) ** 2   # noqa: E731
    d = _linear_case(Submodel({"weight": full}, thresholds={"weight": 0.5}, ste="paper"), 1)
    assert d[0, 0].item() == pytest.approx(0.1 * p1 * f(0.6), abs=1e-12)
    assert d[1, 0].item() == pytest.approx(-0.1 * p1 * f(0.55), abs=1e-12)


def test_fixed_mask_excludes_weights_from_the_forward():
    # W10 outside a fixed mask: logit 1 is 0 at every step, and W10 gets no delta
    mask = torch.tensor([[True, True], [False, True]])
    d = _linear_case(Submodel({"weight": mask}), 1)
    assert d[0, 0].item() == pytest.approx(0.1 * sigmoid(0.0 + 0.6), abs=1e-12)
    assert d[1, 0].item() == 0.0


# =========================================================================== engine: sampling, evaluation

def test_level_name_and_derive_seed():
    assert [level_name(x) for x in (1.0, 0.25, 1 / 16, 1 / 64, 0.5)] == ["1", "1/4", "1/16", "1/64", "1/2"]
    assert level_name(Fraction(1, 16)) == "1/16" and level_name(Level(0, Fraction(1, 64), 3)) == "1/64"
    assert derive_seed(0, 3, 1, 7) == derive_seed(0, 3, 1, 7)
    assert len({derive_seed(0, r, 0) for r in range(50)} | {derive_seed(1, 0, 0)}) == 51


@pytest.fixture(scope="module")
def exp20():
    """An experiment of 20 clients at three levels (not run: for sampling and evaluation)."""
    cfg = load_config(None, [*TINY, "system={1,1/4,1/16}_{4,6,10}", "participation={0.1,0.25,0.5}", "out=/nonexistent"])
    return Experiment.from_config(cfg)


def test_sampling_is_deterministic_and_per_round(exp20):
    # Execute
    cfg = exp20.cfg
    first = {r: exp20.sample(r) for r in range(1, 61)}
    again = {r: exp20.sample(r) for r in reversed(range(1, 61))}     # other order: same draws
    # Assert: a plain function of (config, round), as the experiment draws it
    assert first == again
    assert all(sample_clients(Sampling.from_config(cfg), r) == first[r] for r in (1, 17, 60))
    sizes = {len(p) for p in first.values()}
    assert sizes == {2, 5, 10}                       # 0.1, 0.25 and 0.5 of 20 clients, each drawn
    assert len({tuple(c for c, _ in p) for p in first.values()}) > 30   # rounds differ
    client_level = cfg.levels.client_level
    for p in first.values():
        clients = [c for c, _ in p]
        assert clients == sorted(set(clients)) and all(0 <= c < 20 for c in clients)
        assert all(isinstance(lvl, Level) and lvl is cfg.levels.levels[lvl.index] for _, lvl in p)
        assert all(lvl.index == client_level[c] for c, lvl in p)   # fixed assignment by client index
    assert [float(cfg.levels.levels[i]) for i in client_level] == [1.0] * 4 + [0.25] * 6 + [1 / 16] * 10
    assert exp20.levels == cfg.levels.levels and [lv.name for lv in exp20.levels] == ["1", "1/4", "1/16"]


def test_sampling_depends_on_the_seed(tiny_cfg):
    a = tiny_cfg("system={1}_{20}", "participation=0.25")
    b = tiny_cfg("system={1}_{20}", "participation=0.25", "seed=1")
    sa, sb = Sampling.from_config(a), Sampling.from_config(b)
    assert [sample_clients(sa, r) for r in range(1, 11)] != [sample_clients(sb, r) for r in range(1, 11)]
    assert all(len(sample_clients(sa, r)) == 5 for r in range(1, 11))


def test_random_assignment_redraws_levels(tiny_cfg):
    cfg = tiny_cfg("system={1,1/4}_{10,10}", "participation=1", "assignment=random")
    draws = [sample_clients(Sampling.from_config(cfg), r) for r in range(1, 6)]
    for p in draws:
        assert [c for c, _ in p] == list(range(20)) and sorted(float(lvl) for _, lvl in p) == [0.25] * 10 + [1.0] * 10
    assert len({tuple(lvl for _, lvl in p) for p in draws}) > 1


def test_dynamic_assignment_draws_each_level_in_proportion(tiny_cfg):
    # Prepare: counts 1:3, so a sampled client is at level 1/4 with probability 3/4, independently each round
    cfg = tiny_cfg("system={1,1/4}_{5,15}", "participation=1", "assignment=dynamic")
    # Execute
    draws = [sample_clients(Sampling.from_config(cfg), r) for r in range(1, 201)]
    # Assert: every client each round, levels of the system, deterministic, and not the fixed counts
    assert draws == [sample_clients(Sampling.from_config(cfg), r) for r in range(1, 201)]
    assert all([c for c, _ in p] == list(range(20)) for p in draws)
    assert all(lvl is cfg.levels.levels[lvl.index] for p in draws for _, lvl in p)
    small = np.array([[lvl.index for _, lvl in p] for p in draws])   # 1 where a client is at 1/4
    assert abs(small.mean() - 0.75) < 0.03                             # 4000 draws: std 0.007
    assert len({int(row.sum()) for row in small}) > 3                  # the per-round count varies
    assert all(0 < small[:, c].mean() < 1 for c in range(20))          # a client's level changes over rounds
    fixed = tiny_cfg("system={1,1/4}_{5,15}", "participation=1")
    assert ({c: lvl.index for c, lvl in sample_clients(Sampling.from_config(fixed), 1)}
            == dict(enumerate(fixed.levels.client_level)))


def test_evaluate_reports_every_level(exp20):
    # Execute
    res = exp20.evaluate(0)
    # Assert: all levels, client counts as in the system, FIARSE's kept count int(level * maskable)
    total = sum(exp20.params[n].numel() for n in exp20.method.maskable)
    assert list(res["levels"]) == ["1", "1/4", "1/16"]
    assert [v["clients"] for v in res["levels"].values()] == [4, 6, 10]
    assert [v["kept"] for v in res["levels"].values()] == [total, int(total / 4), int(total / 16)]
    for v in res["levels"].values():
        assert all(math.isfinite(v[key]) for key in ("local_acc", "local_std", "local_worst10"))
        assert counted_over(v["global_acc"], digits_test_size())   # over the whole test set
        assert v["local_worst10"] <= v["local_acc"]
    assert res["global_acc"] == pytest.approx(sum(v["global_acc"] for v in res["levels"].values()) / 3)


@pytest.mark.parametrize("assignment", ["random", "dynamic"])
def test_evaluate_random_assignment_uses_every_client(tiny_cfg, assignment):
    exp = Experiment.from_config(tiny_cfg("system={1,1/4}_{1,3}", f"assignment={assignment}"))
    res = exp.evaluate(0)
    assert [v["clients"] for v in res["levels"].values()] == [4, 4]


# =========================================================================== engine: state, submodels, clients

def test_state_submodels_and_a_clients_update(exp20):
    exp = exp20
    cfg = exp.cfg
    # the run state is an explicit value; the experiment's params, buffers and round are views of it
    assert exp.params is exp.state.params and exp.buffers is exp.state.buffers and exp.round == exp.state.round == 0
    for name in ("params", "buffers", "round"):
        with pytest.raises(AttributeError):
            setattr(exp, name, None)
    # each sampled level's submodel, once per level, keyed by the Level
    picked = exp.sample(3)
    levels = [lvl for _, lvl in picked]
    subs = exp.submodels(levels, 3)
    assert list(subs) == sorted(set(levels), key=lambda lv: lv.index)
    for lvl, sub in subs.items():
        want = exp.method.submodel(exp.params, lvl, 3)
        assert set(sub.masks) == set(want.masks) and all(torch.equal(sub.masks[n], want.masks[n]) for n in sub.masks)
    # a client's update: its own batches (client_job), trained by the ClientTrainer on the current state
    client, lvl = picked[0]
    batches, augment = exp.trainer.job(client, 3)
    again, _ = client_job(cfg.seed, exp.trainer.work, exp.trainer.train_idx[client], 3, client, exp.data.augment)
    assert len(batches) == cfg.local_steps and all(torch.equal(a, b) for a, b in zip(batches, again))
    assert all(set(b.tolist()) <= set(exp.client_train[client].tolist()) for b in batches)
    delta, loss = exp.trainer.update(client, exp.state.params, exp.state.buffers, subs[lvl], 3)
    assert math.isfinite(loss) and any(bool(delta[n][m].any()) for n, m in subs[lvl].masks.items())   # it trained
    for n, m in subs[lvl].masks.items():   # inside its submodel only
        assert (delta[n][~m] == 0).all()
    # a new global model is set through the state
    old = exp.state.params
    try:
        exp.state.params = {k: v + 1 for k, v in old.items()}
        assert torch.equal(exp.params[n], old[n] + 1)
        d3, _ = exp.trainer.update(client, exp.params, exp.buffers, subs[lvl], 3)
        assert any(not torch.equal(d3[k], delta[k]) for k in delta)
    finally:
        exp.state.params = old


class RecordingRunner(SequentialRounds):
    """A round runner that trains like the sequential one and records what the loop gave it."""

    def __init__(self, keep=None):
        self.calls, self.keep = [], keep

    def train(self, exp, rnd, picked, subs):
        self.calls.append((rnd, list(picked), sorted(subs, key=lambda lv: lv.index)))
        result = super().train(exp, rnd, picked, subs)
        if self.keep is not None:
            result = RoundResult(result.updates[:self.keep], {"kept": self.keep})
        return result


def test_a_round_extracts_each_level_once(tiny_cfg, monkeypatch):
    # the method is asked once per distinct level of the round's clients, never per client (the bench used to
    # check this; a test does now)
    exp = Experiment.from_config(tiny_cfg("participation=1.0", "method=fiarse"))
    calls = []
    extract = exp.method.submodel
    monkeypatch.setattr(exp.method, "submodel", lambda p, lvl, rnd: calls.append((lvl, rnd)) or extract(p, lvl, rnd))
    for rnd in (1, 2):
        exp.run_round(rnd)
        levels = {lvl for _, lvl in exp.sample(rnd)}
        asked = sorted(lvl.index for lvl, r in calls if r == rnd)
        assert len(levels) == 2 and asked == sorted(lv.index for lv in levels)


def test_a_runner_plugs_into_the_round_loop(tmp_path):
    # Execute: the same run with the default runner and with a runner passed in
    ref = run_experiment(_cfg(tmp_path / "a", "rounds=2"), progress=False)
    runner = RecordingRunner()
    got = run_experiment(_cfg(tmp_path / "b", "rounds=2"), progress=False, runner=runner)
    # Assert: the loop sampled, built each level's submodel once, and aggregated what the runner returned
    assert [r for r, _, _ in runner.calls] == [1, 2]
    cfg = _cfg(tmp_path / "c")
    for rnd, picked, levels in runner.calls:
        assert picked == sample_clients(Sampling.from_config(cfg), rnd)
        assert levels == sorted({lvl for _, lvl in picked}, key=lambda lv: lv.index)
    assert got["final"]["levels"] == ref["final"]["levels"]
    a, b = _final_params(tmp_path / "a"), _final_params(tmp_path / "b")
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def test_fewer_replies_than_min_replies_leave_the_model_unchanged(tiny_cfg):
    exp = Experiment.from_config(tiny_cfg("min_replies=2"), runner=RecordingRunner(keep=1))
    before = {k: v.clone() for k, v in exp.params.items()}
    stats = exp.run_round(1)
    assert stats["skipped"] and stats["clients"] == 1 and stats["kept"] == 1
    assert all(torch.equal(exp.params[k], before[k]) for k in before)
    exp2 = Experiment.from_config(tiny_cfg("min_replies=1"), runner=RecordingRunner(keep=1))
    stats = exp2.run_round(1)
    assert "skipped" not in stats and any(not torch.equal(exp2.params[k], before[k]) for k in before)


def test_fairness_by_hand():
    # sorted: 0.1 0.3 0.5 0.7 0.9; mean 0.5; population std sqrt((0.16+0.04+0+0.04+0.16)/5) = sqrt(0.08)
    f = fairness([0.5, 0.9, 0.7, 0.1, 0.3])
    assert f["mean"] == pytest.approx(0.5) and f["std"] == pytest.approx(math.sqrt(0.08))
    assert f["worst10"] == pytest.approx(0.1)              # ceil(0.5) = 1 client
    # 20 clients: the worst 10% is the mean of the 2 lowest
    accs = [0.05 * i for i in range(20)]                    # 0, 0.05, ..., 0.95
    f = fairness(accs[::-1])
    assert f["worst10"] == pytest.approx(0.025) and f["mean"] == pytest.approx(0.475)
    assert f["std"] == pytest.approx(0.05 * math.sqrt((20 ** 2 - 1) / 12))
    assert fairness([0.2] * 11)["worst10"] == pytest.approx(0.2)   # ceil(1.1) = 2 clients
    assert fairness([0.0, 1.0] + [0.5] * 9)["worst10"] == pytest.approx(0.25)
    assert all(math.isnan(v) for v in fairness([]).values())


# =========================================================================== checkpoint and resume

def _cfg(out, *extra):
    return load_config(None, [*TINY, f"out={out}", "rounds=6", "eval_every=2", "checkpoint_every=2", *extra])


def _final_params(out):
    return torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=True)


def _metric_rounds(out):
    return [json.loads(ln)["round"] for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(out, ref_out, ref_summary, summary):
    a, b = _final_params(out), _final_params(ref_out)
    assert a["round"] == b["round"] == 6
    assert set(a["params"]) == set(b["params"])
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    for k in a["buffers"]:
        assert torch.equal(a["buffers"][k], b["buffers"][k]), k
    fa, fb = summary["final"], ref_summary["final"]
    for key in ("global_acc", "local_acc", "local_std", "local_worst10"):
        assert fa[key] == fb[key]
    assert fa["levels"] == fb["levels"]
    rounds = _metric_rounds(out)
    assert rounds == sorted(set(rounds)) and rounds[-1] == 6   # no duplicated round


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Six uninterrupted rounds."""
    out = tmp_path_factory.mktemp("ref") / "run"
    return out, run_experiment(_cfg(out), progress=False)


def test_reference_run_outputs(reference):
    out, summary = reference
    assert _metric_rounds(out) == [2, 4, 6]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert json.loads((out / "config.json").read_text())["rounds"] == 6


def test_resume_after_a_shorter_run_is_bit_identical(tmp_path, reference):
    # Prepare: run 3 rounds (as if killed after round 3's checkpoint)
    out = tmp_path / "run"
    run_experiment(_cfg(out, "rounds=3"), progress=False)
    assert _final_params(out)["round"] == 3
    # Execute
    summary = run_experiment(_cfg(out), resume=True, progress=False)
    # Assert
    _assert_same_run(out, *reference, summary)
    assert _metric_rounds(out) == [2, 3, 4, 6]


@pytest.mark.parametrize("fail_at", [5, 6])
def test_resume_after_a_crash_is_bit_identical(tmp_path, monkeypatch, reference, fail_at):
    # Prepare: evaluate every round, checkpoint every 2; crash inside round `fail_at`
    out = tmp_path / "run"
    cfg = _cfg(out, "eval_every=1")
    original = Experiment.run_round

    def failing(self, rnd):
        if rnd == fail_at:
            raise RuntimeError("killed")
        return original(self, rnd)

    monkeypatch.setattr(Experiment, "run_round", failing)
    with pytest.raises(RuntimeError, match="killed"):
        run_experiment(cfg, progress=False)
    monkeypatch.setattr(Experiment, "run_round", original)
    assert _final_params(out)["round"] == 4
    assert _metric_rounds(out) == list(range(1, fail_at))      # rounds after the checkpoint were logged
    # a plain rerun is refused
    with pytest.raises(UserError, match="^out:"):
        run_experiment(cfg, progress=False)
    # Execute
    summary = run_experiment(cfg, resume=True, progress=False)
    # Assert: metrics written after the checkpoint were dropped, then rewritten once
    _assert_same_run(out, *reference, summary)
    assert _metric_rounds(out) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("change", ["seed=1", "lr=0.1", "method_args.ste=paper", "system={1,1/4}_{3,1}"])
def test_resume_with_other_settings_is_refused(tmp_path, change):
    # Prepare
    out = tmp_path / "run"
    run_experiment(_cfg(out, "rounds=2"), progress=False)
    key = change.split("=")[0].split(".")[0]
    # Execute / Assert
    with pytest.raises(UserError, match=f"^out: .*other settings.*{key}"):
        run_experiment(_cfg(out, change), resume=True, progress=False)


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    out = tmp_path / "run"
    first = run_experiment(_cfg(out, "rounds=2"), progress=False)
    again = run_experiment(_cfg(out, "rounds=2", "eval_every=1", "checkpoint_every=1"), resume=True, progress=False)
    assert again["final"] == first["final"] and _metric_rounds(out) == [2]


def test_resume_with_fewer_rounds_than_done_is_refused(tmp_path):
    out = tmp_path / "run"
    run_experiment(_cfg(out, "rounds=3"), progress=False)
    with pytest.raises(UserError, match="^rounds: .*round 3"):
        run_experiment(_cfg(out, "rounds=2"), resume=True, progress=False)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3   # the finished run is untouched


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="^out: "):
        run_experiment(_cfg(tmp_path / "afile"), progress=False)


# =========================================================================== one end-to-end run per method

# the adapter methods train LoRA on a text model: their end-to-end runs are in tests/test_lora.py
@pytest.mark.parametrize("method", sorted(m for m in METHODS if not METHODS.get(m).adapters))
def test_end_to_end_each_method(tmp_path, tiny_cfg, method):
    # Prepare
    models = METHODS.get(method).models   # a method that runs on some models only (RecipFL): the first
    arch = models[0] if models else "cnn"
    cfg = tiny_cfg(f"method={method}", "system={1,1/4}_{2,2}", "rounds=2", "eval_every=1", f"model={arch}")
    # Execute
    summary = run_experiment(cfg, progress=False)
    # Assert
    out = Path(cfg.out)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert summary["rounds"] == 2 and summary["num_clients"] == 4 and summary["config"]["method"] == method
    assert summary["train_time"] > 0   # measured, not left at its initial 0
    final = summary["final"]
    assert final["round"] == 2 and list(final["levels"]) == ["1", "1/4"]
    assert [v["clients"] for v in final["levels"].values()] == [2, 2]
    assert all(math.isfinite(v["local_acc"]) for v in [final, *final["levels"].values()])
    # a personalized method (pFedLMT) counts each of the level's clients' own models over the whole test set
    per = [v["clients"] if METHODS.get(method).personalized else 1 for v in final["levels"].values()]
    assert all(counted_over(v["global_acc"], digits_test_size() * k) for v, k in zip(final["levels"].values(), per))
    assert final["global_acc"] == pytest.approx(sum(v["global_acc"] for v in final["levels"].values()) / 2)
    assert math.isfinite(final["train_loss"])
    assert _metric_rounds(out) == [1, 2]
    model = METHODS.get(method).prepare_model_for(build_model(arch, 1, 10, 0.25, image_size=8), cfg.method_args,
                                                 cfg.levels)
    exp_total = sum(p.numel() for n, p in _final_params(out)["params"].items() if n in maskable_names(model))
    kept = {lvl: v["kept"] for lvl, v in final["levels"].items()}
    assert kept["1/4"] <= kept["1"] <= exp_total
    if method == "fedavg":
        assert kept == {"1": exp_total, "1/4": exp_total}
    if method == "fiarse":
        assert kept == {"1": exp_total, "1/4": int(exp_total / 4)}


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.8, 0.0), (0.9, 5e-4), (0.0, 1e-3)])
def test_sgd_equals_torch_optim_sgd_bit_for_bit(momentum, weight_decay):
    from fedlase.train import SGD
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [t.detach().clone().requires_grad_(True) for t in a]
    ours = SGD(a, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    ref = torch.optim.SGD(b, lr=0.05, momentum=momentum, weight_decay=weight_decay)
    for step in range(4):
        x = torch.randn(3)
        for params, opt in ((a, ours), (b, ref)):
            opt.zero_grad(set_to_none=True)
            loss = (params[0] @ x).pow(2).sum() + params[1].sin().sum() * (step + 1)
            loss.backward()
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(a, b))
