"""FedLMT and pFedLMT (issue 41): the factorized convolution against the dense one, ranks from the budget, the
one-line refusal of a level below the floor, each method's 2 rounds on the embedded engine, pFedLMT's own parts
(kept per client, never averaged, evaluated as the client's own model) and their bit-identical resume."""
import math

import pytest
import torch
import torch.nn.functional as F

from fedlase.cli import main
from fedlase.client import local_work
from fedlase.cost import level_costs
from fedlase.engine import Experiment, run_experiment
from fedlase.errors import ConfigError
from fedlase.levels import System
from fedlase.methods.fedlmt import FedLMT, PFedLMT
from fedlase.models import build_model
from fedlase.models.factorized import FactorizedConv2d, as_matrix, compose, decompose
from fedlase.simtime import SimClock, client_steps
from fedlase.train import local_train

LMT = [["method=fedlmt"], ["method=fedlmt", "batched_clients=true"], ["method=pfedlmt"]]


@pytest.mark.numerics
@pytest.mark.parametrize("stride", [1, 2])
def test_factorized_conv_is_the_dense_conv_of_the_composed_weight(stride):
    torch.manual_seed(0)
    f = FactorizedConv2d(5, 7, 4, stride).double()
    x = torch.randn(2, 5, 9, 9, dtype=torch.float64)
    w = compose(f.first.weight, f.second.weight)
    assert torch.allclose(f(x), F.conv2d(x, w, stride=stride, padding=1), atol=1e-12)
    # the layout: rows (o, h), columns (i, w): W.permute(0, 2, 1, 3).reshape(21, 15) = U V^T
    u = f.second.weight[..., 0].permute(0, 2, 1).reshape(21, 4)       # U[(o, h), k] = second[o, k, h, 0]
    v = f.first.weight[:, :, 0, :].permute(1, 2, 0).reshape(15, 4)    # V[(i, w), k] = first[k, i, 0, w]
    assert torch.allclose(as_matrix(w), u @ v.T, atol=1e-12)
    assert int(torch.linalg.matrix_rank(as_matrix(w))) == 4


@pytest.mark.numerics
def test_decompose_is_the_best_rank_r_approximation_and_nested():
    torch.manual_seed(1)
    w = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    s = torch.linalg.svdvals(as_matrix(w))
    first, second = decompose(w, 5)
    for r in (1, 3, 5):   # the first r columns: the rank-r truncated SVD (Eckart-Young error)
        err = torch.linalg.matrix_norm(as_matrix(compose(first[:r], second[:, :r]) - w))
        assert math.isclose(float(err), float(s[r:].norm()), rel_tol=1e-9)
    # the authors' decom(): the SVD of W.reshape(18, 12), without the permutation, loaded into the two
    # convolutions as their U and V: the convolution they compose to approximates W worse than the optimum
    u, sv, vh = torch.linalg.svd(w.reshape(18, 12), full_matrices=False)
    naive = (u[:, :3] * sv[:3]) @ vh[:3]   # as_matrix of what the two convolutions compute
    assert torch.linalg.matrix_norm(naive - as_matrix(w)) > float(s[3:].norm()) * 1.01


@pytest.mark.parametrize("cls", [FedLMT, PFedLMT])
@pytest.mark.parametrize("arch, shape", [("cnn", (1, 10, 0.5, "batch", 28)), ("resnet18", (3, 10, 0.125, "batch", 8))])
def test_the_plan_read_off_the_factorized_model_is_the_dense_ones(cls, arch, shape):
    # the method plans its ranks again on the model prepare_model_for factorized (nothing is kept on the model):
    # the same ratios, shares and rule as planned on the dense model, exactly
    system = System.parse("{1,1/4}_{1,1}")
    dense = build_model(arch, *shape)
    planned = cls.ranks_for(dense, {}, system)
    method = cls(cls.prepare_model_for(dense, {}, system), system)
    assert any(isinstance(m, FactorizedConv2d) for m in method.model.modules())
    assert (method.alphas, method.shares, method.rule) == planned[:3]


def test_ranks_follow_the_budget_and_the_weakest_level_sets_fedlmts():
    system = System.parse("{1,1/4,1/16}_{1,1,1}")
    dense = build_model("cnn", 1, 10, 1.0, "batch", 28)
    budget = sum(p.numel() for n, p in dense.named_parameters() if "features.1." not in n and "features.5." not in n
                 and "features.9." not in n and "features.12." not in n)   # conv and linear: no BN
    m = FedLMT(build_model("cnn", 1, 10, 1.0, "batch", 28), system)
    held = sum(p.numel() for n in m.maskable for p in [dict(m.model.named_parameters())[n]])
    assert held <= budget / 16 and held > budget / 32   # the largest ratio that fits 1/16, not far below it
    assert len(set(m.alphas.values())) == 1 and m.submodel({}, system.levels[0], 1).is_whole()
    assert isinstance(m.model.features[4], FactorizedConv2d) and not isinstance(m.model.features[0], FactorizedConv2d)
    p = PFedLMT(build_model("cnn", 1, 10, 1.0, "batch", 28), system)
    assert p.alphas["1"] > p.alphas["1/4"] > p.alphas["1/16"]
    assert not isinstance(p.model.features[4], FactorizedConv2d)   # decom_rule 1: the prefix stays full-rank
    params = {n: t.detach() for n, t in p.model.named_parameters()}
    for lvl in system.levels:
        kept = p.submodel(params, lvl, 1).kept(p.maskable, params)
        assert kept <= float(lvl) * budget + 1e-9


def test_level_below_the_floor_is_refused_in_one_line(tmp_path, capsys):
    code = main(["run", "dataset=digits", "model=cnn", "width=0.25", "system={1,1/64}_{2,2}", "method=fedlmt",
                 "rounds=2", f"out={tmp_path / 'r'}", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "r").exists()
    # by hand, the quarter-width CNN on digits: convs 1->8, 8->16, 16->32, 32->64 and a 64->10 linear hold 24,914;
    # at the smallest ratio (0.5/16, just above) the ranks are 1, 1, 2: 72 + 3*1*24 + 3*1*48 + 3*2*96 + 650 = 1,514
    assert err.startswith("fedlase: error: system: fedlmt cannot meet level 1/64 on SmallCNN")
    assert f"holds 1/{24914 / 1514:.1f} of its dense parameters, so the smallest feasible level is 1/16" in err
    with pytest.raises(ConfigError, match="pfedlmt cannot meet level 1/16 on ResNet18.*smallest feasible level is 1/6"):
        PFedLMT(build_model("resnet18", 3, 10, 0.25, "batch", 8), System.parse("{1,1/16}_{1,1}"))


@pytest.mark.parametrize("args", LMT, ids=" ".join)
def test_two_rounds_on_the_embedded_engine(tiny_cfg, args):
    cfg = tiny_cfg(*args)
    summary = run_experiment(cfg, progress=False)
    levels = summary["final"]["levels"]
    assert summary["rounds"] == 2 and all(math.isfinite(v["local_acc"]) and math.isfinite(v["global_acc"])
                                          for v in levels.values())
    ckpt = torch.load(f"{cfg.out}/checkpoint.pt", weights_only=True)
    assert "features.8.first.weight" in ckpt["params"] and "features.8.weight" not in ckpt["params"]
    kept = [v["kept"] for v in levels.values()]
    assert (kept[0] == kept[1]) == (args[0] == "method=fedlmt")   # fedlmt: one rank; pfedlmt: the level's


def test_fedlmt_averages_the_factors_not_their_product(tiny_cfg):
    exp = Experiment.from_config(tiny_cfg("method=fedlmt", "robust=screen"))   # the plain mean (the default clips)
    old = {n: t.clone() for n, t in exp.params.items()}
    picked = exp.sample(1)
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    # each client's update, seeded as the round's own
    deltas = [exp.trainer.update(c, exp.params, exp.buffers, subs[lvl], 1)[0] for c, lvl in picked]
    exp.run_round(1)
    u, v = "features.11.second.weight", "features.11.first.weight"
    for n in (u, v):
        assert torch.allclose(exp.params[n], old[n] + sum(d[n] for d in deltas) / len(deltas), atol=1e-6)
    mean_product = sum(compose(old[v] + d[v], old[u] + d[u]) for d in deltas) / len(deltas)
    assert not torch.allclose(compose(exp.params[v], exp.params[u]), mean_product, atol=1e-6)


def test_pfedlmt_keeps_each_clients_part_and_averages_the_prefix(tiny_cfg):
    exp = Experiment.from_config(tiny_cfg("method=pfedlmt"))
    seed = {n: t.clone() for n, t in exp.params.items()}
    picked = exp.sample(1)
    exp.run_round(1)
    m = exp.method
    for n, t in exp.params.items():   # the shared prefix moved; the global copy of the own part stays the seed
        assert torch.equal(t, seed[n]) == (n in m.custom), n
    for client, lvl in picked:
        own = m.own[lvl.name][client]
        assert set(own) == set(m.custom)
        sub = m.submodel(exp.params, lvl, 1)
        small = sub.gather(seed)
        assert any(not torch.equal(own[n], small[n]) for n in own)   # trained, at the level's size
        assert all(own[n].shape == small[n].shape for n in own)
        # evaluated as its own model: the level's weights with its own part
        w = m.personal_weights(client, lvl, sub.gather(exp.params), sub)
        assert all(w[n] is own[n] for n in own)
    others = {c for c in range(4)} - {c for c, _ in picked}
    assert all(c not in per for per in m.own.values() for c in others)


def test_pfedlmt_resumed_run_is_bit_identical(tiny_cfg, tmp_path):
    whole = run_experiment(tiny_cfg("method=pfedlmt", out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg("method=pfedlmt", "rounds=1", out=str(tmp_path / "part")), progress=False)
    resumed = run_experiment(tiny_cfg("method=pfedlmt", out=str(tmp_path / "part")), resume=True, progress=False)
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert a["round"] == b["round"] == 2
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    own_a, own_b = a["method"]["own"], b["method"]["own"]
    assert own_a.keys() == own_b.keys() and sum(len(v) for v in own_a.values()) >= 2
    for lvl in own_a:
        assert own_a[lvl].keys() == own_b[lvl].keys()
        assert all(torch.equal(own_a[lvl][c][n], own_b[lvl][c][n]) for c in own_a[lvl] for n in own_a[lvl][c])
    assert whole["final"]["levels"] == resumed["final"]["levels"]


@pytest.mark.parametrize("cls", [FedLMT, PFedLMT])
def test_resnet18_trains_at_its_own_size(cls):
    torch.manual_seed(0)
    system = System.parse("{1,1/4}_{1,1}")
    m = cls(build_model("resnet18", 3, 10, 0.125, "batch", 8), system, decom_rule=2)
    params = {n: t.detach() for n, t in m.model.named_parameters()}
    sub = m.submodel(params, system.levels[1], 1)
    weights = sub.gather(params)
    x, y = torch.randn(8, 3, 8, 8), torch.arange(8) % 10
    delta, loss = local_train(m.model, params, {}, sub, x, y, [torch.arange(8)], local_work(steps=1), scatter=False)
    assert math.isfinite(loss) and all(delta[n].shape == weights[n].shape for n in delta)   # trained at its size
    assert (sub.slices != {}) == (cls is PFedLMT)   # pfedlmt's 1/4 is a rank slice; fedlmt's model is small itself
    assert isinstance(m.model.layer2[0].conv1, FactorizedConv2d)
    assert not isinstance(m.model.layer1[1].conv1, FactorizedConv2d)   # before decom_rule 2: full-rank
    held = sum(t.numel() for n, t in weights.items() if n in m.maskable)
    budget = sum(p.numel() for n, p in build_model("resnet18", 3, 10, 0.125, "batch", 8).named_parameters()
                 if p.dim() > 1 or n == "linear.bias")
    assert held <= budget / 4


@pytest.mark.parametrize("method", ["fedlmt", "pfedlmt"])
def test_cost_and_clock_charge_each_level_its_own_model(tiny_cfg, method):
    cfg = tiny_cfg(f"method={method}", "device_model.speed=2e6", "device_model.bandwidth=1e5")
    exp = Experiment.from_config(cfg)
    costs = level_costs(exp.model, exp.method, exp.trainer, exp.levels, exp.level_clients, exp.params, exp.buffers)
    for c, lvl in zip(costs, exp.levels):
        sub = exp.method.submodel(exp.params, lvl, 1)
        held = sum(t.numel() for t in sub.gather(exp.params).values())
        assert c.held == held and c.sparse_flops == c.step_flops   # what it holds; a factorized model is dense
        # payload: the level's model each way (its values, and the codec's mask bits and framing), not the top one
        assert all(4 * held <= b < 1.5 * 4 * held for b in (c.down_bytes, c.up_bytes)), (c, held)
    top, small = costs
    if method == "fedlmt":   # one (weakest-level) model at every level
        assert (top.held, top.step_flops, top.down_bytes) == (small.held, small.step_flops, small.down_bytes)
    else:   # the 1/4 level's rank slice: fewer parameters, FLOPs and bytes than level 1's
        assert small.held < top.held and small.step_flops < top.step_flops and small.down_bytes < top.down_bytes
    steps = client_steps(exp.trainer)
    clock = SimClock(cfg, costs, steps, "dense")
    client = exp.level_clients[exp.levels[1]][0]
    want = small.step_flops * steps[client] / (2e6 / 4) + (small.down_bytes + small.up_bytes) / (1e5 / 4)
    assert clock.client_time(client, 1) == pytest.approx(want)


def test_pfedlmt_can_leave_global_accuracy_out_and_is_reported_by_local_accuracy(tiny_cfg, tmp_path):
    from fedlase.report_clocks import equal_time_table, run_clocks
    from fedlase.report_runs import find_runs, group_runs
    s = run_experiment(tiny_cfg("method=pfedlmt", "method_args.global_eval=false", out=str(tmp_path / "runs" / "p")),
                       progress=False)
    final = s["final"]
    assert math.isnan(final["global_acc"]) and all(math.isnan(v["global_acc"]) for v in final["levels"].values())
    assert math.isfinite(final["local_acc"])
    groups = group_runs(find_runs([str(tmp_path / "runs")]), None)
    _, header, rows = equal_time_table(groups, run_clocks(groups)[1])
    cells = dict(zip(header, rows[0]))
    # one group: T is its own time to finish, so its local accuracy at T is its final one; no global at T
    assert cells["acc at T, dense (%)"] == "—"
    assert cells["local acc at T, dense (%)"] == f"{100 * final['local_acc']:.2f}"
