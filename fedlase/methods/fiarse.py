"""FIARSE (Wu et al., 2024): one global magnitude threshold over all conv and linear parameters.

Follows the official code's semantics (see docs/methods.md): k = int(level * maskable count), tau = the k-th
largest |w|; BatchNorm outside the budget and trained whole; the client keeps tau and re-evaluates its mask
at every forward; aggregation averages each coordinate over the clients that trained it."""
from __future__ import annotations

import torch

from ..masks import Submodel, kth_largest
from .base import Method, Option


class FIARSE(Method):
    """FIARSE: one global magnitude threshold over all conv and linear parameters."""
    name = "fiarse"
    options = {
        "ste": Option("official", "gradient through the threshold mask: official (g*mask, what the official "
                      "code computes), paper (the paper's straight-through rule), fixed (mask fixed for the round)",
                      choices=("official", "paper", "fixed")),
        "overlap": Option(True, "true: average each coordinate over the clients that trained it; "
                          "false: divide by the number of clients", choices=(True, False)),
    }

    @property
    def aggregation(self) -> str:
        return "coverage" if self.args["overlap"] else "mean"

    def submodel(self, params, level, round):
        k = self.budget(params, level)
        if k < 1:
            raise ValueError(f"level {level} leaves no parameter of the model")
        scores = torch.cat([params[n].detach().abs().flatten() for n in self.maskable])
        tau = kth_largest(scores, k)
        masks = {n: params[n].detach().abs() >= tau for n in self.maskable}
        if self.args["ste"] == "fixed":
            return Submodel(masks)
        return Submodel(masks, thresholds={n: tau for n in self.maskable}, ste=self.args["ste"])
