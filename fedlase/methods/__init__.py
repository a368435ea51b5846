"""The built-in methods, registered in fedlase.registry.METHODS (a method of your own: see docs/library.md)."""
from __future__ import annotations

from torch import nn

from ..registry import METHODS
from .base import Method, Option, ThresholdMethod

# Each method registers itself where it is defined (`@register_method`); importing them here, in this order,
# gives the registry its order (the README table's and `fedlase methods`'). A module not named here is still
# registered by fedlase.catalog, after these.
# isort: off
from .fedlase import FedLASE
from .fiarse import FIARSE
from .heterofl import HeteroFL
from .fedrolex import FedRolex
from .fedavg import FedAvg, FedAvgSmall
from .fjord import FjORD
from .depthfl import DepthFL
from .feddse import FedDSE
from .fedlmt import FedLMT, PFedLMT
from .fedlase_width import FedLASEWidth
from .recipfl import RecipFL
# isort: on


def build_method(name: str, model: nn.Module, options: dict, system) -> Method:
    """The registered method `name` on `model`; `system`: a fedlase.levels.System or level fractions."""
    return METHODS.get(name)(model, system, **options)


def describe_methods() -> str:
    """`fedlase methods`: every registered method, its docstring's first sentence (as README.md's table), its
    coverage and options."""
    from ..util import first_sentence
    lines = []
    for name, cls in METHODS.items():
        lines.append(f"{name}: {first_sentence(cls.__doc__)}")
        lines.append(f"    coverage (when the config leaves it unset): {cls.coverage}")
        for key, opt in cls.options.items():
            lines.append(f"    method_args.{key} [default: {opt.default}]: {opt.help}")
    return "\n".join(lines)


__all__ = ["METHODS", "DepthFL", "FIARSE", "FedAvg", "FedAvgSmall", "FedDSE", "FedLASE", "FedLASEWidth", "FedLMT",
           "FedRolex", "FjORD", "HeteroFL", "Method", "Option", "PFedLMT", "ThresholdMethod", "build_method",
           "describe_methods"]
