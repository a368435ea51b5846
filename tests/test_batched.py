"""Batched clients (fedlase/batched.py): the same round as the sequential engine, up to float rounding."""
import pytest
import torch

from conftest import host_reads
from fedlase.batched import local_train_batched, train_clients_batched
from fedlase.client import local_work
from fedlase.engine import Experiment
from fedlase.errors import ConfigError
from fedlase.masks import Submodel
from fedlase.models import build_model
from fedlase.train import local_train

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics

# 4 clients at 2 levels, all sampled: every round mixes levels (different masks and thresholds).
ALL = ["participation=1.0"]


def _round_both_ways(tiny_cfg, *overrides, rounds=1):
    """Params after `rounds` rounds, sequential and batched, from the same start."""
    out = []
    for batched in (False, True):
        exp = Experiment.from_config(tiny_cfg(*ALL, *overrides, f"batched_clients={str(batched).lower()}"))
        stats = [exp.run_round(r) for r in range(1, rounds + 1)]
        out.append((exp.params, stats))
    return out


def _max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("overrides, tol", [
    (["method=fiarse"], 1e-4),                                 # thresholds, one tau per client
    (["method=fiarse", "method_args.ste=paper"], 1e-4),        # straight-through rule with a tau tensor
    (["method=fiarse", "method_args.ste=fixed"], 1e-4),        # fixed masks
    (["method=fiarse", "momentum=0.9", "weight_decay=0.01"], 1e-4),   # stacked SGD state
    (["method=fiarse", "optimizer=adamw", "lr=0.01"], 1e-3),   # stacked AdamW state; its g/sqrt(v)
    # turns rounding noise on near-zero gradients into steps of up to ~lr, hence the looser bound
    (["method=heterofl", "bn=static"], 1e-4),                  # sliced groups per level, folded scaler, running stats
    (["method=heterofl", "bn=static", "sliced=false"], 1e-4),  # masks, per-client scales in one group
    (["method=fedrolex"], 1e-4),
    (["method=fedrolex", "clip_norm=0.5"], 1e-4),              # each client's gradient clipped to its own norm
    (["method=fiarse", "sliced=false", "clip_norm=0.5"], 1e-4),
    (["method=fedavg_small"], 1e-4),
    (["method=fedavg"], 1e-4),
])
def test_batched_round_equals_sequential(tiny_cfg, overrides, tol):
    (seq, seq_stats), (bat, bat_stats) = _round_both_ways(tiny_cfg, *overrides, rounds=2)
    assert _max_diff(seq, bat) < tol
    # and training really moved the model, so the comparison means something
    start = Experiment.from_config(tiny_cfg(*ALL, *overrides)).params
    assert _max_diff(seq, start) > 1e-3
    assert seq_stats[-1]["train_loss"] == pytest.approx(bat_stats[-1]["train_loss"], rel=1e-4)


def test_ragged_last_batch_trains_in_one_group(tiny_cfg, monkeypatch):
    # balanced partition, one epoch: every client has the same batch sizes, the last one partial. Masks without
    # thresholds (HeteroFL's, applied as masks), so the two ways differ by rounding only (6e-8 on AVX2 and on
    # ATEN_CPU_CAPABILITY=default). FIARSE re-derives its mask from the weights at every step: over these 7
    # steps a rounding difference flips coordinates near the threshold, and the runs drifted 1.9e-3 apart on
    # the portable kernels (below 1e-4 on AVX2); its batched round is compared over 2 steps above.
    args = [*ALL, "method=heterofl", "sliced=false", "local_epochs=1", "batch_size=50"]
    exp = Experiment.from_config(tiny_cfg(*args))
    assert len(exp.client_train[0]) % 50 != 0
    exp.run_round(1)
    def no_sequential(*a, **k):
        raise AssertionError("a client fell back to sequential training")
    bat = Experiment.from_config(tiny_cfg(*args, "batched_clients=true"))
    monkeypatch.setattr(bat.trainer, "update", no_sequential)
    bat.run_round(1)
    assert _max_diff(exp.params, bat.params) < 1e-6
    assert _max_diff(exp.params, Experiment.from_config(tiny_cfg(*args)).params) > 1e-3   # and training moved the model


def test_clients_with_different_steps_fall_into_groups(tiny_cfg):
    # dirichlet: clients of different sizes train different numbers of steps by epochs
    (seq, _), (bat, _) = _round_both_ways(tiny_cfg, "partition=dirichlet", "local_epochs=0.5")
    assert _max_diff(seq, bat) < 1e-4


def test_hook_returns_clients_in_picked_order(tiny_cfg):
    exp = Experiment.from_config(tiny_cfg(*ALL))
    picked = exp.sample(1)
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    batched = train_clients_batched(exp.trainer, exp.params, exp.buffers, picked, [subs[lvl] for _, lvl in picked], 1)
    for (client, lvl), (delta, loss) in zip(picked, batched):
        ref_delta, ref_loss = exp.trainer.update(client, exp.params, exp.buffers, subs[lvl], 1)
        assert _max_diff(ref_delta, delta) < 1e-5
        assert loss == pytest.approx(ref_loss, rel=1e-5)


# label_split: each client trains, returns and is credited with its own classes' classifier rows; FIARSE's
# threshold forward ignores the row masks, so there only the stacked logit mask keeps the absent classes out
LABEL_SPLIT = [*ALL, "partition=pathological", "classes_per_client=2", "label_split=true"]


@pytest.mark.parametrize("overrides", [["method=heterofl"], ["method=heterofl", "sliced=false"], ["method=fedrolex"],
                                       ["method=fiarse"]])
def test_label_split_batched_round_equals_sequential(tiny_cfg, monkeypatch, overrides):
    from fedlase.engine import BatchedRounds, SequentialRounds
    from fedlase.train import classifier_names
    cfg = tiny_cfg(*LABEL_SPLIT, *overrides)
    seq = Experiment.from_config(cfg, runner=SequentialRounds())
    bat = Experiment.from_config(tiny_cfg(*LABEL_SPLIT, *overrides, "batched_clients=true"))
    assert isinstance(bat.runner, BatchedRounds)
    def no_sequential(*a, **k):
        raise AssertionError("a client fell back to sequential training")
    monkeypatch.setattr(bat.trainer, "update", no_sequential)   # every client trains in a vmapped group
    picked = seq.sample(1)
    assert picked == bat.sample(1)
    subs = seq.submodels([lvl for _, lvl in picked], 1)
    ups = [exp.runner.train(exp, 1, picked, subs).updates for exp in (seq, bat)]
    weight, bias = classifier_names(seq.model)
    for s, b in zip(*ups):
        assert (s.client, s.level) == (b.client, b.level)
        assert s.sub is not None and b.sub is not None   # each credited with its own submodel ...
        assert s.sub.masks.keys() == b.sub.masks.keys()  # ... the same coordinates
        assert all(torch.equal(s.sub.masks[n], b.sub.masks[n]) for n in s.sub.masks)
        small = any(d.shape != seq.params[n].shape for n, d in s.delta.items())   # sequential: a slice's stays small
        delta = s.sub.scatter(s.delta, seq.params) if small else s.delta
        assert _max_diff(delta, b.delta) < 1e-4
        assert s.loss == pytest.approx(b.loss, rel=1e-4)
        absent = ~bat.trainer.classes[b.client]
        assert absent.any() and torch.all(b.delta[weight][absent] == 0) and torch.all(b.delta[bias][absent] == 0)
        assert b.delta[weight][~absent].abs().max() > 0   # its own rows trained
    # a whole round: the server credits the same coordinates, so the models agree
    seq.run_round(1)
    bat.run_round(1)
    assert _max_diff(seq.params, bat.params) < 1e-4
    assert _max_diff(seq.params, Experiment.from_config(cfg).params) > 1e-3   # and training moved the model


def test_local_train_batched_by_hand():
    # Prepare: the real CNN at quarter width, two clients with hand-set thresholds and one fixed mask
    torch.manual_seed(0)
    model = build_model("cnn", 1, 3, 0.25, "batch", 8)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(24, 1, 8, 8), torch.randint(0, 3, (24,))
    w = "classifier.weight"
    subs = [Submodel({w: params[w].abs() >= 0.1}, thresholds={w: 0.1}),
            Submodel({w: params[w].abs() >= 0.3}, thresholds={w: 0.3})]
    batches = [[torch.arange(0, 8), torch.arange(8, 16)], [torch.arange(16, 24), torch.arange(0, 8)]]
    work = local_work(steps=2, batch_size=8, lr=0.1, momentum=0.5)
    # Execute
    got = local_train_batched(model, params, {}, subs, x, y, batches, work)
    # Assert: each client equals its own sequential training
    for sub, b, (delta, loss) in zip(subs, batches, got):
        ref, ref_loss = local_train(model, params, {}, sub, x, y, b, work)
        assert _max_diff(ref, delta) < 1e-6
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert torch.all(delta[w][~sub.masks[w]] == 0)


def test_mixed_thresholds_in_one_group_is_refused():
    model = build_model("cnn", 1, 3, 0.25, "batch", 8)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    subs = [Submodel(thresholds={"classifier.weight": 0.1}), Submodel()]
    with pytest.raises(ValueError, match="threshold"):
        local_train_batched(model, params, {}, subs, torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long),
                            [[torch.arange(4)], [torch.arange(4)]], local_work(steps=1, batch_size=4))


def test_dropout_model_is_a_config_error(tiny_cfg):
    exp = Experiment.from_config(tiny_cfg(*ALL, "batched_clients=true"))
    exp.model.features.append(torch.nn.Dropout(0.5))
    with pytest.raises(ConfigError, match="batched_clients"):
        exp.run_round(1)


# ---- speed changes that must not change results ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["normal", "ties", "constant", "mostly_zero", "sorted", "periodic"])
def test_kth_largest_is_exact(kind):
    # the bracketing shortcut of masks.kth_largest must return exactly kthvalue's value, on inputs that fool
    # its strided sample too (periodic, sorted, heavy ties)
    from fedlase.masks import kth_largest
    g = torch.Generator().manual_seed(1)
    n = 200_000
    v = {"normal": torch.randn(n, generator=g), "ties": torch.randint(0, 5, (n,), generator=g).float(),
         "constant": torch.ones(n), "sorted": torch.arange(float(n)),
         "mostly_zero": torch.where(torch.rand(n, generator=g) < 0.9, 0.0, torch.rand(n, generator=g)),
         "periodic": (torch.arange(n) % 4096).float()}[kind]
    for k in [1, 2, n // 64, n // 16, n // 4, n // 2, n - 1, n, *torch.randint(1, n + 1, (10,), generator=g).tolist()]:
        assert kth_largest(v, k) == float(torch.kthvalue(v, n - k + 1).values), k


def test_bench_sections_run(capsys, tmp_path):
    # the cheap sections end to end through the tool's command, and a bad section name is one line, not a
    # traceback
    from tools.bench import main
    out = tmp_path / "bench.md"
    assert main(["--quick", "--only", "comm", "--out", str(out)]) == 0
    text = out.read_text()
    assert "values + bit mask" in text and "fiarse" in text
    assert "Command: `python -m tools.bench --quick --only comm" in text
    assert main(["--only", "nope"]) == 2
    assert "not a section" in capsys.readouterr().err


def test_submodel_bytes_by_hand():
    from tools.bench import submodel_bytes
    params = {"w": torch.zeros(10, 2), "b": torch.zeros(3)}
    mask = torch.zeros(10, 2, dtype=torch.bool)
    mask[:5] = True                                   # 10 of 20 kept
    dense, sparse, values = submodel_bytes(Submodel({"w": mask}, thresholds={"w": 0.5}), params)
    assert dense == 4 * 23
    assert values == 4 * (10 + 3) + 4                 # kept values, the whole bias, one threshold
    assert sparse == values + 3                       # + a 20-bit mask: 3 bytes


def test_batched_needs_the_embedded_engine(tiny_cfg):
    with pytest.raises(ConfigError, match="batched_clients"):
        tiny_cfg("batched_clients=true", "engine=flower-sim")


def test_each_client_is_clipped_to_its_own_norm():
    from fedlase.batched import _clip_each_client
    torch.manual_seed(0)
    stacked = [torch.zeros(3, 4, 5, requires_grad=True), torch.zeros(3, 7, requires_grad=True)]
    for p, scale in zip(stacked, (1.0, 3.0)):
        p.grad = torch.randn(p.shape) * scale
    grads = [[p.grad[c].clone() for p in stacked] for c in range(3)]
    stacked[0].grad[2].mul_(1e-3)   # client 2's gradient under the limit: left alone
    stacked[1].grad[2].mul_(1e-3)
    grads[2] = [g * 1e-3 for g in grads[2]]
    _clip_each_client(stacked, 1.0)
    for c in range(3):   # what clip_grad_norm_ does to client c's tensors on their own
        own = [g.clone() for g in grads[c]]
        params = [torch.zeros_like(g, requires_grad=True) for g in own]
        for p, g in zip(params, own):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for p, q in zip(stacked, params):
            torch.testing.assert_close(p.grad[c], q.grad)
    assert torch.equal(stacked[1].grad[2], grads[2][1])


@pytest.mark.parametrize("method,batched", [("fedlase", "false"), ("fedlase", "true"), ("fiarse", "true")])
def test_thresholds_kept_on_the_device_read_the_host_once_per_level(tiny_cfg, monkeypatch, method, batched):
    """On a GPU a threshold method's extraction keeps each layer's threshold on the device (masks.kth_largest)
    and reads its layer scores in one transfer: a round's extraction then waits for the device about once per
    level, not several times per layer. Forced on the CPU here, that path must give the same round, bit for bit."""
    import fedlase.masks as masks

    def one_round(device_side: bool):
        if device_side:
            monkeypatch.setattr(masks, "_DEVICE_SIDE", frozenset({"cpu"}))
        exp = Experiment.from_config(tiny_cfg(f"method={method}", "participation=1.0", f"batched_clients={batched}"))
        picked = exp.sample(1)
        with host_reads() as reads:
            subs = exp.submodels([lv for _, lv in picked], 1)
        taus = [t for s in subs.values() for t in (s.thresholds or {}).values()]
        exp.run_round(1)   # still on the device path: the round trains with the tensor thresholds
        monkeypatch.undo()
        return exp.params, reads, taus, len(subs)

    params, reads, taus, _ = one_round(False)
    on_device, device_reads, device_taus, levels = one_round(True)
    assert all(isinstance(t, float) for t in taus) and taus
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in device_taus if t != float("inf"))
    assert all(torch.equal(params[n], on_device[n]) for n in params)
    # the CPU path reads each group's threshold (FedLASE: a layer, FIARSE: the model) and FedLASE's scores; the
    # device path reads FedLASE's scores once per level and nothing else
    assert len(device_reads) <= (levels if method == "fedlase" else 0) < len(reads), (device_reads, reads)
