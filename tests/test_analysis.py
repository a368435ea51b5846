"""Trackers: hand-computed statistics on small fake experiments, and bit-identical resume on a real tiny run."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedlase.analysis import Magnitudes, Ratios, Tracker, Updates, gini, gini_from_histogram, ratio_std
from fedlase.config import load_config
from fedlase.engine import Experiment, run_experiment
from fedlase.errors import ConfigError
from fedlase.levels import System
from fedlase.masks import Submodel
from fedlase.options import Option
from fedlase.registry import TRACKERS, check_analysis, register_tracker, temporary

# the levels of the fake experiments: FULL = 1, HALF = 1/2
FULL, HALF = System.of([1.0, 0.5]).levels


def fake_exp(tmp_path, params, levels=(FULL, HALF), method=None):
    """The parts of an Experiment that trackers read."""
    method = method or SimpleNamespace()
    method.maskable = list(params)
    return SimpleNamespace(params=params, levels=tuple(levels), method=method, device=torch.device("cpu"),
                           cfg=SimpleNamespace(out=str(tmp_path)))


# ---- Gini and ratio_std by hand -------------------------------------------------------------------------------
def test_gini_hand_values():
    # [0,0,1,3]: sum over ordered pairs |xi-xj| = 20; G = 20 / (2 * 4^2 * mean 1) = 0.625
    assert gini([0, 0, 1, 3]) == pytest.approx(0.625)
    assert gini([0, 0, 0, 5]) == pytest.approx(0.75)   # (2*4-5)*5 / (4*5)
    assert gini([2, 2, 2]) == 0.0
    assert gini([0, 0]) == 0.0
    assert gini_from_histogram([2, 1, 0, 1]) == pytest.approx(0.625)   # the same [0,0,1,3] as a histogram


def test_gini_matches_pairwise_definition():
    x = np.random.default_rng(0).integers(0, 9, size=50)
    pairwise = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())
    assert gini(x) == pytest.approx(pairwise)


def test_ratio_std_hand_values():
    r = np.array([[0.5, 1.0], [0.7, 1.0], [0.6, 1.0]])   # 3 rounds x 2 layers
    assert ratio_std(r) == pytest.approx([np.sqrt(0.02 / 3), 0.0])   # population std of 0.5, 0.7, 0.6
    assert ratio_std(r, last=2) == pytest.approx([0.05, 0.0])


# ---- trackers on fake experiments ----------------------------------------------------------------------------
def test_updates_counts_and_summaries(tmp_path):
    params = {"a": torch.zeros(4), "b": torch.zeros(2)}
    exp = fake_exp(tmp_path, params)
    t = Updates(exp)
    half = Submodel({"a": torch.tensor([True, True, False, False])})   # b unmasked: trained whole
    # round 1: one client at level 1, two at 0.5; round 2: one client at 0.5
    t.on_round(1, [(0, FULL), (1, HALF), (2, HALF)], {FULL: Submodel(), HALF: half}, params, params)
    t.on_round(2, [(3, HALF)], {HALF: half}, params, params)
    assert t.counts["a"].tolist() == [4, 4, 1, 1] and t.counts["b"].tolist() == [4, 4]
    line = t.on_eval(2)["updates"]
    z = np.load(tmp_path / "analysis" / "updates.npz")
    assert list(z["layers"]) == ["a", "b"]
    assert z["mean"].tolist() == [2.5, 4.0] and z["min"].tolist() == [1, 4] and z["max"].tolist() == [4, 4]
    assert z["never"].tolist() == [0.0, 0.0]
    assert z["gini"] == pytest.approx([gini([4, 4, 1, 1]), 0.0])
    assert gini([4, 4, 1, 1]) == pytest.approx(0.3)   # sum_i (2i-5) x_i = -3-1+4+12 = 12; 12 / (4 * 10)
    assert z["hist"][0].tolist() == [0, 2, 0, 0, 2]
    assert line["gini"] == pytest.approx(gini([4, 4, 1, 1, 4, 4])) and line["clients"] == 4
    assert line["never"] == 0.0 and line["mean"] == pytest.approx(18 / 6)


def test_ratios_fill_unsampled_levels_and_ratio_std(tmp_path):
    params = {"a": torch.zeros(4), "b": torch.zeros(2)}
    calls = []

    def submodel(p, level, rnd):   # what the method would give an unsampled level
        calls.append((level, rnd))
        return Submodel({"a": torch.tensor([True, False, False, False]), "b": torch.tensor([True, True])})

    exp = fake_exp(tmp_path, params, method=SimpleNamespace(submodel=submodel))
    t = Ratios(exp, {"last": 2})
    subs = [Submodel({"a": torch.tensor([True, True, False, False])}),
            Submodel({"a": torch.tensor([True, True, True, False])}),
            Submodel({"a": torch.tensor([True, True, True, True])})]
    for rnd, s in enumerate(subs, 1):
        picked = [(0, FULL), (1, HALF)] if rnd < 3 else [(0, FULL)]
        t.on_round(rnd, picked, {FULL: Submodel(), **({HALF: s} if rnd < 3 else {})}, params, params)
    assert calls == [(HALF, 3)]
    r = t.ratios()   # (levels, rounds, layers)
    assert r[1, :, 0].tolist() == [0.5, 0.75, 0.25] and r[1, :, 1].tolist() == [1, 1, 1] and (r[0] == 1).all()
    line = t.on_eval(3)
    z = np.load(tmp_path / "analysis" / "ratios.npz")
    assert z["ratios"].shape == (2, 3, 2) and z["rounds"].tolist() == [1, 2, 3]
    assert z["levels"].tolist() == [1.0, 0.5]
    assert z["ratio_std"][1] == pytest.approx([0.25, 0.0])   # last 2 rounds: 0.75, 0.25
    assert line["ratio_std"] == pytest.approx({"1": 0.0, "1/2": 0.125})


def test_magnitudes_at_chosen_rounds(tmp_path):
    p0 = {"a": torch.tensor([1.0, -3.0]), "b": torch.tensor([0.5])}
    p1 = {"a": torch.tensor([-2.0, 4.0]), "b": torch.tensor([-1.0])}
    exp = fake_exp(tmp_path, p1)
    t = Magnitudes(exp, Magnitudes.parse_options([0, 2]))
    t.on_round(1, [], {}, p0, p1)
    t.on_round(2, [], {}, p1, p1)
    t.on_eval(2)
    z = np.load(tmp_path / "analysis" / "magnitudes.npz")
    assert z["rounds"].tolist() == [0, 2]
    assert z["max"].tolist() == [[3.0, 0.5], [4.0, 1.0]] and z["mean"].tolist() == [[2.0, 0.5], [3.0, 1.0]]


def test_analysis_options_are_validated():
    assert check_analysis({"ratios": True, "updates": False, "magnitudes": [1, 5]}) == {
        "ratios": {}, "magnitudes": {"rounds": [1, 5]}}
    for bad, key in (({"ratio": True}, "analysis.ratio"), ({"ratios": {"last": 0}}, "analysis.ratios.last"),
                     ({"ratios": {"window": 3}}, "analysis.ratios.window"),
                     # the list shorthand of magnitudes is its option `rounds`, and the error names that option
                     ({"magnitudes": [1, -2]}, "analysis.magnitudes.rounds"),
                     ({"magnitudes": {"rounds": [1, -2]}}, "analysis.magnitudes.rounds"),
                     ({"magnitudes": {"rounds": 3}}, "analysis.magnitudes.rounds"),
                     ({"ratios": {"last": float("inf")}}, "analysis.ratios.last"),
                     ({"updates": {"last": 2}}, "analysis.updates.last"),
                     ({"updates": 3}, "analysis.updates")):
        with pytest.raises(ConfigError) as e:
            check_analysis(bad)
        assert e.value.key == key
        assert str(e.value).startswith(f"{key}: ") and "\n" not in str(e.value)
    assert check_analysis({"magnitudes": {"rounds": [0, 3]}, "ratios": {"last": 4}}) == {
        "magnitudes": {"rounds": [0, 3]}, "ratios": {"last": 4}}


# ---- a real run: trackers do not change training and survive resume bit-identically --------------------------
ALL = ["analysis.ratios.last=2", "analysis.updates=true", "analysis.magnitudes=true"]


def test_trackers_resume_bit_identically(tiny_cfg, tmp_path):
    whole = run_experiment(tiny_cfg(*ALL, "rounds=4", out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg(*ALL, "rounds=2", out=str(tmp_path / "split")), progress=False)
    split = run_experiment(tiny_cfg(*ALL, "rounds=4", out=str(tmp_path / "split")), resume=True, progress=False)
    plain = run_experiment(tiny_cfg("rounds=4", out=str(tmp_path / "plain")), progress=False)
    for key in ("global_acc", "local_acc", "ratio_std", "updates"):
        assert whole["final"][key] == split["final"][key]
    assert whole["final"]["levels"] == plain["final"]["levels"]   # analyses never change training
    for name in ("ratios", "updates", "magnitudes"):
        a, b = (np.load(tmp_path / run / "analysis" / f"{name}.npz") for run in ("whole", "split"))
        assert set(a) == set(b)
        for k in a:
            assert np.array_equal(a[k], b[k]), (name, k)
    z = np.load(tmp_path / "whole/analysis/magnitudes.npz")
    assert z["rounds"].tolist() == [1, 2, 3, 4]
    z = np.load(tmp_path / "whole/analysis/updates.npz")
    assert int(z["clients"]) == 4 * 2 and z["hist"].sum(axis=1).tolist() == z["size"].tolist()
    lines = [json.loads(ln) for ln in (tmp_path / "whole/metrics.jsonl").read_text().splitlines()]
    assert all("ratio_std" in ln and "updates" in ln for ln in lines)


def test_unknown_analysis_is_a_config_error():
    # the engine builds trackers from the registry; a name it does not hold never gets that far
    with pytest.raises(ConfigError, match="analysis.sizes") as e:
        load_config(None, ["analysis.sizes=true"])
    assert e.value.key == "analysis.sizes" and "magnitudes, ratios, updates" in str(e.value)
    with pytest.raises(ConfigError, match="analysis.sizes"):
        check_analysis({"sizes": True})


def test_engine_builds_registered_trackers_with_their_options(tiny_cfg):
    # Prepare: a tracker defined outside the package, with an option declared in its options_spec
    seen = []

    class Counter(Tracker):
        key = "counter_test"
        options_spec = {"every": Option(1, "count every N rounds", low=1)}

        def on_round(self, rnd, picked, submodels, old_params, new_params):
            assert all(lvl in submodels for _, lvl in picked)
            seen.append((rnd, self.options.get("every"), [c for c, _ in picked]))

    with temporary(TRACKERS):
        register_tracker(Counter)
        with pytest.raises(ConfigError) as e:
            tiny_cfg("analysis.counter_test.every=0")
        assert e.value.key == "analysis.counter_test.every"
        with pytest.raises(ConfigError) as e:
            tiny_cfg("analysis.counter_test.often=1")
        assert e.value.key == "analysis.counter_test.often"
        cfg = tiny_cfg("analysis.counter_test.every=2", "analysis.ratios=true")
        assert check_analysis(cfg.analysis) == {"ratios": {}, "counter_test": {"every": 2}}
        # Execute
        exp = Experiment.from_config(cfg)
        # Assert: registry order, options checked; the tracker is called once per round with the aggregated clients
        assert [type(t) for t in exp.trackers] == [Ratios, Counter] and exp.trackers[1].options == {"every": 2}
        for rnd in (1, 2):
            exp.run_round(rnd)
            exp.state.round = rnd
        assert [(r, every) for r, every, _ in seen] == [(1, 2), (2, 2)]
        assert [clients for *_, clients in seen] == [[c for c, _ in exp.sample(r)] for r in (1, 2)]
    assert "counter_test" not in TRACKERS


# ---- TensorBoard ------------------------------------------------------------------------------------------------
def _events(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of a folder, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_the_metrics_per_round_and_level(tiny_cfg, tmp_path):
    pytest.importorskip("tensorboard")
    # Prepare: 3 rounds, evaluated at rounds 2 and 3; the folder given as the analysis' value
    tb = tmp_path / "tb"
    cfg = tiny_cfg("rounds=3", "eval_every=2", f"analysis.tensorboard={tb}", out=str(tmp_path / "run"))
    assert check_analysis(cfg.analysis) == {"tensorboard": {"dir": str(tb)}}
    # Execute
    summary = run_experiment(cfg, progress=False)
    ev = _events(tb)
    # Assert: what metrics.jsonl holds, at the rounds it was written (float32 in the event files)
    lines = [json.loads(ln) for ln in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [2, 3]
    for ln in lines:
        for lvl, m in ln["levels"].items():
            for name in ("global_acc", "local_acc", "kept"):
                assert dict(ev[f"{name}/level {lvl}"])[ln["round"]] == pytest.approx(m[name], rel=1e-6)
        assert dict(ev["global_acc"])[ln["round"]] == pytest.approx(ln["global_acc"], rel=1e-6)
    assert [s for s, _ in ev["global_acc"]] == [2, 3]
    # every round: the training loss, and per level trained its clients and kept share
    assert [s for s, _ in ev["train_loss"]] == [1, 2, 3]
    assert dict(ev["train_loss"])[3] == pytest.approx(summary["final"]["train_loss"], rel=1e-6)
    assert ev["trained_kept_share/level 1"] and all(v == 1.0 for _, v in ev["trained_kept_share/level 1"])
    shares = [v for _, v in ev.get("trained_kept_share/level 1/4", [])]
    assert shares and all(0 < v < 1 for v in shares)
    assert sum(v for tag, pts in ev.items() if tag.startswith("trained_clients/") for s, v in pts if s == 1) == 2


def test_tensorboard_default_folder_and_a_resumed_run_continues(tiny_cfg, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    run_experiment(tiny_cfg("rounds=2", "analysis.tensorboard=true", out=str(out)), progress=False)
    run_experiment(tiny_cfg("rounds=3", "analysis.tensorboard=true", out=str(out)), resume=True, progress=False)
    ev = _events(out / "tensorboard")
    assert [s for s, _ in ev["train_loss"]] == [1, 2, 3]   # the resumed run continues, no round twice
    assert [s for s, _ in ev["global_acc"]] == [1, 2, 3]
