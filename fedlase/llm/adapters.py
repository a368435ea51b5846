"""LoRA adapters as a run's trainable set (the `lora` key; docs/llm.md, "Adapters").

`attach` puts peft's LoRA adapters (`LoraConfig`, `inject_adapter_in_model`) on the Hugging Face transformer
inside a text model and freezes it: the base weights are held once, by the module, with `requires_grad` False, so
the run's state, its payloads and its checkpoints hold only the trainable tensors (the adapters, and a task head
outside the transformer), local training computes gradients and optimizer state for those only
(fedlase/train.py, `trainable`), and a checkpoint names the base by a hash of it (fedlase/model_facts.py,
`frozen_fingerprint`).

The adapted model (`AdaptedModel`) declares what methods read of it: its budget is the adapters' tensors, and the
rank components of each adapter (the rows of its A, the columns of its B) are one channel group, so a width
method (HeteroFL, FedRolex, FjORD) cuts nested ranks and averages each component over the clients that hold it,
and a threshold method (FIARSE, FedLASE) keeps the adapters' largest coordinates, as they do on channels. A level
of rank k trains the first k components of the rank-r adapter, with the same alpha / r scale at every level (so a
rank-k slice is exactly the rank-r adapter with its other components zero)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["AdaptedModel", "Adapter", "attach", "default_targets", "init_a"]

# the attention and MLP projections of the layouts fedlase reads (an encoder's, a Llama/Qwen2 decoder's, GPT-2's)
_BERT = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GPT2 = ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]
DEFAULT_TARGETS = {"bert": _BERT, "roberta": _BERT, "xlm-roberta": _BERT, "camembert": _BERT, "llama": _LLAMA,
                   "qwen2": _LLAMA, "mistral": _LLAMA, "gpt2": _GPT2}


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("lora", "LoRA adapters need peft: pip install 'fedlase[llm]'") from None
    return peft


def transformer_of(model: nn.Module) -> tuple[str, nn.Module]:
    """(its path, the module) of the Hugging Face transformer inside a text model (the first PreTrainedModel)."""
    from transformers import PreTrainedModel
    for name, mod in model.named_modules():
        if isinstance(mod, PreTrainedModel):
            return name, mod
    raise ConfigError("lora", f"model {type(model).__name__} holds no Hugging Face transformer to put adapters on")


def default_targets(hf: nn.Module) -> list[str]:
    kind = getattr(hf.config, "model_type", "")
    if kind not in DEFAULT_TARGETS:
        raise ConfigError("lora.targets", f"no default targets for model type {kind!r}; name them, e.g. "
                          "lora.targets=[q_proj,v_proj]")
    return DEFAULT_TARGETS[kind]


def _matches(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)   # peft's rule for a list of names


def _dims(mod: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a module LoRA can adapt here: a Linear, or GPT-2's Conv1D (weight stored in x out)."""
    if isinstance(mod, nn.Linear):
        return mod.in_features, mod.out_features
    if type(mod).__name__ == "Conv1D":
        return tuple(mod.weight.shape)
    return None


class Adapter:
    """One adapted module: its A (r x in) and B (out x r) parameter names in the adapted model, the frozen base
    weight they add to, and whether that weight is stored (in x out) (GPT-2's Conv1D)."""

    def __init__(self, path: str, a: str, b: str, base: str, transposed: bool):
        self.path, self.a, self.b, self.base, self.transposed = path, a, b, base, transposed

    def group(self) -> str:
        return f"{self.path}.rank"


class AdaptedModel(nn.Module):
    """A text model with LoRA adapters on its transformer's targets, the transformer frozen (see the module
    docstring). `ranks`: each level's rank (by level index), `scaling`: alpha / r."""

    sliceable = True   # a rank slice is a smaller A and B that nn.Linear takes as they are
    scaler_default = False

    def __init__(self, model: nn.Module, adapters: list[Adapter], r: int, scaling: float, ranks: list[int]):
        super().__init__()
        self.model = model
        self.adapters, self.r, self.scaling, self.ranks = adapters, r, scaling, list(ranks)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def budgeted_names(self) -> list[str]:
        """The adapters' tensors, A then B of each adapted module in forward order: what a level's budget counts."""
        return [n for a in self.adapters for n in (a.a, a.b)]

    def edge_layers(self) -> list[str]:
        return []

    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Each adapter's rank components as one group: A's rows (its output dim), B's columns (its input dim)."""
        g: dict[str, tuple[str | None, str | None]] = {}
        for a in self.adapters:
            g[a.a] = (a.group(), None)
            g[a.b] = (None, a.group())
        return g

    def group_units(self) -> dict[str, int]:
        return {}

    def level_rank(self, index: int) -> int:
        """The rank of the level of this index (largest level first): `lora.ranks`."""
        return self.ranks[index]


def attach(model: nn.Module, lora: dict, seed: int) -> AdaptedModel:
    """`model` with LoRA adapters on its transformer (`lora`: the checked `lora` mapping, fedlase/lora_config.py),
    the transformer frozen, a head outside it left trainable. The adapters' initial A is drawn from `seed` (B is
    zero, as peft's), leaving torch's global generator as it was. One-line ConfigErrors for a target the model does
    not have or a rank above a target's dimensions."""
    peft = _peft()
    path, hf = transformer_of(model)
    targets = lora["targets"] or default_targets(hf)
    found: dict[str, tuple[int, int]] = {}
    for name, mod in hf.named_modules():
        if any(_matches(name, t) for t in targets) and (dims := _dims(mod)) is not None:
            found[name] = dims
    for t in targets:
        if not any(_matches(name, t) for name in found):
            raise ConfigError("lora.targets", f"{t}: the model has no linear module of that name (its "
                              f"{type(hf).__name__} has e.g. {', '.join(_linear_names(hf)[:6])})")
    r = lora["r"]
    small = min(found.items(), key=lambda kv: min(kv[1]))
    if r > min(small[1]):
        raise ConfigError("lora.r", f"{r} is above the dimensions of target {small[0]} ({small[1][0]} in, "
                          f"{small[1][1]} out); a rank is at most min(in, out)")
    config = peft.LoraConfig(r=r, lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=targets,
                             bias="none", fan_in_fan_out=getattr(hf.config, "model_type", "") == "gpt2")
    with torch.random.fork_rng(devices=[]):   # peft draws A from the global generator: seed it, then restore it
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, hf)
    prefix = f"model.{path}." if path else "model."
    adapters = []
    for name, mod in hf.named_modules():
        if name in found and hasattr(mod, "lora_A"):
            transposed = type(mod.base_layer).__name__ == "Conv1D"
            adapters.append(Adapter(prefix + name, f"{prefix}{name}.lora_A.default.weight",
                                    f"{prefix}{name}.lora_B.default.weight", f"{prefix}{name}.base_layer.weight",
                                    transposed))
    return AdaptedModel(model, adapters, r, lora["alpha"] / r, lora["ranks"])


def _linear_names(hf: nn.Module) -> list[str]:
    seen = []
    for name, mod in hf.named_modules():
        last = name.rsplit(".", 1)[-1]
        if _dims(mod) is not None and last not in seen and not last.isdigit():
            seen.append(last)
    return seen


def init_a(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """A fresh A (r x in) as peft draws it (kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), from
    `generator`."""
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


from ..registry import register_adapters  # noqa: E402

register_adapters("lora", attach)
