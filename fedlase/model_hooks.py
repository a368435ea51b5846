"""The optional hooks a model may declare, in one place: `ModelHooks`, and the one way fedlase reads them, `hook`.

A model is any `torch.nn.Module` whose forward returns logits; every hook below is optional, and fedlase falls
back to what it can find out itself where one is absent (docs/library.md, "The model protocol"). No fedlase module
probes a model with hasattr/getattr for a hook: it asks `hook(model, name)`, which refuses a name not declared
here, so a misspelt hook is an error instead of a hook silently taken as absent (tests/test_structure.py checks
both). This module imports nothing of fedlase's, so the lowest modules (masks, layers) may read it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["HOOKS", "ModelHooks", "hook"]


class ModelHooks(Protocol):
    """Every optional hook of a model, with what fedlase does with it. A model declares any subset."""

    # the resource budget and FedLASE
    def budgeted_names(self) -> list[str]:
        """The parameter names inside the budget, in forward order (fedlase.masks.maskable_names; default: the
        weights and biases of every conv and linear layer)."""

    def edge_layers(self) -> list[str]:
        """The budgeted weights FedLASE keeps whole with `method_args.edge_layers=model` (default: the first and
        last budgeted weights)."""

    # width slicing (fedlase/model_facts.py, fedlase/slicing.py)
    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Parameter name -> (group of dim 0, group of dim 1), the channels cut together; traced when absent."""

    def group_units(self) -> dict[str, int]:
        """Group -> channels per unit, for groups cut in whole units (a transformer's heads)."""

    sliceable: bool
    """True: a width slice trains as the physically smaller tensors; else as masks (traced when absent)."""

    # HeteroFL and FedRolex's training-time scaler
    def scaler_names(self) -> list[str]:
        """The parameters of the layers whose outputs the scaler multiplies by 1/rate."""

    scaler_default: bool
    """Whether the scaler is on when `method_args.scaler` is unset (absent: on, if `scaler_names` is declared)."""

    # cost and analyses (fedlase/layers.py)
    input_shape: tuple[int, ...]
    """One sample's shape, for a zero batch to measure how often a forward applies each weight."""

    # DepthFL's exits (fedlase/models/exits.py, fedlase/methods/depthfl.py)
    def stages(self) -> list:
        """The stage callables in forward order; a depth-d network runs the first d."""

    def stage_widths(self) -> list[int]:
        """Each stage's output channels, the widths of the exit heads."""

    def stage_prefixes(self) -> list[list[str]]:
        """Per stage, the name prefixes of its parameters and buffers."""

    def final_exit(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own classifier on the last stage's output."""

    def final_prefixes(self) -> list[str]:
        """The name prefixes of the model's own classifier."""

    def norm(self, channels: int) -> nn.Module:
        """A BatchNorm layer of the model's own mode, for the exit heads."""

    num_classes: int
    """The classes the exit heads predict."""

    exit_heads: nn.ModuleList | None
    """The exits DepthFL attached (fedlase.models.exits.attach_exits); None or absent: none yet."""

    # LoRA's adapter methods (fedlase/llm/lora_methods.py)
    def level_rank(self, index: int) -> int:
        """The adapter rank of the `index`-th resource level."""


HOOKS = frozenset(n for n in (*vars(ModelHooks), *ModelHooks.__annotations__)
                  if not n.startswith("_") and n not in vars(Protocol))


def hook(model: Any, name: str) -> Any:
    """The model's hook `name` (a bound method or the attribute's value), or None where the model declares none.
    A `name` not declared in ModelHooks is a ValueError: a typo must not read as a hook the model lacks."""
    if name not in HOOKS:
        raise ValueError(f"{name!r} is not a model hook; the hooks are declared in fedlase/model_hooks.py: "
                         f"{', '.join(sorted(HOOKS))}")
    return getattr(model, name, None)
