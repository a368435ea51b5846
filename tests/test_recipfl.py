"""RecipFL (fedlase/methods/recipfl.py, its graph hypernetwork in fedlase/methods/ghn.py): the hypernetwork's
update is the vector-Jacobian product of the generated weights with (generated - uploaded); its decoders are
shared across widths by corner slicing; it runs on the embedded engine through the normal entry point; bad
combinations are one-line errors."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlase.data.partition import goliath_split
from fedlase.engine import Experiment, evaluate_run, run_experiment
from fedlase.errors import ConfigError, UserError
from fedlase.masks import maskable_names
from fedlase.measure import cost_table
from fedlase.methods.ghn import _fan_in
from fedlase.methods.recipfl import RecipFL
from fedlase.models.lenet import LeNet5
from fedlase.report import make_report

RECIP = ["model=lenet", "method=recipfl", "system={1,1/8}_{1,3}", "partition=goliath", "alpha=0.5",
         "method_args.hidden=16", "eval_finetune=1", "local_steps=2"]


def _method(hidden: int = 16) -> RecipFL:
    torch.manual_seed(0)
    model = LeNet5(image_size=8, width=0.5)
    method = RecipFL(model, [1, 0.125], run_seed=0, hidden=hidden)
    y = torch.arange(40) % 10
    method.bind_data(y, [torch.arange(0, 20), torch.arange(20, 40)], 10)
    method.ghn.eval()   # no dropout: two forwards of the hypernetwork give the same tensors
    return method


@pytest.mark.numerics
def test_the_update_is_the_vjp_of_the_generated_weights_with_their_difference():
    method = _method()
    gen = method.generate(1, "small")
    uploaded = {n: t.detach() + 0.1 * torch.randn_like(t) for n, t in gen.items()}
    method.accumulate(gen, uploaded, 1.0)
    applied = {n: p.grad.clone() for n, p in method.ghn.named_parameters() if p.grad is not None}
    # the same VJP by autograd's backward of 0.5 * ||generated - uploaded||^2 (its gradient with respect to the
    # generated tensors is their difference), on a second generation from the same hypernetwork
    ghn = method.ghn
    for p in ghn.parameters():
        p.grad = None
    again = method.generate(1, "small")
    sum(0.5 * ((again[n] - uploaded[n]) ** 2).sum() for n in again).backward()
    expected = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in ghn.named_parameters()}
    for n, p in ghn.named_parameters():
        p.grad = applied.get(n)
    reached = {n for n, g in expected.items() if g.abs().sum() > 0}
    assert reached and reached <= set(applied)
    for n in applied:
        torch.testing.assert_close(applied[n], expected[n], rtol=1e-4, atol=1e-6)
    # the round's step: the gradient clipped to 50, then one Adam step of lr 1e-3 (a first step moves each
    # coordinate by lr * sign of its gradient, where the gradient is well above Adam's eps)
    before = {n: p.detach().clone() for n, p in method.ghn.named_parameters()}
    scale = min(1.0, 50 / float(torch.cat([g.flatten() for g in applied.values()]).norm()))
    method.settle()
    w = "decoders.linear.2.weight"
    big = (applied[w] * scale).abs() > 1e-4
    step = (dict(method.ghn.named_parameters())[w].detach() - before[w])[big]
    torch.testing.assert_close(step, -1e-3 * torch.sign(applied[w][big]), rtol=2e-2, atol=1e-6)
    assert method.weight_sum == 0 and all(p.grad is None for p in method.ghn.parameters())


def test_decoders_are_shared_across_widths_by_corner_slicing():
    method = _method()
    ghn = method.ghn
    assert set(ghn.decoders) == {"conv", "linear", "bn", "bias"}   # one per node type, for both models
    large, small = method.nets["large"], method.nets["small"]
    assert ghn.largest["conv"] == tuple(max(a, b) for a, b in zip(large.layer2[0].weight.shape,
                                                                   small.layer2[0].weight.shape))
    gen = method.generate(0, "small")
    h = ghn.node_states("small", method.last_of(0, "small"))
    node = ghn.graphs["small"].params.index("layer2.0.weight")
    corner = ghn.decoders["conv"](h[node]).view(ghn.largest["conv"])[:small.layer2[0].out_channels]
    torch.testing.assert_close(gen["layer2.0.weight"], _fan_in(corner, "conv"))
    # a David's update reaches the Goliath's large model through the shared decoders
    before = {n: t.detach() for n, t in method.generate(0, "large").items()}
    ghn.train()
    method.accumulate(method.generate(1, "small"), {n: torch.zeros_like(t) for n, t in gen.items()}, 1.0)
    method.settle()
    ghn.eval()
    after = method.generate(0, "large")
    assert not torch.equal(after["fc1.weight"], before["fc1.weight"])


def test_recipfl_runs_two_rounds_on_the_embedded_engine(tiny_cfg):
    cfg = tiny_cfg(*RECIP)
    summary = run_experiment(cfg, progress=False)
    levels = summary["final"]["levels"]
    assert summary["rounds"] == 2 and all(math.isfinite(v["local_acc"]) for v in levels.values())
    # a Goliath is evaluated on its large model, a David on the slim one
    large = LeNet5(image_size=8, width=0.25)
    for lvl, net in (("1", large), ("1/8", large.twin())):   # their conv and linear parameters (BN left out)
        assert levels[lvl]["kept"] == sum(p.numel() for n, p in net.named_parameters() if n in maskable_names(net))
    # by hand: convs 52 + 204, fc 510, fc1 651, classifier 220; slim: convs 52 + 51, fc 105, classifier 220
    assert (levels["1"]["kept"], levels["1/8"]["kept"]) == (1637, 428)
    ckpt = torch.load(f"{cfg.out}/checkpoint.pt", weights_only=True)
    assert ckpt["method"]["opt"]["step"] == 2 and ckpt["method"]["last"]   # the hypernetwork stepped, uploads kept
    # no cost table or simulated time is made up for it: `fedlase cost` refuses in one line, the report leaves both out
    with pytest.raises(UserError, match="has no cost table") as err:
        cost_table(cfg, memory=False)
    assert "\n" not in str(err.value)
    text = make_report([cfg.out], Path(cfg.out) / "report").read_text()
    assert "Global accuracy per level" in text and "equal simulated time" not in text and "FLOP" not in text


def _cifar10_folder(parent: Path, per_file: int = 12) -> Path:
    """A tiny CIFAR-10 python-pickle folder (five training batches and a test batch of random images, labels
    0..9 repeating), the layout the cifar10 loader reads."""
    import pickle
    rng = np.random.default_rng(0)
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
                 b"labels": [i % 10 for i in range(per_file)]}   # every class in the test batch too
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return folder


def test_recipfl_trains_resnet18(tiny_cfg, tmp_path):
    """ResNet-18's only linear layer is its classifier and its convs have no bias: the classifier's kinds get a
    decoder of their own (its first layer), so the CIFAR-10 setting trains (at a tiny width, one round)."""
    cfg = tiny_cfg("method=recipfl", "dataset=cifar10", f"data_dir={_cifar10_folder(tmp_path)}", "model=resnet18",
                   "width=0.0625", "bn=batch", "system={1,1/25}_{1,2}", "partition=goliath", "alpha=0.5",
                   "participation=1", "method_args.hidden=16", "local_steps=1", "batch_size=8", "rounds=1",
                   "eval_batch_size=64")
    summary = run_experiment(cfg, progress=False)
    assert summary["rounds"] == 1 and all(math.isfinite(v["global_acc"]) for v in summary["final"]["levels"].values())
    ckpt = torch.load(f"{cfg.out}/checkpoint.pt", weights_only=True)
    assert ckpt["method"]["opt"]["step"] == 1   # the hypernetwork stepped
    decoders = {k.split(".")[1] for k in ckpt["method"]["ghn"] if k.startswith("decoders.")}
    assert {"conv", "bn", "linear", "bias"} <= decoders


@pytest.mark.parametrize("override, key", [("model=cnn", "model"), ("bn=static", "bn"),
                                           ("batched_clients=true", "batched_clients"),
                                           ("system={1}_{4}", "system"), ("deadline=10", "deadline"),
                                           # the server stages its training does not go through (server_stages)
                                           ("robust=median", "robust"), ("attack=sign_flip", "attack"),
                                           ("dp.clip=1", "dp")])
def test_bad_combinations_are_one_line_errors(tiny_cfg, override, key):
    with pytest.raises(ConfigError) as err:
        run_experiment(tiny_cfg(*RECIP, override), progress=False)
    assert err.value.key == key and "\n" not in str(err.value)


def test_the_hypernetwork_steps_in_the_server_step_on_the_accepted_uploads(tiny_cfg):
    """A client's reply is the change it trained of its generated models (its payload, named '<large|small>.<name>'),
    and training steps nothing; the server step (after the rule) takes one Adam step on the replies it accepted,
    and drops the others."""
    exp = Experiment.from_config(tiny_cfg(*RECIP, "participation=1.0"))
    method = exp.method
    picked = exp.sample(1)
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    updates = exp.runner.train(exp, 1, picked, subs).updates
    before = {n: p.detach().clone() for n, p in method.ghn.named_parameters()}
    goliath = next(u for u in updates if u.level.index == 0)
    assert {n.split(".")[0] for n in goliath.delta} == {"large", "small"}
    assert all({n.split(".")[0] for n in u.delta} == {"small"} for u in updates if u is not goliath)
    assert len(updates) == 4 and all(any(d.any() for d in u.delta.values()) for u in updates)   # what they trained
    assert method.state_dict()["opt"]["step"] == 0 and not method.last
    assert all(torch.equal(p, before[n]) for n, p in method.ghn.named_parameters())
    accepted = [u for u in updates if u.client != updates[1].client]   # as if the screen had rejected one
    old = {n: p.clone() for n, p in exp.params.items()}
    sent = {key: start for key, (_, start) in method.pending.items()}   # what each client was sent
    exp.serve(1, accepted, subs, {})
    assert method.opt.step_count == 1 and not method.pending
    assert set(method.last) == {u.client for u in accepted}
    assert any(not torch.equal(p, before[n]) for n, p in method.ghn.named_parameters())
    assert all(torch.equal(p, old[n]) for n, p in exp.params.items())   # the run's own model is never trained
    # the upload the hypernetwork learnt from: what the client was sent plus the change it replied with
    for u in accepted:
        for kind, up in method.last[u.client].items():
            assert all(torch.equal(t, sent[(u.client, kind)][n] + u.delta[f"{kind}.{n}"]) for n, t in up.items())


def test_a_non_finite_reply_is_dropped_as_any_other(tiny_cfg, monkeypatch):
    """The screen judges a RecipFL reply as any other by its per-update checks: one holding a NaN is rejected with
    its reason, its client's upload never reaches the hypernetwork, which steps on the others and stays finite. Its
    median bound does not apply (a Goliath's change of two models has no common scale with a David's): a Goliath's
    reply 10x larger than it was is taken."""
    exp = Experiment.from_config(tiny_cfg(*RECIP, "participation=1.0"))
    assert exp.cfg.levels.level_of(0).index == 0 and exp.cfg.levels.level_of(1).index == 1   # 0: the Goliath
    train = exp.trainer.update

    def spoiled(client, *args, **kwargs):
        delta, loss = train(client, *args, **kwargs)
        if client == 2:
            name = next(iter(delta))
            delta[name] = delta[name].clone()
            delta[name].view(-1)[0] = float("nan")
        if client == 0:   # the Goliath
            delta = {n: 10 * d for n, d in delta.items()}
        return delta, loss
    monkeypatch.setattr(exp.trainer, "update", spoiled)
    stats = exp.run_round(1)
    assert stats["rejected"] == {"2": "non-finite value in its update"} and stats["clients"] == 3
    assert set(exp.method.last) == {0, 1, 3} and exp.method.opt.step_count == 1
    assert all(bool(torch.isfinite(p).all()) for p in exp.method.ghn.parameters())
    assert all(bool(torch.isfinite(t).all()) for per in exp.method.last.values() for up in per.values()
               for t in up.values())


def test_a_resumed_run_is_bit_identical(tiny_cfg, tmp_path):
    """The hypernetwork, its Adam moments and the clients' last uploads are checkpointed after the server step:
    one round and a resume to two ends where two rounds at once do."""
    fast = [*RECIP, "eval_finetune=0"]
    whole = run_experiment(tiny_cfg(*fast, out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg(*fast, "rounds=1", out=str(tmp_path / "cut")), progress=False)
    resumed = run_experiment(tiny_cfg(*fast, out=str(tmp_path / "cut")), resume=True, progress=False)
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)["method"] for d in ("whole", "cut"))
    assert a["opt"]["step"] == b["opt"]["step"] == 2
    assert all(torch.equal(a["ghn"][n], b["ghn"][n]) for n in a["ghn"])
    assert all(torch.equal(x, y) for x, y in zip(a["opt"]["v"], b["opt"]["v"]))
    assert {k: v for k, v in whole["final"].items() if not k.endswith("_time")} == \
        {k: v for k, v in resumed["final"].items() if not k.endswith("_time")}


def test_lenet_width_slices_and_the_fine_tuned_metric(tiny_cfg, tmp_path):
    """The other methods of RecipFL's comparison on LeNet-5: HeteroFL's width slice trains as the smaller
    tensors (its flatten cut in whole channels) exactly as the masks over the full model do; and
    eval_finetune=1 scores each client after local training, leaving the global accuracy alone."""
    base = ["model=lenet", "method=heterofl", "system={1,1/8}_{1,3}", "partition=goliath", "alpha=0.5", "rounds=1"]
    sliced = run_experiment(tiny_cfg(*base), progress=False)
    run_experiment(tiny_cfg(*base, "sliced=false", out=str(tmp_path / "masked")), progress=False)
    a, b = (torch.load(f"{d}/checkpoint.pt", weights_only=True)["params"]
            for d in (sliced["config"]["out"], tmp_path / "masked"))
    assert all(torch.allclose(a[n], b[n], atol=1e-5) for n in a)
    tuned = evaluate_run(sliced["config"]["out"], ["eval_finetune=1"])
    for lvl, row in sliced["final"]["levels"].items():
        assert tuned["levels"][lvl]["global_acc"] == row["global_acc"]
    assert tuned["local_acc"] != sliced["final"]["local_acc"]


def test_the_goliath_partition():
    """RecipFL's population: the Goliaths share half of the samples (IID, equal parts), the Davids the rest."""
    y = np.arange(1000) % 10
    parts = goliath_split(y, [0, 1], 12, alpha=0.5, seed=3)
    assert [len(p) for p in parts[:2]] == [250, 250] and all(len(p) >= 1 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(1000))   # each sample once
    assert np.bincount(y[parts[0]]).min() >= 15   # IID: every class, near 25 each
    davids = [np.bincount(y[p], minlength=10) / len(p) for p in parts[2:]]
    assert max(float(d.max()) for d in davids) > 0.4   # Dirichlet(0.5): some David is dominated by a class
    with pytest.raises(ConfigError) as err:
        goliath_split(y, [0, 1, 2], 3, alpha=0.5)
    assert err.value.key == "system"


def test_the_written_out_adam_follows_torch_optim_adam():
    """recipfl's Adam (written out so that a run does not import torch._dynamo) takes torch.optim.Adam's steps."""
    from fedlase.methods.recipfl import Adam
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [t.detach().clone().requires_grad_(True) for t in a]
    ours, ref = Adam(a, lr=1e-2), torch.optim.Adam(b, lr=1e-2)
    for step in range(5):
        x = torch.randn(3)
        for params, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            ((params[0] @ x).pow(2).sum() + params[1].sin().sum() * (step + 1)).backward()
            opt.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
