"""The method registry: the only place that knows every method by name."""
from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .base import Method, Option
from .fedavg import FedAvg, FedAvgSmall
from .fedlase import FedLASE
from .fedrolex import FedRolex
from .fiarse import FIARSE
from .heterofl import HeteroFL

METHODS: dict[str, type[Method]] = {m.name: m for m in (FedLASE, FIARSE, HeteroFL, FedRolex, FedAvg, FedAvgSmall)}


def build_method(name: str, model: nn.Module, options: dict, levels: list[float]) -> Method:
    if name not in METHODS:
        raise ConfigError("method", f"{name!r} is not one of {', '.join(METHODS)}")
    return METHODS[name](model, levels, **options)


def describe_methods() -> str:
    lines = []
    for name, cls in METHODS.items():
        lines.append(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for key, opt in cls.options.items():
            lines.append(f"    method_args.{key} [default: {opt.default}]: {opt.help}")
    return "\n".join(lines)


__all__ = ["METHODS", "Method", "Option", "build_method", "describe_methods"]
