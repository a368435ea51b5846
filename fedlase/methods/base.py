"""What a method is: an object that turns (global parameters, level, round) into a Submodel.

Methods never train and never aggregate; they only decide masks. Options are declared once as `Option`s,
validated at construction with errors that name `method_args.<key>` and the allowed values."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from ..masks import Submodel, maskable_names


@dataclass(frozen=True)
class Option:
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None   # extra rule, described in help


def _same_kind(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default))


class Method:
    """Base class. Subclasses set `name`, `options` and implement `submodel`."""
    name: ClassVar[str] = ""
    options: ClassVar[dict[str, Option]] = {}

    def __init__(self, model: nn.Module, levels: list[float] = (1.0,), **options):
        self.model = model
        self.levels = sorted(levels)   # the system's resource levels, ascending
        self.maskable = maskable_names(model)
        for key, value in options.items():
            if key not in self.options:
                known = ", ".join(self.options) or "none"
                raise ConfigError(f"method_args.{key}", f"unknown option for {self.name}; its options: {known}")
            opt = self.options[key]
            if not _same_kind(value, opt.default):
                raise ConfigError(f"method_args.{key}", f"expected a value like {opt.default!r}, got {value!r}")
            if opt.choices is not None and value not in opt.choices:
                allowed = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in opt.choices)
                raise ConfigError(f"method_args.{key}", f"{value!r} is not one of {allowed}")
            if opt.check is not None and not opt.check(value):
                raise ConfigError(f"method_args.{key}", f"{value!r} is not allowed: {opt.help}")
        self.args = {k: options.get(k, o.default) for k, o in self.options.items()}

    @property
    def aggregation(self) -> str:
        """'coverage' (per-coordinate mean over the clients that trained it) or 'mean' (divide by |A|)."""
        return "coverage"

    def submodel(self, params: dict[str, torch.Tensor], level: float, round: int) -> Submodel:
        """The submodel of the given resource level at this round. All clients of a level share it."""
        raise NotImplementedError

    def eval_submodel(self, params: dict[str, torch.Tensor], level: float, round: int) -> Submodel:
        """The submodel a level is evaluated with after `round`; the training submodel unless overridden."""
        return self.submodel(params, level, round)

    def budget(self, params: dict[str, torch.Tensor], level: float) -> int:
        """Maskable coordinates a client of this level may hold: int(level * maskable count), as FIARSE."""
        return int(level * sum(params[n].numel() for n in self.maskable))

    # Methods with state across rounds override these; the engine checkpoints them.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
