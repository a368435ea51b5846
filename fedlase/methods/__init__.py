"""The built-in methods, registered in fedlase.registry.METHODS (a method of your own: see docs/library.md)."""
from __future__ import annotations

from torch import nn

from ..registry import METHODS, register_method
from .base import Method, Option, ThresholdMethod
from .depthfl import DepthFL
from .fedavg import FedAvg, FedAvgSmall
from .feddse import FedDSE
from .fedlase import FedLASE
from .fedlmt import FedLMT, PFedLMT
from .fedrolex import FedRolex
from .fiarse import FIARSE
from .fjord import FjORD
from .heterofl import HeteroFL

for _cls in (FedLASE, FIARSE, HeteroFL, FedRolex, FedAvg, FedAvgSmall, FjORD, DepthFL, FedDSE, FedLMT, PFedLMT):
    if _cls.name not in METHODS:
        register_method(_cls)


def build_method(name: str, model: nn.Module, options: dict, system) -> Method:
    """The registered method `name` on `model`; `system`: a fedlase.levels.System or level fractions."""
    return METHODS.get(name)(model, system, **options)


def describe_methods() -> str:
    lines = []
    for name, cls in METHODS.items():
        lines.append(f"{name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
        for key, opt in cls.options.items():
            lines.append(f"    method_args.{key} [default: {opt.default}]: {opt.help}")
    return "\n".join(lines)


__all__ = ["METHODS", "Method", "Option", "ThresholdMethod", "build_method", "describe_methods"]
