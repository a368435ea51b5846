"""LoRA adapters as the trainable set (fedlase/llm/adapters.py) and the adapter methods (fedlase/llm/lora_methods.py):
hand-computed aggregations, the frozen base (never in a state, payload or checkpoint, never copied per client), a
killed and resumed run, the config's one-line refusals, and the export that peft loads. Tiny random BERT folders
only: no weights are read."""
from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
try:   # the llm extra; the hand-computed aggregations below run without it
    import peft
except ImportError:
    peft = None

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment, run_experiment  # noqa: E402
from fedlase.errors import ConfigError  # noqa: E402
from fedlase.llm.lora_methods import client_adapter, hetlora_average, svd_factors  # noqa: E402
from fedlase.masks import Submodel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["the", "a", "market", "shares", "film", "star", "vote", "party", "match", "goal", "phone", "chip",
         "rose", "fell", "won", "lost", "new", "old", "big", "small"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    pytest.importorskip("peft")
    return write_bert_folder(tmp_path_factory.mktemp("tiny-bert"))


def write_bert_folder(d: Path, seed: int = 0) -> Path:
    """A complete tiny Hugging Face folder in `d` (BERT config, safetensors weights drawn from `seed`, WordPiece
    tokenizer) and AG News-style CSV files: a run reads both as it reads MiniLM and BBC News."""
    d.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizer(str(d / "vocab.txt")).save_pretrained(str(d))
    conf = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(seed)
    transformers.BertModel(conf).save_pretrained(str(d))
    data = d / "ag"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    for name, n in (("train.csv", 48), ("test.csv", 12)):
        lines = []
        for i in range(n):
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (8,), generator=g)]
            lines.append(f'"{i % 4 + 1}","{" ".join(words[:3])}","{" ".join(words[3:])}"')
        (data / name).write_text("\n".join(lines) + "\n")
    return d


def lora_args(folder: Path) -> list[str]:
    """A HetLoRA run of rank 4 on the tiny BERT folder `folder` and its CSV files (`bert_folder`)."""
    return ["model=hf", f"model_path={folder}", "dataset=agnews", f"data_dir={folder / 'ag'}", "max_length=16",
            "system={1,1/4}_{2,2}", "participation=1", "local_steps=2", "batch_size=4", "lr=0.05", "rounds=2",
            "eval_every=1", "checkpoint_every=1", "threads=1", "device=cpu", "eval_batch_size=64", "method=hetlora",
            "lora.r=4"]


@pytest.fixture
def lora_cfg(bert_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))

    def make(*overrides: str, out: str | None = None):
        return load_config(None, [*lora_args(bert_folder), f"out={out or tmp_path / 'run'}", *overrides])
    return make


# ---- the aggregations, by hand ------------------------------------------------------------------------------------
def test_hetlora_pads_weights_by_product_norm_and_truncates():
    """Two clients of ranks 2 and 1 (padded to 2): weights ||B_k A_k||_F / sum, so A = sum w_k A_k and B likewise."""
    a1, b1 = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[3.0, 0.0], [0.0, 4.0]])   # ||B A|| = 5
    a2, b2 = torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([[0.0, 0.0], [2.5, 0.0]])   # rank 1: ||B A|| = 5
    a, b = hetlora_average([a1, a2], [b1, b2])
    assert torch.allclose(a, torch.tensor([[1.5, 0.0], [0.0, 0.5]]))   # w = 1/2 each
    assert torch.allclose(b, torch.tensor([[1.5, 0.0], [1.25, 2.0]]))
    a3 = torch.tensor([[0.0, 6.0], [0.0, 0.0]])   # ||B_1 A_3|| = 18 against 5: weights 5/23, 18/23
    a, _ = hetlora_average([a1, a3], [b1, b1])
    assert torch.allclose(a, (5 * a1 + 18 * a3) / 23)
    a, b = hetlora_average([a1, a2], [torch.zeros(2, 2), torch.zeros(2, 2)])   # every product zero: equal weights
    assert torch.allclose(a, (a1 + a2) / 2)
    # truncation: a client of rank 1 starts from the first component of the global adapter (its slice)
    sub = Submodel({"A": torch.tensor([[True, True], [False, False]])}, slices={"A": (torch.tensor([0]),)})
    glob = {"A": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    assert torch.equal(client_adapter("A", glob, {"A": torch.tensor([[0.5, 0.5]])}, sub),
                       torch.tensor([[1.5, 2.5], [0.0, 0.0]]))   # its trained row, zero-padded


def test_flexlora_svd_puts_the_singular_values_on_b_and_truncates():
    """As the authors' code: B = U_r S_r, A = V_r^T. w's SVD by hand: U = I, S = (3, 2), V^T = (e_1, e_3)."""
    w = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    b, a = svd_factors(w, 2)
    assert torch.allclose(b @ a, w, atol=1e-6)
    assert torch.allclose(b.abs(), torch.tensor([[3.0, 0.0], [0.0, 2.0]]), atol=1e-6)   # U S: the values on B
    assert torch.allclose(a.abs(), torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), atol=1e-6)   # V^T: unit rows
    b1, a1 = b[:, :1], a[:1]   # a rank-1 level keeps the first component: the largest singular value
    assert torch.allclose((b1 @ a1).abs(), torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_flexlora_and_flora_aggregate_the_products_of_a_run(lora_cfg):
    """One round of each, its aggregation recomputed by hand from the round's payloads: FlexLoRA's data-weighted
    mean of B_k A_k, then its SVD; FLoRA's exact weighted sum merged into the base, the adapters re-initialised."""
    for method in ("flexlora", "flora"):
        exp = Experiment.from_config(lora_cfg(f"method={method}", "system={1,1/4}_{1,2}"))
        picked = exp.sample(1)
        subs = exp.submodels([lvl for _, lvl in picked], 1)
        updates = exp.runner.train(exp, 1, picked, subs).updates
        ad = exp.method.pairs[0]
        old = {n: p.clone() for n, p in exp.params.items()}
        base_before = dict(exp.model.named_parameters())[ad.base].detach().clone()
        n = [len(exp.client_train[u.client]) for u in updates]
        share = [k / sum(n) for k in n]
        prods = [client_adapter(ad.b, old, u.delta, u.sub or subs[u.level])
                 @ client_adapter(ad.a, old, u.delta, u.sub or subs[u.level]) for u in updates]
        assert {u.level.index for u in updates} == {0, 1}   # the rank-2 clients' products are of rank <= 2
        exp.serve(1, updates, subs, {})
        want = sum(s * p for s, p in zip(share, prods))
        if method == "flexlora":   # the sum has rank up to 4 + 2 + 2: cut back to lora.r = 4
            u, s, vh = torch.linalg.svd(want)
            b, a = exp.params[ad.b], exp.params[ad.a]
            assert torch.allclose(b @ a, u[:, :4] @ torch.diag(s[:4]) @ vh[:4], atol=1e-6)   # the rank-4 truncation
            assert torch.allclose(a @ a.T, torch.eye(4), atol=1e-5)   # A = V_4^T: orthonormal rows
            assert torch.allclose(b.norm(dim=0), s[:4], atol=1e-5)    # B = U_4 S_4: the singular values on B
        else:
            base = dict(exp.model.named_parameters())[ad.base].detach()
            assert torch.allclose(base - base_before, exp.model.scaling * want, atol=1e-6)
            assert not exp.params[ad.b].any()   # fresh adapters: B zero, A redrawn
            assert not torch.equal(exp.params[ad.a], old[ad.a])
            assert torch.allclose(exp.method.state_dict()["merged"][ad.base], base - base_before, atol=1e-6)


# ---- the frozen base ----------------------------------------------------------------------------------------------
def test_the_state_and_the_payload_hold_the_trainable_tensors_only(lora_cfg):
    exp = Experiment.from_config(lora_cfg())
    named = dict(exp.model.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    adapters = {n for ad in exp.method.pairs for n in (ad.a, ad.b)}
    assert set(exp.params) == adapters | {"model.classifier.weight", "model.classifier.bias"}
    assert frozen and not frozen & set(exp.params) and len(frozen) + len(exp.params) == len(named)
    assert len(exp.method.pairs) == 2 * 6   # two layers x (query, key, value, attention output, intermediate, output)
    picked = exp.sample(1)
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    updates = exp.runner.train(exp, 1, picked, subs).updates
    assert all(set(u.delta) == set(exp.params) for u in updates)
    assert all(named[n].grad is None for n in frozen)   # no gradient was ever computed for the base
    small = [u for u in updates if u.level.index == 1]   # a rank-2 client sends its slice of each adapter
    ad = exp.method.pairs[0]
    assert small and all(u.delta[ad.a].shape == (2, 32) and u.delta[ad.b].shape == (32, 2) for u in small)


def _base_copies(exp) -> int:
    """Tensors alive in this process of an adapted base weight's shape, beyond the module's own (no adapter, head or
    slice of them has such a shape; the embeddings' shapes could be a slice's)."""
    named = dict(exp.model.named_parameters())
    base = [named[ad.base] for ad in exp.method.pairs]
    own = {p.data_ptr() for p in base}
    shapes = {tuple(p.shape) for p in base}
    found = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and tuple(obj.shape) in shapes and obj.data_ptr() not in own:
            found.add(obj.data_ptr())
    return len(found)


@pytest.mark.parametrize("clients", [2, 8])
def test_a_rounds_memory_holds_one_base_whatever_its_clients(lora_cfg, clients):
    """No tensor the size of a base weight exists beside the module's own after a round's training of 2 or of 8
    clients (their states, payloads, optimizers, the server's aggregation): one base per process."""
    exp = Experiment.from_config(lora_cfg(f"system={{1,1/4}}_{{{clients // 2},{clients // 2}}}"))
    gc.collect()
    before = _base_copies(exp)
    picked = exp.sample(1)
    assert len(picked) == clients
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    updates = exp.runner.train(exp, 1, picked, subs).updates
    exp.serve(1, updates, subs, {})
    gc.collect()
    assert _base_copies(exp) == before
    assert sum(t.numel() for u in updates for t in u.delta.values()) <= clients * sum(
        p.numel() for p in exp.params.values())   # each payload: at most the adapters and the head


def _ckpt(out) -> dict:
    return torch.load(Path(out) / "checkpoint.pt", weights_only=True)


@pytest.mark.parametrize("method", ["hetlora", "flora"])
def test_a_killed_lora_run_resumes_bit_identically_and_its_checkpoint_holds_no_base(lora_cfg, tmp_path, method):
    whole = run_experiment(lora_cfg(f"method={method}", "rounds=3", out=str(tmp_path / "whole")), progress=False)
    run_experiment(lora_cfg(f"method={method}", "rounds=1", out=str(tmp_path / "cut")), progress=False)
    resumed = run_experiment(lora_cfg(f"method={method}", "rounds=3", out=str(tmp_path / "cut")), resume=True,
                             progress=False)
    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "cut")
    assert a["round"] == b["round"] == 3
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    timing = ("train_time", "eval_time")
    assert {k: v for k, v in whole["final"].items() if k not in timing} == {
        k: v for k, v in resumed["final"].items() if k not in timing}
    exp = Experiment.from_config(lora_cfg(f"method={method}"))
    frozen = {n for n, p in exp.model.named_parameters() if not p.requires_grad}
    assert not frozen & set(a["params"]) and a["frozen"] == exp.frozen and a["frozen"]["frozen"] > 0
    if method == "flora":   # its base changes every round: the checkpoint holds the merged updates, not the base
        merged = a["method"]["merged"]
        assert set(merged) == {ad.base for ad in exp.method.pairs} and set(merged) <= frozen
        assert all(torch.equal(merged[n], b["method"]["merged"][n]) for n in merged)


def test_the_frozen_base_is_hashed_once_per_process_and_a_changed_base_hashes_anew(monkeypatch):
    from fedlase import model_facts
    hashed = []
    real = model_facts._hash_frozen
    monkeypatch.setattr(model_facts, "_hash_frozen", lambda frozen: (hashed.append(1), real(frozen))[1])
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5).requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.Linear(5, 2))   # the head trains
    first = model_facts.frozen_fingerprint(model)
    assert first == real([("0.weight", base.weight), ("0.bias", base.bias)]) and first["frozen"] == 35
    assert model_facts.frozen_fingerprint(model) == first and len(hashed) == 1
    other = torch.nn.Sequential(base, torch.nn.Linear(5, 3))   # another model on the same base: not hashed again
    assert model_facts.frozen_fingerprint(other) == first and len(hashed) == 1
    with torch.no_grad():
        base.weight[0, 0] += 1   # written in place
    changed = model_facts.frozen_fingerprint(model)
    assert changed["sha256"] != first["sha256"] and len(hashed) == 2
    base.bias.data = base.bias.detach() * 2   # a new tensor for a base weight (FLoRA's merge)
    assert model_facts.frozen_fingerprint(model)["sha256"] not in (first["sha256"], changed["sha256"])
    assert len(hashed) == 3
    assert model_facts.frozen_fingerprint(torch.nn.Linear(2, 2)) is None   # nothing frozen


# ---- every family on the adapters, and what combines ----------------------------------------------------------
@pytest.mark.parametrize("overrides", [["method=heterofl"], ["method=fiarse"], ["method=fedlase"],
                                       ["method=lora_fedavg", "method_args.rank=full"],
                                       ["method=flexlora", "precision=bf16"],
                                       ["method=lora_fedavg", "dp.clip=1", "dp.noise_multiplier=0.5"],
                                       ["method=hetlora", "lora.ranks=[4,1]", "lora.targets=[query,value]"],
                                       ["method=fjord"], ["method=heterofl", "schedule=fedbuff", "device_model={}"]])
def test_each_family_runs_a_round_on_the_adapters(lora_cfg, overrides):
    from fedlase.dispatch import run_config  # the simulated clock, where a schedule needs one
    summary = run_config(lora_cfg(*overrides, "rounds=1", "checkpoint_every=0"), progress=False)
    levels = summary["final"]["levels"]
    assert set(levels) == {"1", "1/4"} and all(math.isfinite(v["global_acc"]) for v in levels.values())
    kept = {name: v["kept"] for name, v in levels.items()}
    if overrides[0] in ("method=heterofl", "method=hetlora"):
        assert kept["1/4"] < kept["1"]   # a smaller rank holds fewer adapter coordinates


def test_width_methods_cut_nested_ranks(lora_cfg):
    """HeteroFL on adapters: the level 1/4 keeps the first ceil(sqrt(1/4) r) = 2 of r = 4 components of every
    adapter (A's rows, B's columns), as the adapter methods' default ranks."""
    exp = Experiment.from_config(lora_cfg("method=heterofl"))
    sub = exp.method.submodel(exp.params, exp.levels[1], 1)
    for ad in exp.model.adapters:
        assert torch.equal(sub.slices[ad.a][0], torch.arange(2)) and torch.equal(sub.slices[ad.b][1], torch.arange(2))
        assert sub.masks[ad.a][:2].all() and not sub.masks[ad.a][2:].any()
        assert sub.masks[ad.b][:, :2].all() and not sub.masks[ad.b][:, 2:].any()
    assert exp.cfg.lora["ranks"] == [4, 2]


# ---- bad inputs: one line, naming the key --------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [
    (["lora.r=0"], "lora.r"),
    (["lora.r=40"], "lora.r"),                                 # above the 32-wide targets
    (["lora.targets=[q_proj]"], "lora.targets"),               # a Llama name on a BERT
    (["lora.rank=4"], "lora.rank"),                            # no such option
    (["lora.ranks=[4,8]"], "lora.ranks"),
    (["lora.ranks=[4]"], "lora.ranks"),
    (["method=heterofl", "lora.ranks=[4,1]"], "lora.ranks"),   # not the ranks heterofl cuts ([4,2] passes)
    (["lora=null"], "lora"),                                   # an adapter method without adapters
    (["method=flexlora", "robust=median"], "robust"),
    (["method=hetlora", "dp.clip=1", "dp.noise_multiplier=1"], "dp"),
    (["method=flora", "engine=flower-sim"], "engine"),       # its merged base would not reach the nodes
])
def test_bad_lora_inputs_are_one_line_errors(lora_cfg, overrides, key, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_experiment(lora_cfg(*overrides, out=str(tmp_path / "bad")), progress=False)
    assert err.value.key == key and "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()


def test_lora_on_an_image_model_is_refused(tiny_cfg):
    with pytest.raises(ConfigError) as err:
        tiny_cfg("lora.r=4")
    assert err.value.key == "lora" and "text model" in str(err.value)


# ---- export: a peft folder ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, level", [("hetlora", None), ("hetlora", "1/4"), ("flora", None)])
def test_the_export_loads_in_peft_and_computes_what_the_run_evaluates(lora_cfg, bert_folder, tmp_path, method, level):
    """`fedlase export RUN out=DIR`: PeftModel.from_pretrained on the tiny base gives the same hidden states as
    fedlase's model at that level (FLoRA: the merged update, as a full-rank adapter); the head is beside it."""
    from safetensors.torch import load_file

    from fedlase.cli import main
    cfg = lora_cfg(f"method={method}", "rounds=2", "checkpoint_every=2", out=str(tmp_path / "run"))
    run_experiment(cfg, progress=False)
    out = tmp_path / "adapter"
    assert main(["export", str(cfg.out), f"out={out}", *([f"level={level}"] if level else [])]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "head.safetensors"} <= {p.name for p in out.iterdir()}
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == (2 if level else 4 if method == "hetlora" else 32)
    base = transformers.BertModel.from_pretrained(str(bert_folder), add_pooling_layer=False).eval()
    tuned = peft.PeftModel.from_pretrained(base, str(out)).eval()
    exp = Experiment.from_config(cfg)
    exp.load_state_dict(torch.load(Path(cfg.out) / "checkpoint.pt", weights_only=True))
    lvl = exp.levels[1] if level else exp.levels[0]
    weights = exp.method.eval_submodel(exp.params, lvl, exp.round).model(exp.params, exp.buffers)[0]
    x = exp.x_test[:4]
    mask = (x != 0).long()
    with torch.no_grad():
        ours = torch.func.functional_call(exp.model.model.backbone, weights_of(weights, "model.backbone."), (),
                                          {"input_ids": x, "attention_mask": mask}).last_hidden_state
        theirs = tuned(input_ids=x, attention_mask=mask).last_hidden_state
    assert torch.allclose(ours, theirs, atol=1e-5)
    head = load_file(str(out / "head.safetensors"))
    assert torch.equal(head["classifier.weight"], exp.params["model.classifier.weight"])
    assert main(["export", str(cfg.out), f"out={out}"]) == 2   # never over an adapter already there
    assert main(["export", f"out={out.parent / 'again'}", str(cfg.out)]) == 0   # settings before the folder too
    assert (out.parent / "again" / "adapter_model.safetensors").is_file()


def weights_of(weights: dict, prefix: str) -> dict:
    return {n[len(prefix):]: w for n, w in weights.items() if n.startswith(prefix)}


def test_export_of_a_run_without_adapters_is_one_line(tiny_cfg, tmp_path, capsys):
    from fedlase.cli import main
    cfg = tiny_cfg("rounds=1", out=str(tmp_path / "plain"))
    run_experiment(cfg, progress=False)
    assert main(["export", str(cfg.out), f"out={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no LoRA adapters" in err and "\n" not in err and not (tmp_path / "a").exists()


# ---- a decoder: LoRA on a tiny random Llama, next-token prediction, its export generating with peft --------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random LlamaForCausalLM folder (2 layers, hidden 32) with a character tokenizer, and a text folder of
    two categories."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    pytest.importorskip("peft")
    d = tmp_path_factory.mktemp("tiny-llama")
    chars = string.ascii_lowercase + " ."
    tk = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}},
                                    unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>").save_pretrained(d)
    conf = transformers.LlamaConfig(vocab_size=len(chars) + 2, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=128, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(conf).save_pretrained(d)
    texts = d / "texts"
    for cat, words in {"sport": "goal match team win", "money": "bank rate stock fund"}.items():
        (texts / cat).mkdir(parents=True)
        for i in range(4):
            (texts / cat / f"{i}.txt").write_text(" ".join(words.split()[j % 4] for j in range(i, i + 30)) + ".")
    return d


def _llama_cfg(llama_folder, out, *overrides):
    return load_config(None, ["model=hf_causal", f"model_path={llama_folder}", "task=lm", "dataset=text_folder",
                              f"data_dir={llama_folder / 'texts'}", "max_length=16", "system={1,1/4}_{2,2}",
                              "participation=1", "local_steps=2", "batch_size=4", "rounds=1", "eval_every=1",
                              "eval_batch_size=8", "eval_blocks=4", "threads=1", "device=cpu", "method=hetlora",
                              "lora.r=4", "lr=0.01", f"out={out}", *overrides])


def test_a_decoders_lora_run_exports_an_adapter_that_peft_loads_and_generates_with(llama_folder, tmp_path):
    from fedlase.cli import main
    cfg = _llama_cfg(llama_folder, tmp_path / "run")
    summary = run_experiment(cfg, progress=False)
    assert all(math.isfinite(v["global_ppl"]) for v in summary["final"]["levels"].values())
    exp = Experiment.from_config(cfg)
    assert {ad.path.rsplit(".", 1)[-1] for ad in exp.method.pairs} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"}
    exp.load_state_dict(torch.load(Path(cfg.out) / "checkpoint.pt", weights_only=True))
    out = tmp_path / "adapter"
    assert main(["export", str(cfg.out), f"out={out}"]) == 0
    assert not (out / "head.safetensors").exists()   # a causal LM's head is its (frozen, tied) embedding
    base = transformers.LlamaForCausalLM.from_pretrained(str(llama_folder)).eval()
    tuned = peft.PeftModel.from_pretrained(base, str(out)).eval()
    x = exp.x_test[:2]
    with torch.no_grad():
        ours = torch.func.functional_call(exp.model, dict(exp.params), (x,))
        theirs = tuned(input_ids=x).logits
        generated = tuned.generate(input_ids=x[:1, :4], max_new_tokens=5, do_sample=False)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert generated.shape == (1, 9) and torch.equal(generated[0, 4], ours[0, 3].argmax())


def test_floras_merge_leaves_the_shared_loaded_base_as_it_was(llama_folder, tmp_path):
    """A decoder's base tensors are shared by every model built from one loaded folder: FLoRA's merged base is a
    new tensor, so a run built after a FLoRA run in the same process gets the pretrained base (the same hash)."""
    cfg = _llama_cfg(llama_folder, tmp_path / "run", "method=flora")
    before = Experiment.from_config(cfg).frozen
    run_experiment(cfg, progress=False)
    assert Experiment.from_config(cfg).frozen == before


@pytest.mark.numerics
def test_a_rank_slice_trains_as_the_masked_full_adapter(lora_cfg, tmp_path):
    """sliced=true (a rank-k client trains the gathered k-row A and k-column B) against sliced=false (masks over
    the rank-r adapter): the same adapters up to float rounding."""
    sliced = run_experiment(lora_cfg("sliced=true", out=str(tmp_path / "a")), progress=False)
    masked = run_experiment(lora_cfg("sliced=false", out=str(tmp_path / "b")), progress=False)
    a, b = _ckpt(tmp_path / "a")["params"], _ckpt(tmp_path / "b")["params"]
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)
    assert sliced["final"]["global_acc"] == pytest.approx(masked["final"]["global_acc"], abs=0.1)


def test_hetlora_rank_self_pruning_by_hand():
    """Rank 4, prune 0.5 (the paper's decay 0.5): the last 2 components are pruned when the product they sent is
    smaller than the one they received at the round's start. A = I, so component j's product is B's column j."""
    from fedlase.llm.lora_methods import self_pruned_rank
    a = torch.eye(4)

    def b(*col):
        return torch.diag(torch.tensor(col))
    got = [(a, b(3.0, 2.0, 1.0, 1.0))]   # received: a tail of norm ||(1, 1)|| = 1.41
    assert self_pruned_rank(got, [(a, b(3.0, 2.0, 0.5, 0.5))], 4, 0.5) == 2    # sent ||(0.5, 0.5)|| = 0.71: pruned
    assert self_pruned_rank(got, [(a, b(1.0, 1.0, 2.0, 0.1))], 4, 0.5) == 4    # sent ||(2, 0.1)|| = 2.0: kept
    assert self_pruned_rank(got, [(a, b(1.0, 1.0, 2.0, 0.1))], 4, 0.25) == 3   # the last one alone: 0.1 < 1
    assert self_pruned_rank(got, [(a, b(3.0, 2.0, 0.5, 0.5))], 4, 0.3) == 2    # ceil(0.3 x 4) = 4 - floor(0.7 x 4)
    # over both modules: received sqrt(4 x 1^2) = 2, sent sqrt(0.5^2 + 0.5^2 + 3^2) = 3.08: kept
    assert self_pruned_rank(got * 2, [(a, b(3.0, 2.0, 0.5, 0.5)), (a, b(0.0, 0.0, 3.0, 0.0))], 4, 0.5) == 4
    zero = [(a, torch.zeros(4, 4))]   # the first round: B starts at zero, so no tail can have shrunk
    assert self_pruned_rank(zero, [(a, b(3.0, 2.0, 0.0, 0.01))], 4, 0.5) == 4
    assert self_pruned_rank([(a[:1], b(3.0)[:, :1])], [(a[:1], b(0.1)[:, :1])], 1, 0.5) == 1   # never below rank 1


def test_hetlora_prunes_a_tail_that_shrank_below_what_it_received(lora_cfg):
    """A round-2 server step (B no longer zero): each client's decision recomputed from the global adapter it
    received and the one it sent, over every adapted module; ranks 4 and 2, prune 0.5: tails of 2 and 1."""
    exp = Experiment.from_config(lora_cfg("method_args.prune=0.5", "lr=0.5"))
    exp.step(1)
    pruned = dict(exp.method.pruned)
    picked = exp.sample(2)
    subs = exp.submodels([lvl for _, lvl in picked], 2)
    updates = exp.runner.train(exp, 2, picked, subs).updates
    old = {n: p.clone() for n, p in exp.params.items()}
    for u in updates:
        sub = u.sub or subs[u.level]
        k = pruned.get(u.client, 4 if u.level.index == 0 else 2)
        lo = k - math.ceil(0.5 * k)
        got = sent = 0.0
        for ad in exp.method.pairs:
            a, b = client_adapter(ad.a, old, u.delta, sub), client_adapter(ad.b, old, u.delta, sub)
            sent += float(torch.linalg.matrix_norm(b[:, lo:k] @ a[lo:k])) ** 2
            got += float(torch.linalg.matrix_norm(old[ad.b][:, lo:k] @ old[ad.a][lo:k])) ** 2
        if lo >= 1 and sent < got:
            pruned[u.client] = lo
    assert pruned   # not vacuous: a tail shrank in this round (client 1's, to 0.7x what it received, here)
    exp.serve(2, updates, subs, {})
    assert exp.method.pruned == pruned



def test_a_pruned_hetlora_client_trains_its_own_rank_and_resumes(lora_cfg, tmp_path):
    exp = Experiment.from_config(lora_cfg("method_args.prune=0.5"))
    exp.method.pruned = {0: 1}   # client 0 (level 1, rank 4) pruned itself to rank 1
    picked = exp.sample(1)
    subs = exp.submodels([lvl for _, lvl in picked], 1)
    updates = {u.client: u for u in exp.runner.train(exp, 1, picked, subs).updates}
    ad = exp.method.pairs[0]
    assert updates[0].sub is not None and updates[0].delta[ad.a].shape == (1, 32)
    assert updates[1].sub is None and updates[1].delta[ad.a].shape == (4, 32)   # its level's whole rank
    exp.serve(1, list(updates.values()), subs, {})
    assert exp.method.state_dict()["pruned"][0] == 1
    # the pruned ranks are checkpointed: a resumed run continues them
    run_experiment(lora_cfg("method_args.prune=0.5", "rounds=3", out=str(tmp_path / "whole")), progress=False)
    run_experiment(lora_cfg("method_args.prune=0.5", "rounds=1", out=str(tmp_path / "cut")), progress=False)
    run_experiment(lora_cfg("method_args.prune=0.5", "rounds=3", out=str(tmp_path / "cut")), resume=True,
                   progress=False)
    a, b = _ckpt(tmp_path / "whole"), _ckpt(tmp_path / "cut")
    assert a["method"] == b["method"] and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
