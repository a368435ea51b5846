"""FedRolex (Alam et al., NeurIPS 2022): HeteroFL's width slices with a window that rolls by one channel a
round (see docs/methods-structured.md).

Official convention (resnet_server.py, `algo=roll`, no `overlap`): with the server's round counter r starting
at 0, a layer of K output channels keeps torch.roll(arange(K), r % K)[:k], i.e. channels
(-r) mod K, ..., (-r + k - 1) mod K, the same window for every client of the round. fedlase counts rounds
from 1, so round n uses r = n - 1: the first round trains the first channels, like HeteroFL."""
from __future__ import annotations

from ..registry import register_method
from ..slicing import group_sizes
from .heterofl import HeteroFL

ROLLS_CHECKED = 64   # rolls of a traced model checked at build (4 forwards each); the rest when a round first uses them


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
        """The rolls that show every group's every window: a group of K channels (in units) repeats its windows
        every K rolls, so as many rolls as the largest group has (at most ROLLS_CHECKED)."""
        units = self.facts.group_units()
        sizes = group_sizes(self.facts.channel_groups(), params)
        return range(min(ROLLS_CHECKED, max(k // units.get(g, 1) for g, k in sizes.items())))
