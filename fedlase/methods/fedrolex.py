"""FedRolex (Alam et al., NeurIPS 2022): HeteroFL's width slices with a window that rolls by one channel a
round (see docs/methods-structured.md).

Official convention (resnet_server.py, `algo=roll`, no `overlap`): with the server's round counter r starting
at 0, a layer of K output channels keeps torch.roll(arange(K), r % K)[:k], i.e. channels
(-r) mod K, ..., (-r + k - 1) mod K, the same window for every client of the round. fedlase counts rounds
from 1, so round n uses r = n - 1: the first round trains the first channels, like HeteroFL."""
from __future__ import annotations

import math

from ..registry import register_method
from ..slicing import group_sizes
from .heterofl import HeteroFL

ROLLS_CHECKED = 256   # windows of a traced model checked at build; a run that rolls further checks the rest as used


@register_method
class FedRolex(HeteroFL):
    """FedRolex: HeteroFL's width slices, the window rolling by one channel per round.

    A level is evaluated with the window of the round just trained (the base `eval_submodel`). The official
    code only evaluates the full global model; a level's latest window is the slice its clients hold now and
    was trained as one network, whereas a fixed window (e.g. the first channels) was trained together only in
    the rare rounds where every layer's window sat at its start (layers of different widths roll out of step)."""
    name = "fedrolex"

    def roll(self, round: int) -> int:
        return round - 1

    def rolls(self, params) -> range:
        """Every distinct window of a run: a group of K channels (in units) repeats its windows every K rolls, so
        the model's every K rolls together."""
        units = self.facts.group_units()
        sizes = group_sizes(self.facts.channel_groups(), params)
        return range(min(ROLLS_CHECKED, math.lcm(*(k // units.get(g, 1) for g, k in sizes.items()))))
