"""FjORD, DepthFL and FedDSE (issue 21): submodels against hand counts, the local objectives, aggregation by
hand, a resumed run bit-identical to an uninterrupted one, the CLI's one-line error for a level DepthFL cannot
meet, and `fedlase methods`."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fedlase.aggregate import aggregate
from fedlase.cli import main
from fedlase.client import local_work
from fedlase.engine import Update, run_experiment
from fedlase.errors import ConfigError
from fedlase.levels import System
from fedlase.methods.depthfl import DepthFL, DepthObjective, kd_weight
from fedlase.methods.feddse import CHOICE, FedDSE, top_channels
from fedlase.methods.fjord import FjORD
from fedlase.models import build_model
from fedlase.train import local_train

# the quarter-width CNN on 8x8 digits: channels 8, 16, 32, 64; features = conv bn relu pool, conv bn relu pool,
# conv bn relu, conv bn relu (conv indices 0, 4, 8, 11)
CONVS = {"features.0.weight": (8, 1), "features.4.weight": (16, 8), "features.8.weight": (32, 16),
         "features.11.weight": (64, 32)}


def cnn(seed=0):
    torch.manual_seed(seed)
    return build_model("cnn", 1, 10, 0.25, "batch", 8)


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fjord_slices_and_widths_per_batch_by_hand():
    model = cnn()
    system = System.parse("{1,1/4,1/16}_{1,1,1}")
    m = FjORD(model, system)
    params = params_of(model)
    lv1, lv4, lv16 = system.levels
    assert m.allowed[lv4] == [0.25, 0.5] and m.allowed[lv16] == [0.25] and m.allowed[lv1] == [0.25, 0.5, 1.0]
    sub = m.submodel(params, lv4, 1)
    for name, (out, cin) in CONVS.items():   # rate 1/2: ceil(K/2) outputs, inputs follow (the image stays whole)
        keep_in = cin if cin == 1 else math.ceil(cin / 2)
        assert int(sub.masks[name].sum()) == math.ceil(out / 2) * keep_in * 9, name
        assert bool(sub.masks[name][: math.ceil(out / 2), :keep_in].all())   # the first channels
    assert int(sub.masks["classifier.weight"].sum()) == 10 * 32 and "classifier.bias" not in sub.masks
    # per batch: a width drawn uniformly from {1/4, 1/2}; 1/4 cuts the held slice to its first channels
    seen = []

    def forward(w, b, x):
        seen.append(tuple(w["features.4.weight"].shape))
        return torch.zeros(len(x), 10, requires_grad=True)

    small = sub.gather(params)
    torch.manual_seed(0)
    for _ in range(200):
        sub.local.loss(forward, small, {}, torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    assert set(seen) == {(8, 4, 3, 3), (4, 2, 3, 3)}
    assert 70 < seen.count((4, 2, 3, 3)) < 130
    # the full level holds the whole model and draws from all three widths
    assert m.submodel(params, lv1, 1).masks == {} and len(m.submodel(params, lv1, 1).local.widths) == 3


def test_fjord_distillation_loss_by_hand():
    model = cnn()
    system = System.parse("{1,1/4}_{1,1}")
    m = FjORD(model, system, distill=True)
    params = params_of(model)
    sub = m.submodel(params, system.levels[1], 1)
    x, y = torch.randn(6, 1, 8, 8), torch.arange(6) % 10
    small_w = sub.gather(params)

    def forward(w, b, xb):
        return torch.func.functional_call(model, (w, b), (xb,))

    torch.manual_seed(3)
    got = sub.local.loss(forward, small_w, {}, x, y)
    torch.manual_seed(3)
    cut = sub.local.widths[int(torch.randint(2, ()))]
    full = forward(small_w, {}, x)
    part = forward(*sub.local._cut(cut, small_w, {}), x)
    want = F.cross_entropy(full, y) - (F.softmax(full, -1) * F.log_softmax(part, -1)).sum(1).mean()
    assert torch.allclose(got, want, atol=1e-6)


def test_fjord_rejects_widths_no_level_fits():
    with pytest.raises(ConfigError, match="method_args.widths: no width rate fits level 1/64"):
        FjORD(cnn(), System.parse("{1,1/64}_{1,1}"), widths="uniform5")


def test_fjord_aggregation_by_hand():
    model = cnn()
    system = System.parse("{1,1/4}_{1,1}")
    m = FjORD(model, system)
    params = params_of(model)
    big, small = (m.submodel(params, lv, 1) for lv in system.levels)
    d_big = {n: torch.full_like(p, 2.0) for n, p in params.items()}
    d_small = {n: torch.full_like(p, 4.0) * small.masks[n] if n in small.masks else torch.full_like(p, 4.0)
               for n, p in params.items()}
    new = aggregate(params, [(d_big, big), (d_small, small)], m.aggregation, m.coverage)
    w = "features.4.weight"
    step = new[w] - params[w]
    assert torch.allclose(step[:8, :4], torch.full((8, 4, 3, 3), 3.0))     # both clients: (2 + 4) / 2
    assert torch.allclose(step[8:], torch.full((8, 8, 3, 3), 2.0))         # the full client alone
    assert torch.allclose(new["classifier.bias"] - params["classifier.bias"], torch.full((10,), 3.0))


def test_depthfl_shares_depths_and_masks_by_hand():
    model = cnn()
    m = DepthFL(model, System.parse("{1,1/4,1/16,1/64}_{1,1,1,1}"), heads="linear")
    convs = [8 * 1 * 9, 16 * 8 * 9, 32 * 16 * 9, 64 * 32 * 9]
    heads = [8 * 10 + 10, 16 * 10 + 10, 32 * 10 + 10]
    total = sum(convs) + sum(heads) + 64 * 10 + 10
    want = [(convs[0] + heads[0]) / total, (sum(convs[:2]) + heads[0] + heads[1]) / total,
            (sum(convs[:3]) + sum(heads)) / total, 1.0]
    assert m.shares == pytest.approx(want, abs=1e-12)
    # each level gets the deepest depth within its budget
    fits = lambda lv: max(d for d, s in enumerate(want, 1) if s <= lv)   # noqa: E731
    assert [m.depths[lv] for lv in m.system.levels] == [fits(float(lv)) for lv in m.system.levels]
    params = params_of(model)
    lvl = m.system.levels[-1]
    d = m.depths[lvl]
    sub = m.submodel(params, lvl, 1)
    held = {n for n, p in params.items() if n not in sub.masks}
    assert d == 1 and held == {n for n in params if n.startswith(("features.0.", "features.1.", "exit_heads.0."))}
    assert all(not bool(mask.any()) for mask in sub.masks.values())
    assert sub.kept(m.maskable, params) == convs[0] + heads[0]
    weights, buffers = sub.model(params, dict(model.named_buffers()))
    assert buffers["exit_depth"].numel() == 1   # the evaluated network is one stage deep
    with torch.no_grad():
        out = torch.func.functional_call(model, (weights, buffers), (torch.randn(3, 1, 8, 8),))
    assert out.shape == (3, 10)


def test_depthfl_bottleneck_level_too_small_is_one_config_error():
    with pytest.raises(ConfigError) as e:
        DepthFL(cnn(), System.parse("{1,1/64}_{1,1}"))
    msg = str(e.value)
    m = DepthFL(cnn(), System.parse("{1}_{1}"))
    assert msg.startswith("system: depthfl cannot meet level 1/64")
    assert f"smallest feasible level is 1/{math.floor(1 / m.shares[0])} " in msg and "\n" not in msg


def test_depthfl_loss_by_hand():
    z = torch.randn(3, 5, 10)
    y = torch.arange(5)
    kd = kd_weight(101, 300)
    assert kd == pytest.approx(math.exp(-5 * (1 - 100 / 300) ** 2)) and kd_weight(400, 300) == 1.0
    got = DepthObjective(3, kd).loss(lambda w, b, x, depth, all_exits: z, {}, {}, None, y)
    p = F.softmax(z, -1)
    want = sum(F.cross_entropy(z[i], y) for i in range(3))
    for i in range(3):
        want = want + kd / 2 * sum((p[j] * (p[j].log() - p[i].log())).sum(1).mean() for j in range(3) if j != i)
    assert torch.allclose(got, want, atol=1e-6)


def test_depthfl_aggregation_by_hand():
    model = cnn()
    system = System.parse("{1,1/64}_{1,1}")
    m = DepthFL(model, system, heads="linear")
    params = params_of(model)
    deep, shallow = (m.submodel(params, lv, 1) for lv in system.levels)
    d1 = {n: torch.full_like(p, 1.0) for n, p in params.items()}
    d2 = {n: torch.full_like(p, 3.0) * shallow.masks[n] if n in shallow.masks else torch.full_like(p, 3.0)
          for n, p in params.items()}
    new = aggregate(params, [(d1, deep), (d2, shallow)], m.aggregation, m.coverage)
    assert torch.allclose(new["features.0.weight"] - params["features.0.weight"], torch.full((8, 1, 3, 3), 2.0))
    assert torch.allclose(new["features.4.weight"] - params["features.4.weight"], torch.full((16, 8, 3, 3), 1.0))
    assert torch.allclose(new["exit_heads.0.fc.bias"] - params["exit_heads.0.fc.bias"], torch.full((10,), 2.0))


def test_feddse_selects_most_activated_channels_by_hand():
    model = cnn()
    system = System.parse("{1,1/4}_{1,1}")
    m = FedDSE(model, system)
    params = params_of(model)
    x = torch.randn(20, 1, 8, 8)
    scores = m.channel_scores(params, {}, x)
    model.train()
    with torch.no_grad():
        h = F.relu(model.features[1](model.features[0](x)))   # block 0's conv, BN (batch statistics), ReLU
    assert torch.allclose(scores["block0"], h.mean((0, 2, 3)), atol=1e-6)
    assert top_channels(torch.tensor([0.1, 0.5, 0.5, 0.2]), 2).tolist() == [False, True, True, False]
    # a client of level 1/4 keeps ceil(K/2) channels of every group, its best ones
    sub = m.submodel(params, system.levels[1], 3)
    own = sub.local.start(model, sub, params, {}, x, [torch.arange(20)])
    best0 = top_channels(scores["block0"], 4)
    assert own.masks["features.0.weight"].flatten(1).any(1).tolist() == best0.tolist()
    for name, (out, cin) in CONVS.items():
        keep_in = cin if cin == 1 else math.ceil(cin / 2)
        assert int(own.masks[name].sum()) == math.ceil(out / 2) * keep_in * 9, name
    # its reply carries its choice beside its delta, one bool per channel of each group, as the method declares
    delta = {n: torch.zeros_like(p) for n, p in params.items()}
    reply = sub.local.finish(7, params, sub, delta)
    assert {n: (tuple(t.shape), t.dtype) for n, t in reply.items() if n not in delta} == \
        m.own_reply(system.levels[1]) and m.own_reply(system.levels[0]) == {}
    assert torch.equal(reply[CHOICE + "block0"], best0)
    # nothing is counted until the server step takes that reply; then the level is evaluated with its clients'
    # most frequent choice (one client: its own)
    first = m.eval_submodel(params, system.levels[1], 3)
    assert first.masks["features.0.weight"].flatten(1).any(1).tolist() == [True] * 4 + [False] * 4
    assert m.server_update(3, params, params, [Update(7, system.levels[1], reply, 0.0)], {}) is params
    ev = m.eval_submodel(params, system.levels[1], 3)
    assert all(torch.equal(ev.masks[n], own.masks[n]) for n in own.masks)


def test_feddse_aggregation_by_hand():
    # two clients of one level with their own channels: a coordinate moves by the mean over the clients whose
    # delta there is nonzero (the level's submodel has no mask: the server reads each client's from its update)
    model = cnn()
    system = System.parse("{1,1/4}_{1,1}")
    m = FedDSE(model, system)
    params = params_of(model)
    level_sub = m.submodel(params, system.levels[1], 1)
    assert m.coverage == "nonzero" and not level_sub.masks
    keep_a = {"block0": torch.tensor([1, 1, 1, 1, 0, 0, 0, 0], dtype=torch.bool)}
    keep_b = {"block0": torch.tensor([0, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)}
    w = "features.0.weight"
    d_a = {n: torch.zeros_like(p) for n, p in params.items()}
    d_b = {n: torch.zeros_like(p) for n, p in params.items()}
    d_a[w][keep_a["block0"]] = 1.0
    d_b[w][keep_b["block0"]] = 3.0
    new = aggregate(params, [(d_a, level_sub), (d_b, level_sub)], m.aggregation, m.coverage)
    step = (new[w] - params[w]).flatten(1)[:, 0]
    assert torch.allclose(step, torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 0.0, 0.0]))   # (w + d) - w: float


def test_feddse_own_slice_trains_as_its_masks():
    model = cnn()
    params, buffers = params_of(model), dict(model.named_buffers())
    m = FedDSE(model, System.parse("{1,1/4}_{1,1}"))
    sub = m.submodel(params, m.system.levels[1], 1)
    torch.manual_seed(1)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    batches = [torch.arange(i, i + 16) for i in range(0, 64, 16)]
    work = local_work(steps=4, batch_size=16, lr=0.1)
    sliced, _ = local_train(model, params, buffers, sub, x, y, batches, work)
    own = sub.local.start(model, sub, params, buffers, x, batches)
    assert own.slices
    masked, _ = local_train(model, params, buffers, own.masked(), x, y, batches, work)
    for n in params:
        assert torch.allclose(sliced[n], masked[n], atol=1e-5), n
        if n in own.masks:
            assert not bool(sliced[n][~own.masks[n]].any()), n


@pytest.mark.parametrize("method", ["fjord", "depthfl", "feddse"])
def test_resumed_run_is_bit_identical(tiny_cfg, tmp_path, method):
    args = [f"method={method}", "system={1,1/4}_{2,2}"] + (["method_args.heads=linear"] if method == "depthfl" else [])
    whole = run_experiment(tiny_cfg(*args, out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg(*args, "rounds=1", out=str(tmp_path / "part")), progress=False)
    resumed = run_experiment(tiny_cfg(*args, out=str(tmp_path / "part")), resume=True, progress=False)
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert a["round"] == b["round"] == 2
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert whole["final"]["train_loss"] == resumed["final"]["train_loss"]
    assert whole["final"]["levels"] == resumed["final"]["levels"]
    assert all(math.isfinite(v["global_acc"]) for v in whole["final"]["levels"].values())


def test_cli_depthfl_level_it_cannot_meet_exits_2_with_one_line(tmp_path, capsys):
    code = main(["run", "dataset=digits", "model=cnn", "width=0.25", "system={1,1/64}_{2,2}", "method=depthfl",
                 "rounds=2", f"out={tmp_path / 'r'}", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("fedlase: error: system: depthfl cannot meet level 1/64") and "smallest feasible level" in err
    assert not (tmp_path / "r").exists()


def test_fedlase_methods_lists_the_new_methods(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name, opts in {"fjord": ("widths", "distill"), "depthfl": ("heads", "distill", "kd_rampup", "predict"),
                       "feddse": ("score", "samples", "eval")}.items():
        assert f"\n{name}: " in out
        block = out.split(f"\n{name}: ")[1].split("\n")[1:]
        assert all(any(f"method_args.{o} " in line for line in block) for o in opts), name


def test_batched_clients_refuse_a_local_objective(tiny_cfg):
    """At validation, as the method declares (Method.runs_on), before anything runs."""
    with pytest.raises(ConfigError, match="^batched_clients: method fjord runs on embedded, flower-sim, "
                                          "flower-deploy only"):
        tiny_cfg("method=fjord", "batched_clients=true")


def test_feddse_counts_the_choices_of_the_accepted_replies_only(tiny_cfg, monkeypatch):
    """A FedDSE reply carries the client's channel choice beside its delta. The choice is a record, not a change:
    the screen's figure of a reply is its delta's alone, and an attack leaves the choice as sent. The server step
    counts the choices of the replies it accepted: a client whose reply is rejected (here a NaN in its delta) is
    left out of its level's evaluation counts."""
    from fedlase.engine import Experiment
    from fedlase.server_step import norms
    exp = Experiment.from_config(tiny_cfg("method=feddse", "participation=1", "system={1,1/4}_{1,3}",
                                          "attack=sign_flip", "attack_args.fraction=0.25"))
    quarter = exp.levels[1]
    small = [c for c in range(4) if exp.cfg.levels.level_of(c).index == 1]
    spoiled, replies = small[0], {}
    train = exp.trainer.update

    def update(client, *args, **kwargs):
        delta, loss = train(client, *args, **kwargs)
        replies[client] = delta
        if client == spoiled:
            delta = dict(delta)
            name = next(n for n in delta if n in exp.params)
            delta[name] = delta[name].clone()
            delta[name].view(-1)[0] = float("nan")
        return delta, loss
    monkeypatch.setattr(exp.trainer, "update", update)
    subs = exp.submodels([quarter], 1)
    c = small[1]
    u = Update(c, quarter, train(c, exp.params, exp.buffers, subs[quarter], 1)[0], 0.0)
    bare = Update(c, quarter, {n: d for n, d in u.delta.items() if not n.startswith(CHOICE)}, 0.0)
    assert len(u.delta) > len(bare.delta) and norms([u], subs, exp.params) == norms([bare], subs, exp.params)
    attacked = exp.server.receive(dataclasses.replace(u, client=next(iter(exp.server.attack.clients))), subs,
                                  exp.params, 1)
    assert all(torch.equal(attacked.delta[n], u.delta[n]) and attacked.delta[n].dtype == torch.bool
               for n in u.delta if n.startswith(CHOICE))
    assert any(not torch.equal(attacked.delta[n], u.delta[n]) for n in bare.delta)   # its update is flipped
    stats = exp.run_round(1)
    assert stats["rejected"] == {str(spoiled): "non-finite value in its update"}
    rnd, counts = exp.method.counts[quarter.index]
    kept = [c for c in small if c != spoiled]
    assert rnd == 1 and len(kept) == 2
    for name, count in counts.items():
        want = sum(replies[c][CHOICE + name].long() for c in kept)
        assert torch.equal(count, want), name
