"""HetLoRA's local penalty (`method_args.penalty`, fedlase/llm/lora_methods.py `TailPenalty`): lambda x the sum over
the adapted modules of ||B_tail A_tail||_F added to the task's loss, the tail being the last ceil(prune k) of a
client's k rank components. A local step checked against torch.autograd on the formula written out here; the tail
shrinking and the clients pruning where without it they do not; task=lm; a resumed run; the one-line refusal.
Tiny random BERT and Llama folders (tests/test_lora.py's fixtures): no weights are read."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_lora import _ckpt, lora_args, write_bert_folder  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment, run_experiment  # noqa: E402
from fedlase.errors import ConfigError  # noqa: E402
from fedlase.llm.lora_methods import TailPenalty, client_adapter  # noqa: E402
from fedlase.train import local_train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return write_bert_folder(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture
def lora_cfg(bert_folder, tmp_path, monkeypatch):
    """tests/test_lora.py's HetLoRA run (rank 4; levels 1 and 1/4 at ranks 4 and 2; 4 clients) with `overrides`."""
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    return lambda *overrides, out=None: load_config(None, [*lora_args(bert_folder), f"out={out or tmp_path / 'run'}",
                                                           *overrides])


def _tail_norm(pairs, a_of, b_of, lo: int, k: int) -> float:
    """sqrt(sum over modules of ||B[:, lo:k] A[lo:k]||_F^2): the quantity HetLoRA's pruning test compares."""
    return math.sqrt(sum(float(torch.linalg.matrix_norm(b_of(ad)[:, lo:k] @ a_of(ad)[lo:k])) ** 2 for ad in pairs))


@pytest.mark.parametrize("level,sliced", [(0, True), (1, True), (1, False)],
                         ids=["rank4-whole", "rank2-slice", "rank2-masked"])
def test_one_local_step_adds_lambda_times_the_tail_penalty_gradient(lora_cfg, level, sliced):
    """One SGD step (no momentum, decay or clip) from adapters whose B is off zero: the delta is -lr x the gradient
    of cross-entropy + lambda sum_modules ||B[:, lo:k] A[lo:k]||_F, taken by torch.autograd on the trained tensors
    (the rank-k slice at level 1/4, trained as a slice or, sliced=false, as masks over the full adapter); the
    penalty's part moves the tail components only."""
    lam, lr = 0.3, 0.05
    exp = Experiment.from_config(lora_cfg("method_args.prune=0.5", f"method_args.penalty={lam}", f"lr={lr}"))
    g = torch.Generator().manual_seed(1)
    params = {n: p + 0.1 * torch.randn(p.shape, generator=g) if ".lora_B." in n else p.clone()
              for n, p in exp.params.items()}
    lvl = exp.method.system.levels[level]
    k, lo = (4, 2) if level == 0 else (2, 1)   # prune 0.5: the last ceil(k / 2) components
    sub = exp.method.submodel(params, lvl, 1)
    assert isinstance(sub.local, TailPenalty)
    if not sliced:   # what the client trains under sliced=false (fedlase.client.ClientTrainer.trained)
        sub = sub.masked()
        assert sub.masks and not sub.slices and sub.local is not None
    x, y, idx = exp.trainer.x, exp.trainer.y, torch.arange(4)
    delta, _ = local_train(exp.model, params, exp.buffers, sub, x, y, [idx], exp.trainer.work)
    # the same submodel without its objective: the task's loss alone, on the plain path
    base, _ = local_train(exp.model, params, exp.buffers, dataclasses.replace(sub, local=None), x, y, [idx],
                          exp.trainer.work)

    # the expected gradient, from the formula: the first k components of every adapter, the head whole
    pairs = exp.method.pairs
    trained = {}
    for n, p in params.items():
        ad_a = next((ad for ad in pairs if ad.a == n), None)
        ad_b = next((ad for ad in pairs if ad.b == n), None)
        t = p[:k] if ad_a else p[:, :k] if ad_b else p
        trained[n] = t.detach().clone().requires_grad_(True)
    exp.model.train()
    logits = torch.func.functional_call(exp.model, {**trained, **exp.buffers}, (x[idx],))
    penalty = sum(torch.linalg.matrix_norm(trained[ad.b][:, lo:k] @ trained[ad.a][lo:k]) for ad in pairs)
    total = F.cross_entropy(logits, y[idx]) + lam * penalty
    grads = dict(zip(trained, torch.autograd.grad(total, list(trained.values()), retain_graph=True)))
    pen_grads = dict(zip(trained, torch.autograd.grad(penalty, list(trained.values()), allow_unused=True)))
    for n, p in params.items():
        want = torch.zeros_like(p)
        want[tuple(slice(0, s) for s in trained[n].shape)] = -lr * grads[n]
        assert torch.allclose(delta[n], want, atol=1e-6, rtol=1e-4), n
    moved = 0
    for ad in pairs:
        # the penalty's part of the step: -lr lambda x its gradient on the tail, nothing on the first components
        # (nor on the head, outside the penalty)
        pa, pb = pen_grads[ad.a], pen_grads[ad.b]
        assert torch.equal(delta[ad.a][:lo], base[ad.a][:lo]) and torch.equal(delta[ad.b][:, :lo], base[ad.b][:, :lo])
        assert torch.allclose(delta[ad.a][lo:k] - base[ad.a][lo:k], -lr * lam * pa[lo:k], atol=1e-6)
        assert torch.allclose(delta[ad.b][:, lo:k] - base[ad.b][:, lo:k], -lr * lam * pb[:, lo:k], atol=1e-6)
        moved += int(pa[lo:k].abs().sum() > 0)
    head = [n for n in params if all(n not in (ad.a, ad.b) for ad in pairs)]
    assert head and all(torch.equal(delta[n], base[n]) for n in head)
    assert moved == len(pairs)   # not vacuous: every module's tail is pulled


def test_the_penalty_shrinks_the_tails_and_the_clients_prune_where_without_it_they_do_not(lora_cfg):
    """Round 2 (B off zero after round 1) of the same run with and without the penalty (prune 0.5: tails of 2 of
    rank 4, 1 of rank 2): with lambda = 0.2 every client sends a tail below the one it received and every client
    prunes; without it the tails grow and none prunes."""
    def round_two(*overrides):
        exp = Experiment.from_config(lora_cfg("method_args.prune=0.5", *overrides))
        exp.step(1)
        picked = exp.sample(2)
        subs = exp.submodels([lvl for _, lvl in picked], 2)
        updates = exp.runner.train(exp, 2, picked, subs).updates
        old = {n: p.clone() for n, p in exp.params.items()}
        ratio = {}
        for u in updates:
            sub = u.sub or subs[u.level]
            k = 4 if u.level.index == 0 else 2
            lo = k - math.ceil(0.5 * k)
            sent = _tail_norm(exp.method.pairs, lambda ad: client_adapter(ad.a, old, u.delta, sub),
                              lambda ad: client_adapter(ad.b, old, u.delta, sub), lo, k)
            ratio[u.client] = sent / _tail_norm(exp.method.pairs, lambda ad: old[ad.a], lambda ad: old[ad.b], lo, k)
        exp.serve(2, updates, subs, {})
        return ratio, exp.method.pruned

    with_ratio, with_pruned = round_two("method_args.penalty=0.2")
    without_ratio, without_pruned = round_two()
    assert len(with_ratio) == 4 and all(r < 1 for r in with_ratio.values()), with_ratio
    assert all(with_ratio[c] < without_ratio[c] for c in with_ratio), (with_ratio, without_ratio)
    assert with_pruned == {0: 2, 1: 2, 2: 1, 3: 1}
    assert without_pruned == {}


def test_penalty_zero_is_hetlora_as_before(lora_cfg):
    """penalty=0 (the default) attaches no objective: the plain path, as before the option."""
    exp = Experiment.from_config(lora_cfg("method_args.prune=0.5", "method_args.penalty=0"))
    assert all(exp.method.submodel(exp.params, lvl, 1).local is None for lvl in exp.method.system.levels)


def test_a_penalised_run_resumes_bit_identically(lora_cfg, tmp_path):
    """The objective keeps nothing across rounds (each client's tail is read when it starts); the pruned ranks are
    the method's state: three rounds equal one, a stop, and two more."""
    args = ("method_args.prune=0.5", "method_args.penalty=0.2")
    run_experiment(lora_cfg(*args, "rounds=3", out=str(tmp_path / "whole")), progress=False)
    run_experiment(lora_cfg(*args, "rounds=1", out=str(tmp_path / "cut")), progress=False)
    run_experiment(lora_cfg(*args, "rounds=3", out=str(tmp_path / "cut")), resume=True, progress=False)
    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "cut")
    assert a["method"]["pruned"]   # not vacuous: clients pruned, and later rounds trained their own ranks
    assert a["method"] == b["method"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_a_next_token_run_takes_the_penalty_on_its_own_loss(tmp_path, monkeypatch):
    """task=lm on a tiny random Llama (tests/test_llm_decoder.py's): the objective leaves the loss to the task (the
    next-token cross-entropy, not a class loss) and adds the penalty at every local step; two rounds run, score
    finite perplexities, and the clients prune."""
    import test_llm_decoder as dec
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    folder = dec.write_tiny_llama(tmp_path / "llama")
    texts = dec.write_texts(tmp_path / "texts", ("sport", "tech"))
    import fedlase.train
    calls, tasks = [], []
    real_penalty, real_loss = TailPenalty.penalty, fedlase.train.task_loss
    monkeypatch.setattr(TailPenalty, "penalty", lambda self, w: calls.append(1) or real_penalty(self, w))
    monkeypatch.setattr(fedlase.train, "task_loss", lambda work, *a: tasks.append(work.task) or real_loss(work, *a))
    cfg = dec._cfg(tmp_path, folder, texts, method="hetlora", lora={"r": 4}, rounds=2, checkpoint_every=1,
                   method_args={"prune": 0.5, "penalty": 0.5}, lr=0.05)
    summary = run_experiment(cfg, progress=False)
    assert all(math.isfinite(v["global_ppl"]) for v in summary["final"]["levels"].values())
    assert len(calls) == 2 * 4 * 2   # every local step of every client of both rounds
    assert tasks == ["lm"] * len(calls)   # each step's loss: the task's next-token loss, plus the penalty
    exp = Experiment.from_config(cfg)
    exp.load_state_dict(torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True))
    assert exp.method.pruned


@pytest.mark.parametrize("overrides", [["method_args.penalty=0.1"],
                                       ["method_args.prune=0.5", "method_args.penalty=-1"]])
def test_a_penalty_without_prune_or_below_zero_is_a_one_line_error(lora_cfg, overrides):
    with pytest.raises(ConfigError) as e:
        lora_cfg(*overrides)
    assert e.value.key == "method_args.penalty" and "\n" not in str(e.value)
