"""The text track's model and data side: budgeted tensors of a BERT-layout transformer, FIARSE/FedLASE budgets,
head/feed-forward width slices against a physically sliced reference, the tokenization cache, and one-line
errors for bad inputs. A tiny random BERT keeps these fast; the packaged MiniLM is loaded in two tests.
Timings (tokenization, MiniLM's local step) are in `fedlase bench --only text` (tools/bench.py)."""
import json
import math
import os
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

transformers = pytest.importorskip("transformers")

from fedlase.data import text as textdata  # noqa: E402
from fedlase.errors import ConfigError, DataError, UserError  # noqa: E402
from fedlase.methods.fedlase import FedLASE  # noqa: E402
from fedlase.methods.fedrolex import FedRolex  # noqa: E402
from fedlase.methods.fiarse import FIARSE  # noqa: E402
from fedlase.methods.heterofl import HeteroFL  # noqa: E402
from fedlase.models.transformer import TransformerClassifier, build_hf, build_minilm  # noqa: E402

LEVELS = [1.0, 1 / 4, 1 / 16, 1 / 64]
WORDS = ["the", "a", "market", "shares", "film", "star", "vote", "party", "match", "goal", "phone", "chip",
         "rose", "fell", "won", "lost", "new", "old", "big", "small"]


def tiny_config(heads=4, dropout=0.0):
    return transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=heads,
                                   intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                   attention_probs_dropout_prob=dropout, pad_token_id=0)


def tiny_model(heads=4, dropout=0.0, num_classes=3, pooler=True, seed=0, **kw):
    torch.manual_seed(seed)
    enc = transformers.BertModel(tiny_config(heads, dropout), add_pooling_layer=pooler)
    with torch.no_grad():   # BERT initialises biases and LayerNorms to constants: make every tensor distinct
        for p in enc.parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn_like(p))
    return TransformerClassifier(enc, num_classes, pad_id=0, seed=seed, **kw)


def batch(n=6, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(5, 40, (n, length), generator=g)
    lens = torch.randint(3, length - 2, (n,), generator=g)   # every row shorter than length: trimming happens
    for i, k in enumerate(lens):
        x[i, 0], x[i, k:] = 2, 0
    return x


def params_of(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def one_line(e: BaseException) -> str:
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg and msg, msg
    return msg


# ----------------------------------------------------------------------------------- budgeted tensors


def test_tiny_budgeted_names_and_count_by_hand():
    m = tiny_model()
    names = m.budgeted_names()
    P = params_of(m)
    layer = [f"backbone.encoder.layer.{i}.{s}.{wb}" for i in range(2)
             for s in ("attention.self.query", "attention.self.key", "attention.self.value",
                       "attention.output.dense", "intermediate.dense", "output.dense") for wb in ("weight", "bias")]
    expected = (["backbone.embeddings.word_embeddings.weight", "backbone.embeddings.position_embeddings.weight"]
                + layer + ["backbone.pooler.dense.weight", "backbone.pooler.dense.bias"])
    assert names == expected
    # word 1000x32 + positions 64x32 + 2 layers x (4 x (32x32+32) + (64x32+64) + (32x64+32)) + pooler 32x32+32
    assert sum(P[n].numel() for n in names) == 32000 + 2048 + 2 * (4 * 1056 + 2112 + 2080) + 1056 == 51936
    outside = set(P) - set(names)
    assert all("LayerNorm" in n or "token_type" in n or n.startswith("classifier") for n in outside), outside
    assert m.edge_layers() == ["backbone.pooler.dense.weight"]
    # without a pooler (RoBERTa's classifier): a dense + out_proj head, both outside the budget; no edge layer
    r = tiny_model(pooler=False)
    assert "backbone.pooler.dense.weight" not in r.budgeted_names() and r.edge_layers() == []
    assert {"dense.weight", "classifier.weight"} <= set(dict(r.named_parameters()))


def test_mean_head_and_word_embeddings_outside_the_budget():
    m = tiny_model(pooler=False, head="mean").eval()
    assert m.edge_layers() == [] and not hasattr(m, "dense")
    x = batch()
    with torch.no_grad():
        h = m.backbone(input_ids=x, attention_mask=(x != 0).long()).last_hidden_state
        keep = (x != 0).unsqueeze(-1).float()
        by_hand = ((h * keep).sum(1) / keep.sum(1)) @ m.classifier.weight.T + m.classifier.bias
        assert torch.allclose(m(x), by_hand, atol=1e-6)
    with pytest.raises(ValueError):   # a mean head has no use for a pooler
        tiny_model(pooler=True, head="mean")
    whole = tiny_model(word_embeddings="whole")
    word = "backbone.embeddings.word_embeddings.weight"
    assert whole.budgeted_names() == [n for n in tiny_model().budgeted_names() if n != word]
    P = params_of(whole)
    sub = FIARSE(whole, LEVELS).submodel(P, 1 / 64, 1)
    assert word not in sub.masks and word not in sub.thresholds   # held whole by every client
    budget = sum(P[n].numel() for n in whole.budgeted_names())
    assert sub.kept(whole.budgeted_names(), P) == int(budget / 64)


def test_forward_trims_to_longest_sequence_and_ignores_padding():
    m = tiny_model().eval()
    x = batch()
    longer = torch.cat([x, torch.zeros(x.shape[0], 20, dtype=x.dtype)], 1)   # more padding changes nothing
    with torch.no_grad():
        a, b = m(x), m(longer)
        single = torch.cat([m(x[i:i + 1]) for i in range(len(x))])   # each row alone, trimmed to itself
    assert a.shape == (x.shape[0], 3)
    assert torch.equal(a, b)
    assert torch.allclose(a, single, atol=1e-5)


def test_building_never_touches_the_global_generator():
    state = torch.random.get_rng_state()
    a = tiny_model(seed=3)
    torch.random.set_rng_state(state)
    TransformerClassifier(a.backbone, 3, pad_id=0, seed=3)
    torch.manual_seed(0)
    s0 = torch.random.get_rng_state()
    h1 = TransformerClassifier(a.backbone, 3, pad_id=0, seed=3).classifier.weight
    assert torch.equal(torch.random.get_rng_state(), s0)
    torch.manual_seed(123)
    h2 = TransformerClassifier(a.backbone, 3, pad_id=0, seed=3).classifier.weight
    assert torch.equal(h1, h2)   # the head depends on cfg.seed only


def test_dropout_draws_only_from_the_global_generator():
    m = tiny_model(dropout=0.1).train()
    x = batch()
    torch.manual_seed(7)
    a = m(x)
    torch.manual_seed(7)
    b = m(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, m(x))   # dropout is on in training


# ----------------------------------------------------------------------------------- threshold budgets


# the tiny model's pooler + biases (1,504) exceed its 1/64 budget (811), so FedLASE with its edge layers
# whole runs on [1, 1/4, 1/16] here; the MiniLM test below covers every level
@pytest.mark.parametrize("cls,opts,levels", [(FIARSE, {}, LEVELS), (FedLASE, {}, LEVELS[:3]),
                                             (FedLASE, {"extract_all_layers": True}, LEVELS)])
def test_threshold_masks_keep_exactly_the_budget_tiny(cls, opts, levels):
    m = tiny_model()
    P = params_of(m)
    method = cls(m, levels, **opts)
    total = sum(P[n].numel() for n in m.budgeted_names())
    assert method.maskable == m.budgeted_names()
    for lvl in levels:
        sub = method.submodel(P, lvl, 1)
        assert sub.kept(method.maskable, P) == int(lvl * total), (cls.name, lvl)
        assert not any(n in sub.masks for n in P if n not in method.maskable)   # LayerNorm, head: whole


def test_fedlase_keeps_the_edge_layers_whole():
    m = tiny_model()
    P = params_of(m)
    method = FedLASE(m, LEVELS[:2])
    assert "backbone.pooler.dense.weight" not in method.extracted
    assert "backbone.embeddings.word_embeddings.weight" in method.extracted
    sub = method.submodel(P, 1 / 4, 1)
    assert "backbone.pooler.dense.weight" not in sub.masks
    literal = FedLASE(m, [1.0, 0.75], edge_layers="first_last")
    assert {"backbone.embeddings.word_embeddings.weight", "backbone.pooler.dense.weight"}.isdisjoint(literal.extracted)


# ----------------------------------------------------------------------------------- width slices


def kept_rows(mask):
    return torch.nonzero(mask.reshape(mask.shape[0], -1).any(1)).flatten()


def reference_forward(model, P, sub, x, scale=1.0):
    """BERT written out by hand on the physically sliced weights (kept heads and feed-forward units only)."""
    conf = model.backbone.config
    hd, eps = model.head_dim, conf.layer_norm_eps
    pre = "backbone."
    mask = x != 0
    length = int(mask.any(0).nonzero().max()) + 1
    x, mask = x[:, :length], mask[:, :length]
    ln = lambda h, n: F.layer_norm(h, (h.shape[-1],), P[f"{n}.weight"], P[f"{n}.bias"], eps)  # noqa: E731
    h = (P[pre + "embeddings.word_embeddings.weight"][x] + P[pre + "embeddings.position_embeddings.weight"][:length]
         + P[pre + "embeddings.token_type_embeddings.weight"][0])
    h = ln(h, pre + "embeddings.LayerNorm")
    bias = torch.zeros(mask.shape, dtype=h.dtype).masked_fill(~mask, float("-inf"))[:, None, None, :]
    for i in range(conf.num_hidden_layers):
        p = f"{pre}encoder.layer.{i}."
        q_name = p + "attention.self.query.weight"
        rows = kept_rows(sub.masks[q_name]) if q_name in sub.masks else torch.arange(conf.hidden_size)
        assert len(rows) % hd == 0 and torch.equal(rows.view(-1, hd) % hd, torch.arange(hd).expand(len(rows) // hd, hd))

        def proj(name):
            t = h @ P[p + f"attention.self.{name}.weight"][rows].T + P[p + f"attention.self.{name}.bias"][rows]
            return t.view(*t.shape[:2], -1, hd).transpose(1, 2)            # (B, heads kept, L, hd)
        q, k, v = proj("query"), proj("key"), proj("value")
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + bias, -1)
        ctx = (att @ v).transpose(1, 2).reshape(h.shape[0], length, -1)
        o = ctx @ P[p + "attention.output.dense.weight"][:, rows].T + P[p + "attention.output.dense.bias"]
        h = ln(h + o * scale, p + "attention.output.LayerNorm")
        i_name = p + "intermediate.dense.weight"
        units = kept_rows(sub.masks[i_name]) if i_name in sub.masks else torch.arange(conf.intermediate_size)
        f = F.gelu(h @ P[i_name][units].T + P[p + "intermediate.dense.bias"][units])
        out = f @ P[p + "output.dense.weight"][:, units].T + P[p + "output.dense.bias"]
        h = ln(h + out * scale, p + "output.LayerNorm")
    pooled = torch.tanh(h[:, 0] @ P[pre + "pooler.dense.weight"].T + P[pre + "pooler.dense.bias"])
    return pooled @ P["classifier.weight"].T + P["classifier.bias"]


@pytest.mark.parametrize("cls,rnd", [(HeteroFL, 1), (FedRolex, 1), (FedRolex, 3), (FedRolex, 6)])
@pytest.mark.parametrize("train", [False, True])
def test_masked_dense_equals_sliced_model(cls, rnd, train):
    m = tiny_model(dropout=0.0)   # 4 heads of 8, 64 feed-forward units
    P = params_of(m)
    buffers = dict(m.named_buffers())
    method = cls(m, LEVELS)
    x = batch()
    m.train(train)
    for lvl in LEVELS:
        sub = method.submodel(P, lvl, rnd)
        rate = math.sqrt(lvl)
        if sub.masks:
            heads = kept_rows(sub.masks["backbone.encoder.layer.0.attention.self.query.weight"]) // m.head_dim
            assert len(heads.unique()) == math.ceil(rate * 4)
            units = kept_rows(sub.masks["backbone.encoder.layer.1.intermediate.dense.weight"])
            assert len(units) == math.ceil(rate * 64)
        with torch.no_grad():   # in training the scaler is folded into the scaled layers' weights
            got = functional_call(m, (sub.apply(P, train=train), buffers), (x,))
            scale = next(iter(sub.scales.values()), 1.0) if train else 1.0
            want = reference_forward(m, P, sub, x, scale)
        assert torch.allclose(got, want, atol=1e-5), (cls.name, rnd, lvl, (got - want).abs().max())


def physically_sliced(P, sub, groups):
    """The smaller tensors of a width slice: each parameter cut to its kept output rows and input columns."""
    out = {}
    for n, t in P.items():
        if n not in sub.masks or n not in groups:
            out[n] = t
            continue
        m = sub.masks[n]
        o, i = groups[n]
        if o is not None:
            t, m = t[kept_rows(m)], m[kept_rows(m)]
        if i is not None:
            cols = torch.nonzero(m.any(0)).flatten()
            t = t[:, cols]
        out[n] = t
    return out


@pytest.mark.parametrize("cls,rnd", [(HeteroFL, 1), (FedRolex, 4)])
def test_smaller_tensors_run_through_the_same_module(cls, rnd):
    """Hugging Face's attention reshapes to (-1 heads, head size), so the physically smaller tensors of a slice
    run through the unchanged module (functional_call) and compute what the masks compute."""
    m = tiny_model().eval()
    P = params_of(m)
    method = cls(m, LEVELS)
    x = batch()
    for lvl in LEVELS[1:]:
        sub = method.submodel(P, lvl, rnd)
        small = physically_sliced(P, sub, m.channel_groups())
        assert small["backbone.encoder.layer.0.attention.self.query.weight"].shape[0] < 32
        with torch.no_grad():
            got = functional_call(m, ({**small}, dict(m.named_buffers())), (x,))
            want = functional_call(m, (sub.apply(P), dict(m.named_buffers())), (x,))
        assert torch.allclose(got, want, atol=1e-5), (lvl, (got - want).abs().max())


def test_fedrolex_rolls_whole_heads():
    m = tiny_model()
    P = params_of(m)
    method = FedRolex(m, LEVELS)
    name = "backbone.encoder.layer.0.attention.self.query.weight"
    for rnd in range(1, 9):
        heads = sorted(set((kept_rows(method.submodel(P, 1 / 16, rnd).masks[name]) // 8).tolist()))
        assert heads == [(-(rnd - 1)) % 4]   # one head of four, rolling back by one head a round



def test_derived_groups_differ_from_the_hand_written_ones_only_where_docs_say():
    """docs/methods-structured.md, "Groups derived by tracing": the trace finds the heads and feed-forward groups
    of the hand-written channel_groups(), and cuts the residual stream and the pooler's outputs besides."""
    from fedlase.models.trace import _slices_match, trace_groups
    from fedlase.slicing import width_slices
    model = tiny_model()
    x = torch.randint(1, 1000, (2, 6))

    def keys(groups):   # {(parameter, dim): group}
        return {(p, d): g for p, pair in groups.items() for d, g in enumerate(pair) if g is not None}

    def partition(k):   # the groups, each as the set of its (parameter, dim)s
        out = {}
        for key, g in k.items():
            out.setdefault(g, set()).add(key)
        return {frozenset(v) for v in out.values()}

    derived_groups = trace_groups(model, x)
    hand, derived = keys(model.channel_groups()), keys(derived_groups)
    assert partition({k: derived[k] for k in hand}) == partition(hand)
    extra = {derived[k] for k in derived if k not in hand}
    assert extra == {derived["backbone.embeddings.word_embeddings.weight", 1],
                     derived["backbone.pooler.dense.weight", 0]}
    assert _slices_match(model, derived_groups, x, "heterofl", width_slices) is False


def hidden_states(model, weights, x):
    inner = {k[len("backbone."):]: v for k, v in weights.items() if k.startswith("backbone.")}
    with torch.no_grad():
        out = functional_call(model.backbone, inner, args=(),
                              kwargs={"input_ids": x, "attention_mask": (x != 0).long()})
    return out.last_hidden_state


@pytest.mark.parametrize("cls", [HeteroFL, FedRolex])
def test_without_the_scaler_a_width_slice_trains_the_function_it_is_evaluated_with(cls):
    """docs/text.md, "Width methods on text: diagnosis": the residual stream is never sliced, so the scaler's factor
    on the attention and feed-forward outputs changes what every post-LayerNorm sees; with scaler=false a client
    trains exactly the function its level is evaluated with."""
    m = tiny_model().eval()
    P, x = params_of(m), batch()
    for lvl in LEVELS[1:]:
        scaled, plain = (cls(m, LEVELS, scaler=s).submodel(P, lvl, 2) for s in (True, False))
        evaluated = hidden_states(m, plain.apply(P), x)
        assert torch.equal(hidden_states(m, plain.apply(P, train=True), x), evaluated)
        assert torch.equal(hidden_states(m, scaled.apply(P), x), evaluated)   # evaluation ignores the scaler
        trained = hidden_states(m, scaled.apply(P, train=True), x)
        assert (trained - evaluated).norm() > 0.05 * evaluated.norm(), (cls.name, lvl)   # 0.11, 0.32, 0.68 here


def test_the_scaler_is_off_by_default_on_transformers_and_the_text_experiments_say_so():
    """docs/text.md, "Width methods on text: diagnosis": unset, method_args.scaler is the model's choice (off on a
    transformer, on for the CNNs); experiments/text.yaml runs HeteroFL and FedRolex unscaled and
    experiments/text-scaler.yaml keeps the official codes' Scaler as the ablation, each set explicitly."""
    import yaml

    from fedlase.models.cnn import SmallCNN
    for cls in (HeteroFL, FedRolex):
        assert cls(tiny_model(), LEVELS).scaler is False and cls(tiny_model(), LEVELS, scaler=True).scaler is True
        assert cls(SmallCNN(width=0.25), LEVELS).scaler is True
    assert HeteroFL(tiny_model(), LEVELS).submodel(params_of(tiny_model()), 1 / 16, 1).scales == {}
    folder = os.path.join(os.path.dirname(__file__), "..", "experiments")
    runs = {r["name"]: r for f in ("text.yaml", "text-scaler.yaml")
            for r in yaml.safe_load(open(os.path.join(folder, f)))["runs"]}
    for method in ("heterofl", "fedrolex"):
        assert runs[f"{method}-unscaled"]["method"] == runs[method]["method"] == method
        assert runs[f"{method}-unscaled"]["method_args"] == {"scaler": False}
        assert runs[method]["method_args"] == {"scaler": True}


# ----------------------------------------------------------------------------------- a local folder, AG News


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A complete tiny Hugging Face folder: BERT config, safetensors weights, WordPiece tokenizer."""
    d = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = transformers.BertTokenizer(str(d / "vocab.txt"))
    tok.save_pretrained(str(d))
    conf = tiny_config()
    conf.vocab_size = len(vocab)
    torch.manual_seed(0)
    transformers.BertModel(conf).save_pretrained(str(d))
    return d


def write_agnews(folder, n_train=40, n_test=12, bad_row=None):
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    for name, n in (("train.csv", n_train), ("test.csv", n_test)):
        lines = []
        for i in range(n):
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (8,), generator=g)]
            lines.append(f'"{i % 4 + 1}","{" ".join(words[:3])}","{" ".join(words[3:])}"')
        if bad_row is not None and name == "train.csv":
            lines[bad_row - 1] = '"7","no such class"'
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def cfg_for(folder, data_dir=None, max_length=16, seed=0):
    return types.SimpleNamespace(model="hf", model_path=str(folder), data_dir=str(data_dir) if data_dir else None,
                                 max_length=max_length, seed=seed)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FEDLASE_CACHE", str(d))
    return d


def test_agnews_loads_and_runs_through_a_local_folder(hf_folder, tmp_path, cache):
    data = write_agnews(tmp_path / "ag")
    cfg = cfg_for(hf_folder, data)
    ds = textdata.load_agnews(cfg)
    assert ds.num_classes == 4 and ds.x_train.shape == (40, 16) and ds.x_test.shape == (12, 16)
    assert ds.x_train.dtype == torch.int64 and ds.y_train.tolist()[:5] == [0, 1, 2, 3, 0]
    assert (ds.x_train[:, 0] == 2).all() and (ds.x_train == 0).any()   # [CLS] first, padded with [PAD]=0
    m = build_hf(cfg, ds)
    assert m.pad_id == 0 and m.head == "pooler"
    m.eval()
    assert m(ds.x_test[:5]).shape == (5, 4)


def test_token_cache_is_deterministic_and_keyed_by_tokenizer_and_length(hf_folder, tmp_path, cache, monkeypatch):
    data = write_agnews(tmp_path / "ag")
    first = textdata.load_agnews(cfg_for(hf_folder, data))
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 2 and not any(f.endswith(".tmp") for f in files)   # train and test, no leftovers

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized again")
    with monkeypatch.context() as mp:
        mp.setattr(textdata, "tokenize", no_tokenizing)
        again = textdata.load_agnews(cfg_for(hf_folder, data))
    assert torch.equal(first.x_train, again.x_train) and torch.equal(first.y_test, again.y_test)

    blobs = {f: (cache / f).read_bytes() for f in files}   # deterministic: a rebuild gives identical tokens
    shutil.rmtree(cache)
    rebuilt = textdata.load_agnews(cfg_for(hf_folder, data))
    assert sorted(p.name for p in cache.iterdir()) == files
    assert torch.equal(rebuilt.x_train, first.x_train)
    for f in files:
        assert torch.equal(torch.load(cache / f)["ids"], torch.load(__import__("io").BytesIO(blobs[f]))["ids"])

    longer = textdata.load_agnews(cfg_for(hf_folder, data, max_length=24))   # another max_length: new entries
    assert longer.x_train.shape[1] == 24 and len(list(cache.iterdir())) == 4
    assert torch.equal(longer.x_train[:, :16][first.x_train[:, 15] == 0], first.x_train[first.x_train[:, 15] == 0])

    other = tmp_path / "other-tok"   # another tokenizer (one more word in its vocabulary): new entries
    shutil.copytree(hf_folder, other)
    with open(other / "vocab.txt", "a") as f:
        f.write("market\u00e9\n")
    textdata.load_agnews(cfg_for(other, data))
    assert len(list(cache.iterdir())) == 6

    with open(data / "test.csv", "a") as f:   # changed data: new entry for that file only
        f.write('"1","extra","row"\n')
    assert textdata.load_agnews(cfg_for(hf_folder, data)).x_test.shape[0] == 13
    assert len(list(cache.iterdir())) == 7


# ----------------------------------------------------------------------------------- bad inputs


def test_missing_or_broken_model_folder_is_one_line(hf_folder, tmp_path):
    ds = types.SimpleNamespace(num_classes=4)
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(cfg_for(tmp_path / "nowhere"), ds)
    one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json") as e:
        build_hf(cfg_for(tmp_path / "empty"), ds)
    one_line(e)
    broken = tmp_path / "broken"
    shutil.copytree(hf_folder, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(cfg_for(broken), ds)
    one_line(e)
    bad_json = tmp_path / "bad-json"
    shutil.copytree(hf_folder, bad_json)
    (bad_json / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(cfg_for(bad_json), ds)
    one_line(e)
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(types.SimpleNamespace(model="hf", model_path=None, max_length=16, seed=0), ds)
    one_line(e)


def test_not_a_bert_layout_is_one_line(tmp_path):
    d = tmp_path / "gpt"
    conf = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    transformers.GPT2Model(conf).save_pretrained(str(d))
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(cfg_for(d), types.SimpleNamespace(num_classes=4))
    one_line(e)


def test_bad_agnews_folders_are_one_line(hf_folder, tmp_path, cache):
    data = write_agnews(tmp_path / "ag")
    (data / "test.csv").unlink()
    with pytest.raises(DataError, match="test.csv") as e:
        textdata.load_agnews(cfg_for(hf_folder, data))
    one_line(e)
    bad = write_agnews(tmp_path / "bad", bad_row=5)
    with pytest.raises(DataError, match=r"train\.csv: row 5") as e:
        textdata.load_agnews(cfg_for(hf_folder, bad))
    one_line(e)
    with pytest.raises(ConfigError, match="data_dir") as e:
        textdata.load_agnews(cfg_for(hf_folder, tmp_path / "none"))
    one_line(e)


@pytest.mark.parametrize("n", [0, -5])
def test_max_length_must_be_positive(hf_folder, tmp_path, cache, n):
    data = write_agnews(tmp_path / "ag")
    with pytest.raises(ConfigError, match="max_length") as e:
        textdata.load_agnews(cfg_for(hf_folder, data, max_length=n))
    one_line(e)
    with pytest.raises(ConfigError, match="max_length") as e:
        build_hf(cfg_for(hf_folder, max_length=n), types.SimpleNamespace(num_classes=4))
    one_line(e)
    with pytest.raises(ConfigError, match="max_length"):   # more than the model's 64 positions
        build_hf(cfg_for(hf_folder, max_length=65), types.SimpleNamespace(num_classes=4))


def test_fedlase_literal_edges_on_a_large_embedding_is_a_config_error():
    m = tiny_model()
    with pytest.raises(ConfigError, match="method_args") as e:   # word embedding 32000 > int(51936 / 64)
        FedLASE(m, LEVELS, edge_layers="first_last")
    one_line(e)
    assert isinstance(e.value, UserError)


# ----------------------------------------------------------------------------------- the packaged MiniLM


@pytest.fixture(scope="module")
def minilm():
    return build_minilm(types.SimpleNamespace(model="minilm", max_length=128, seed=0),
                        types.SimpleNamespace(num_classes=5))


def test_minilm_budget_by_hand_and_threshold_masks(minilm):
    P = params_of(minilm)
    names = minilm.budgeted_names()
    # a mean-pooled sentence encoder: its head is the mean of the tokens, so there is no pooler to budget
    assert minilm.head == "mean" and not minilm.has_pooler and minilm.edge_layers() == []
    assert len(names) == 2 + 6 * 12
    word, pos = 30522 * 384, 512 * 384
    layer = 4 * (384 * 384 + 384) + (1536 * 384 + 1536) + (384 * 1536 + 384)
    total = word + pos + 6 * layer
    assert sum(P[n].numel() for n in names) == total == 22_554_624
    # exact up to ties: pretrained float32 weights repeat magnitudes, and a threshold keeps every |w| >= tau
    # (FIARSE's rule), so a tie at tau keeps its copies too -- counted here, never more
    fiarse, fedlase = FIARSE(minilm, LEVELS), FedLASE(minilm, LEVELS)
    mags = torch.cat([P[n].abs().flatten() for n in names])
    for lvl in LEVELS:
        k = int(lvl * total)
        sub = fiarse.submodel(P, lvl, 1)
        tau = next(iter(sub.thresholds.values()))
        above, ties = int((mags > tau).sum()), int((mags == tau).sum())
        assert above < k <= above + ties == sub.kept(names, P), lvl
        print(f"\nMiniLM FIARSE {lvl:g}: budget {k}, kept {above + ties} ({above + ties - k} tied at tau)", end="")
        sub = fedlase.submodel(P, lvl, 1)
        extra = 0
        for n, kl in fedlase.layer_budgets(P, lvl).items():
            if 0 < kl < P[n].numel():
                a = P[n].abs()
                extra += int((a >= sub.thresholds[n]).sum()) - kl
                assert int((a > sub.thresholds[n]).sum()) < kl   # only ties at that layer's tau are extra
        assert sub.kept(names, P) == k + extra, lvl
    with pytest.raises(ConfigError):   # the literal rule: the word embedding alone exceeds a 1/64 budget
        FedLASE(minilm, LEVELS, edge_layers="first_last")
    sub = HeteroFL(minilm, LEVELS).submodel(P, 1 / 64, 1)   # 2 of 12 heads, 192 of 1536 units; embeddings whole
    kept = sub.kept(names, P) / total
    print(f"\nHeteroFL/FedRolex kept fraction of MiniLM's budget at 1/64: {kept:.3f}")
    assert 0.55 < kept < 0.65


def test_bbc_news_split_and_cache(cache, monkeypatch):
    ds = textdata.load_bbc_news(types.SimpleNamespace(model="minilm", max_length=64, seed=0))

    def no_tokenizing(*args):
        raise AssertionError("the second load tokenized again instead of reading the cache")
    monkeypatch.setattr(textdata, "tokenize", no_tokenizing)
    again = textdata.load_bbc_news(types.SimpleNamespace(model="minilm", max_length=64, seed=5))
    assert ds.num_classes == 5 and len(ds.y_train) + len(ds.y_test) == 2225
    assert ds.x_train.shape == (1781, 64) and ds.x_train.dtype == torch.int64
    assert ds.y_test.bincount().tolist() == [102, 77, 83, 102, 80]   # round(0.2 n) of each class
    assert torch.equal(ds.x_train, again.x_train) and torch.equal(ds.y_test, again.y_test)   # seed-independent



@pytest.mark.flower
@pytest.mark.parametrize("method", ["fedlase", "heterofl"])
def test_text_run_on_flower_simulation_equals_the_embedded_run(hf_folder, tmp_path, cache, monkeypatch, method):
    """2 rounds of a text run (a tiny BERT from a local folder, AG-News-format data) on Flower's Simulation
    Engine give the embedded engine's model bit for bit."""
    pytest.importorskip("flwr")
    from fedlase.api import make_config, run
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "nodes"))
    data = write_agnews(tmp_path / "ag", n_train=48, n_test=16)
    settings = dict(dataset="agnews", data_dir=str(data), model="hf", model_path=str(hf_folder), max_length=16,
                    method=method, system="{1,1/4}_{2,2}", participation=0.5, local_steps=2, batch_size=4,
                    optimizer="adamw", lr=1e-3, betas=[0.9, 0.95], rounds=2, eval_every=1, eval_batch_size=8,
                    threads=1, device="cpu", partition="iid")
    if method == "fedlase":
        settings["method_args"] = {"extract_all_layers": True}   # the tiny model's edge layers exceed 1/4
    run(make_config(**settings, out=str(tmp_path / "e")))
    run(make_config(**settings, engine="flower-sim", sim_actors=1, out=str(tmp_path / "f")))   # one actor: start-up
    emb = torch.load(tmp_path / "e" / "checkpoint.pt", weights_only=True)["params"]
    flo = torch.load(tmp_path / "f" / "checkpoint.pt", weights_only=True)["params"]
    assert emb.keys() == flo.keys() and all(torch.equal(emb[k], flo[k]) for k in emb)


def test_head_norm_run_resumes_bit_identically(hf_folder, tmp_path, cache):
    """head_norm=batch with static BN: BatchNorm over the pooled features, its statistics recomputed per level
    before evaluation with dropout off (nothing drawn), so a resumed run evaluates exactly as an uninterrupted
    one; and the statistics differ by level (each level normalises its own features)."""
    from fedlase.api import make_config, run
    from fedlase.engine import Experiment
    data = write_agnews(tmp_path / "ag", n_train=48, n_test=16)
    settings = dict(dataset="agnews", data_dir=str(data), model="hf", model_path=str(hf_folder), max_length=16,
                    method="fiarse", system="{1,1/4}_{2,2}", participation=1.0, local_steps=2, batch_size=4,
                    optimizer="adamw", lr=1e-3, betas=[0.9, 0.95], rounds=3, eval_every=1, eval_batch_size=8,
                    threads=1, device="cpu", partition="iid", head_norm="batch", bn="static", checkpoint_every=1)
    whole = run(make_config(**settings, out=str(tmp_path / "whole")))
    run(make_config(**{**settings, "rounds": 1}, out=str(tmp_path / "cut")))
    resumed = run(make_config(**settings, out=str(tmp_path / "cut")), resume=True)
    assert json.dumps(whole["final"]["levels"]) == json.dumps(resumed["final"]["levels"])
    exp = Experiment.from_config(make_config(**settings, out=str(tmp_path / "x")))
    assert isinstance(exp.model.norm, torch.nn.BatchNorm1d) and "norm.running_mean" in exp.buffers
    from fedlase.evaluate import recompute_bn_stats
    stats = []
    for lvl in exp.levels:
        w, b = exp.method.eval_submodel(exp.params, lvl, 1).model(exp.params, exp.buffers)
        stats.append(recompute_bn_stats(exp.model, w, b, exp.x_train, 8)["norm.running_mean"])
    assert not torch.allclose(stats[0], stats[1])


@pytest.mark.parametrize("method,args", [("fedlase", ["method_args.extract_all_layers=true"]), ("fiarse", [])])
def test_sparse_flops_of_a_transformer_are_positive_at_most_dense_and_fall_with_the_level(hf_folder, tmp_path, cache,
                                                                                           method, args):
    """MiniLM's layout (query, key and value reading one hidden state, residuals), whole word embeddings: the
    cost table's sparse FLOPs were negative from 1/16 down before each operation counted in one layer only."""
    from conftest import assert_sparse_flops_sound
    from fedlase.config import load_config
    from fedlase.cost import level_costs
    from fedlase.engine import Experiment
    data = write_agnews(tmp_path / "ag", n_train=24, n_test=8)
    cfg = load_config(None, ["dataset=agnews", f"data_dir={data}", "model=hf", f"model_path={hf_folder}",
                             "max_length=16", "system={1,1/4,1/16}_{1,1,1}", "participation=1", "local_steps=1",
                             "batch_size=4", "threads=1", "word_embeddings=whole", f"method={method}", *args,
                             f"out={tmp_path / 'run'}"])
    exp = Experiment.from_config(cfg)
    assert_sparse_flops_sound(level_costs(exp.model, exp.method, exp.trainer, exp.levels, exp.level_clients))


def test_head_norm_needs_a_text_model():
    from fedlase.api import make_config
    from fedlase.engine import Experiment
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(make_config(dataset="digits", model="cnn", head_norm="batch"))
    assert "head_norm" in one_line(e)


def test_a_model_folder_is_read_as_data(hf_folder, tmp_path):
    """A pytorch_model.bin carrying a payload (no safetensors beside it) is refused, the payload never runs:
    transformers is told weights_only=True (and trust_remote_code=False) in fedlase/models/transformer.py."""
    marker, folder = tmp_path / "ran", shutil.copytree(hf_folder, tmp_path / "bin-only")
    weights = transformers.BertModel.from_pretrained(str(folder)).state_dict()
    (folder / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    torch.save({**weights, "extra": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="model_path") as e:
        build_hf(cfg_for(folder), types.SimpleNamespace(num_classes=4))
    one_line(e)
    assert not marker.exists()
    torch.save(weights, folder / "pytorch_model.bin")   # the control: the same folder without the payload loads
    assert build_hf(cfg_for(folder), types.SimpleNamespace(num_classes=4)).head == "pooler"
