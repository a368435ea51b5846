"""Tests for local training (fedlase.train) and the embedded engine (fedlase.engine): masked deltas, threshold
vs fixed masks, sampling, per-level evaluation, fairness, checkpoint/resume, and one end-to-end run per method."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment, derive_seed, fairness, level_name, run_experiment  # noqa: E402
from fedlase.errors import UserError  # noqa: E402
from fedlase.masks import Submodel, maskable_names  # noqa: E402
from fedlase.methods import METHODS, build_method  # noqa: E402
from fedlase.models import build_model  # noqa: E402
from fedlase.train import LocalWork, client_batches, local_train  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models here run fastest on one thread (the machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


# =========================================================================== local training

def test_client_batches_cover_passes():
    # Prepare
    gen = torch.Generator().manual_seed(0)
    # Execute: 10 samples, batch 4, 5 steps -> pass 1: 4, 4, 2; pass 2: 4, 4
    batches = client_batches(10, LocalWork(steps=5, batch_size=4), gen)
    # Assert
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4]
    assert sorted(torch.cat(batches[:3]).tolist()) == list(range(10))
    assert LocalWork(epochs=1.5, batch_size=4).num_steps(10) == 4      # ceil(1.5 * 10 / 4)
    assert LocalWork(epochs=0.01, batch_size=4).num_steps(10) == 1
    assert [len(b) for b in client_batches(3, LocalWork(steps=2, batch_size=8), gen)] == [3, 3]


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
        sub = build_method("fiarse", model, {}, [1.0, 0.25]).submodel(params, 0.25, 1)
    work = LocalWork(steps=4, batch_size=8, optimizer=optimizer, lr=0.1, momentum=0.9, weight_decay=0.1)
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


def _linear_case(sub: Submodel, steps: int):
    """Linear(2 -> 2, no bias) with W = [[-0.6, 0.9], [0.55, 0.9]], one sample x = (1, 0), label 0, SGD lr 0.1.

    logits = (W00, W10); dL/dW00 = -p1, dL/dW10 = p1 with p1 = sigmoid(W10 - W00); column 1 gets no gradient."""
    model = nn.Linear(2, 2, bias=False)
    w0 = torch.tensor([[-0.6, 0.9], [0.55, 0.9]], dtype=torch.float64)
    model = model.double()
    x, y = torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([0])
    work = LocalWork(steps=steps, batch_size=1, lr=0.1)
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
    assert derive_seed(0, 3, 1, 7) == derive_seed(0, 3, 1, 7)
    assert len({derive_seed(0, r, 0) for r in range(50)} | {derive_seed(1, 0, 0)}) == 51


@pytest.fixture(scope="module")
def exp20():
    """An experiment of 20 clients at three levels (not run: for sampling and evaluation)."""
    cfg = load_config(None, [*TINY, "system={1,1/4,1/16}_{4,6,10}", "participation={0.1,0.25,0.5}", "out=/nonexistent"])
    return Experiment(cfg)


def test_sampling_is_deterministic_and_per_round(exp20):
    # Execute
    first = {r: exp20.sample(r) for r in range(1, 61)}
    again = {r: exp20.sample(r) for r in reversed(range(1, 61))}     # other order: same draws
    other = Experiment.__new__(Experiment)
    other.cfg = exp20.cfg
    # Assert
    assert first == again
    assert all(other.sample(r) == first[r] for r in (1, 17, 60))
    sizes = {len(p) for p in first.values()}
    assert sizes == {2, 5, 10}                       # 0.1, 0.25 and 0.5 of 20 clients, each drawn
    assert len({tuple(c for c, _ in p) for p in first.values()}) > 30   # rounds differ
    for p in first.values():
        clients = [c for c, _ in p]
        assert clients == sorted(set(clients)) and all(0 <= c < 20 for c in clients)
        assert all(lvl == exp20.cfg.client_levels[c] for c, lvl in p)   # fixed assignment by client index
    assert exp20.cfg.client_levels == [1.0] * 4 + [0.25] * 6 + [1 / 16] * 10


def test_sampling_depends_on_the_seed(tiny_cfg):
    a = Experiment.__new__(Experiment)
    b = Experiment.__new__(Experiment)
    a.cfg = tiny_cfg("system={1}_{20}", "participation=0.25")
    b.cfg = tiny_cfg("system={1}_{20}", "participation=0.25", "seed=1")
    assert [a.sample(r) for r in range(1, 11)] != [b.sample(r) for r in range(1, 11)]
    assert all(len(a.sample(r)) == 5 for r in range(1, 11))


def test_random_assignment_redraws_levels(tiny_cfg):
    exp = Experiment.__new__(Experiment)
    exp.cfg = tiny_cfg("system={1,1/4}_{10,10}", "participation=1", "assignment=random")
    draws = [exp.sample(r) for r in range(1, 6)]
    for p in draws:
        assert [c for c, _ in p] == list(range(20)) and sorted(lvl for _, lvl in p) == [0.25] * 10 + [1.0] * 10
    assert len({tuple(lvl for _, lvl in p) for p in draws}) > 1


def test_evaluate_reports_every_level(exp20):
    # Execute
    res = exp20.evaluate(0)
    # Assert: all levels, client counts as in the system, FIARSE's kept count int(level * maskable)
    total = sum(exp20.params[n].numel() for n in exp20.method.maskable)
    assert list(res["levels"]) == ["1", "1/4", "1/16"]
    assert [v["clients"] for v in res["levels"].values()] == [4, 6, 10]
    assert [v["kept"] for v in res["levels"].values()] == [total, int(total / 4), int(total / 16)]
    for v in res["levels"].values():
        for key in ("global_acc", "local_acc", "local_std", "local_worst10"):
            assert math.isfinite(v[key]) and 0 <= v[key] <= 1
        assert v["local_worst10"] <= v["local_acc"]
    assert res["global_acc"] == pytest.approx(sum(v["global_acc"] for v in res["levels"].values()) / 3)


def test_evaluate_random_assignment_uses_every_client(tiny_cfg):
    exp = Experiment(tiny_cfg("system={1,1/4}_{1,3}", "assignment=random"))
    res = exp.evaluate(0)
    assert [v["clients"] for v in res["levels"].values()] == [4, 4]


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
    return torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=False)


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

@pytest.mark.parametrize("method", sorted(METHODS))
def test_end_to_end_each_method(tmp_path, tiny_cfg, method):
    # Prepare
    cfg = tiny_cfg(f"method={method}", "system={1,1/4}_{2,2}", "rounds=2", "eval_every=1")
    # Execute
    summary = run_experiment(cfg, progress=False)
    # Assert
    out = Path(cfg.out)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert summary["rounds"] == 2 and summary["num_clients"] == 4 and summary["config"]["method"] == method
    assert summary["train_time"] >= 0
    final = summary["final"]
    assert final["round"] == 2 and list(final["levels"]) == ["1", "1/4"]
    assert [v["clients"] for v in final["levels"].values()] == [2, 2]
    for v in [final, *final["levels"].values()]:
        for key in ("global_acc", "local_acc"):
            assert math.isfinite(v[key]) and 0 <= v[key] <= 1, (key, v)
    assert math.isfinite(final["train_loss"])
    assert _metric_rounds(out) == [1, 2]
    exp_total = sum(p.numel() for n, p in _final_params(out)["params"].items()
                    if n in maskable_names(build_model("cnn", 1, 10, 0.25, image_size=8)))
    kept = {lvl: v["kept"] for lvl, v in final["levels"].items()}
    assert kept["1/4"] <= kept["1"] <= exp_total
    if method == "fedavg":
        assert kept == {"1": exp_total, "1/4": exp_total}
    if method == "fiarse":
        assert kept == {"1": exp_total, "1/4": int(exp_total / 4)}
