"""Width slices for structured methods (HeteroFL, FedRolex, FedAvg on the small model), as masks.

A model declares, per parameter, which channel group its output and input dimensions belong to
(`channel_groups()`; derived by tracing where it declares none: the run's `ModelFacts`, fedlase/model_facts.py,
from which everything here reads them); a slice keeps a window of ceil(rate * K) channels of every group of size
K, so a conv's kept input channels are exactly the kept output channels of the layer that feeds it."""
from __future__ import annotations

import logging

import torch

from .levels import level_name, width_rate, window_size  # noqa: F401  (width_rate: the methods import it here)
from .masks import Submodel

log = logging.getLogger("fedlase")


def channel_window(size: int, rate: float, roll: int = 0) -> torch.Tensor:
    """Indices of the kept channels: ceil(rate * size) of them starting at (-roll) mod size, wrapping."""
    return (torch.arange(window_size(size, rate)) - roll) % size


def group_sizes(groups: dict, params: dict[str, torch.Tensor]) -> dict[str, int]:
    """Channel group -> its channel count, read off the weights that produce or consume it (`groups`:
    the model's channel groups, weight name -> (output group, input group))."""
    sizes: dict[str, int] = {}
    for name, (out_g, in_g) in groups.items():
        for g, dim in ((out_g, 0), (in_g, 1)):
            if g is not None:
                sizes.setdefault(g, params[name].shape[dim])
    return sizes


def held(groups: dict, sizes: dict[str, int], params: dict[str, torch.Tensor], names: list[str],
         counts: dict[str, int], uses: dict[str, int] | None = None) -> int:
    """Coordinates of the parameters `names` (a method's budgeted ones) a width submodel holds when group g keeps
    counts[g] of its sizes[g] channels (a parameter's size scales with its output and its input width); with
    `uses`, each coordinate weighted by its uses in one forward pass (the forward work)."""
    total = 0
    for n in names:
        size = params[n].numel()
        for g in groups.get(n, (None, None)):
            if g is not None:
                size = size // sizes[g] * counts[g]
        total += size * (uses.get(n, 0) if uses is not None else 1)
    return total


def state_widths(method, rate_of, units: bool = True) -> dict[str, int]:
    """The run's start line for a method that defines a level by its width (HeteroFL's rate sqrt(level), FjORD's,
    FedDSE's, FedAvg-small's): the budgeted parameters each level really holds. Where layers no width cut
    reaches (the classes, the image channels, a flatten into a linear layer) are much of the model, a level holds
    far more than its fraction; a level more than 10% above its budget (a width rounding gives the papers' CNN a
    few percent), or a group cut to a single channel, makes the line a warning.
    `rate_of(level)`: the level's width rate; `units`: whether the window counts in the model's `group_units()`.
    Returns level name -> parameters held."""
    facts, params = method.facts, {n: p.detach() for n, p in method.model.named_parameters()}
    groups = facts.channel_groups(method.name)
    sizes = group_sizes(groups, params)
    unit = facts.group_units() if units else {}
    total = sum(params[n].numel() for n in method.maskable)
    holds, parts, single, over = {}, [], [], False
    if not total:   # nothing budgeted: nothing to state
        return holds
    for lvl in method.system.levels:
        rate = rate_of(lvl)
        if rate >= 1:
            continue
        counts = {g: unit.get(g, 1) * window_size(k // unit.get(g, 1), rate) for g, k in sizes.items()}
        kept = holds[lvl.name] = held(groups, sizes, params, method.maskable, counts)
        budget = method.budget(params, lvl)
        above = kept > budget
        over |= kept > 1.1 * budget
        note = f", above its {float(lvl) * 100:.3g}%" if above else ""
        parts.append(f"{lvl.name} {kept:,} ({100 * kept / total:.3g}%{note})")
        single += [f"{g} (1 of {k}) at {lvl.name}" for g, k in sizes.items() if counts[g] == 1 < k]
    if parts:
        line = (f"{method.name} defines a level by its width; of the {total:,} budgeted parameters a level holds: "
                + ", ".join(parts) + ("; cut to a single channel: " + ", ".join(single[:4]) if single else ""))
        log.log(logging.WARNING if over or single else logging.INFO, "%s", line)
    return holds


def group_keep(facts, groups: dict, params: dict[str, torch.Tensor], rate: float,
               roll: int = 0) -> dict[str, torch.Tensor]:
    """Channel group -> bool vector of its kept channels at `rate`, the window rolled by `roll` channels (0: the
    first channels); `groups` is `facts.channel_groups()` (`facts`: the model's ModelFacts).

    A model may declare `group_units()` -> {group: unit size}: such a group is cut in whole units of that
    many consecutive channels (a transformer's attention heads: unit = head size), the window counting and
    rolling in units. Groups it does not name have unit 1 (single channels)."""
    units = facts.group_units()
    sizes = group_sizes(groups, params)
    keep = {g: torch.zeros(k, dtype=torch.bool) for g, k in sizes.items()}
    for g, k in sizes.items():
        u = units.get(g, 1)
        if u == 1:
            keep[g][channel_window(k, rate, roll)] = True
        else:   # whole units: unit j covers channels j*u .. j*u + u - 1
            kept_units = channel_window(k // u, rate, roll)
            keep[g][(kept_units[:, None] * u + torch.arange(u)).flatten()] = True
    return keep


def _masks(groups, params, keep) -> dict[str, torch.Tensor]:
    masks = {}
    for name, (out_g, in_g) in groups.items():
        p = params[name]
        if out_g is None and in_g is None:
            continue
        m = torch.ones(p.shape, dtype=torch.bool, device=p.device)
        if out_g is not None:
            m &= keep[out_g].to(p.device).view(-1, *([1] * (p.dim() - 1)))
        if in_g is not None:
            m &= keep[in_g].to(p.device).view(1, -1, *([1] * (p.dim() - 2)))
        masks[name] = m
    return masks


def width_slices(facts, params: dict[str, torch.Tensor], rate: float, roll: int = 0,
                 keep: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(masks, slices) of the width slice: the masks of the kept channels (`group_keep`), and per sliced parameter
    (and BN running statistic of a sliced BN) the kept indices of its output and input dims, for
    `Submodel.slices`. Indices are sorted:
    a permutation applied to every tensor of a group alike leaves the network's function unchanged.

    `facts`: the model's ModelFacts. Slices only for a sliceable model (`sliceable = True`, declared or found by
    the trace: its forward takes every shape from the tensors, e.g. global pooling before the classifier);
    otherwise no slices and the masks train. `keep`: the kept channels of every group (bool vectors, FedDSE's own
    choice) in place of the window. A model whose groups were traced is checked at every set of kept channels
    the first time it is used (`ModelFacts.check_kept`): a one-line ConfigError if it moves channels there."""
    groups = facts.channel_groups()
    keep = group_keep(facts, groups, params, rate, roll) if keep is None else keep
    facts.check_kept(keep)   # a traced model: its channels stay in place with these kept (once per set)
    masks = _masks(groups, params, keep)
    if not facts.sliceable():
        return masks, {}
    device = next(iter(params.values())).device
    index = {g: torch.nonzero(k).flatten().to(device) for g, k in keep.items()}   # sorted kept indices
    buffers = {n for n, _ in facts.model.named_buffers()}
    slices: dict[str, tuple] = {}
    for name, (out_g, in_g) in groups.items():
        if name not in masks:
            continue
        dims = [out_g] + ([in_g] if masks[name].dim() > 1 else [])
        idx = [None if g is None else index[g] for g in dims]
        while idx and idx[-1] is None:
            idx.pop()
        slices[name] = tuple(idx)
        prefix = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and masks[name].dim() == 1:   # a BN's weight: its running statistics follow it
            for stat in ("running_mean", "running_var"):
                if f"{prefix}.{stat}" in buffers:
                    slices[f"{prefix}.{stat}"] = tuple(idx)
    return masks, slices


class WidthSlicer:
    """The width-slice submodels of one model (HeteroFL, FedRolex, FedAvg on the small model): the one place
    they are built. A slice depends on the rate, the window's roll and the weights' device, never on the
    weights' values, so the last submodel built per level is reused while those hold: HeteroFL and FedAvg-small
    build each level's submodel once per run (and its `inner()` once), FedRolex, whose window moves every
    round, rebuilds. Memory: one submodel per level.

    `scaled`: the parameters HeteroFL's scaler multiplies in training (the model's `scaler_names()`); a slice
    at rate r carries them as `Submodel.scales` of 1/r."""

    def __init__(self, facts, scaled: list[str] = (), method: str = "width slices"):
        facts.channel_groups(method)   # traced now where the model declares none, or its one-line error
        self.facts, self.scaled, self.method = facts, list(scaled), method
        self._last: dict = {}

    def check(self, params: dict[str, torch.Tensor], levels, rolls) -> None:
        """Check a traced model at every window of `levels` rolled by each of `rolls(params)` now, at build,
        rather than the first time a round uses it (`ModelFacts.check_kept`; nothing to do for a model that
        declares its groups)."""
        if not self.facts.traced():
            return
        groups = self.facts.channel_groups()
        for level in levels:
            rate = width_rate(float(level))
            if rate < 1:
                for roll in rolls(params):
                    self.facts.check_kept(group_keep(self.facts, groups, params, rate, roll), self.method)

    def __call__(self, params: dict[str, torch.Tensor], level, roll: int = 0) -> Submodel:
        """The submodel of `level` (a fraction of the parameters: width rate sqrt(level)), window rolled by
        `roll`; the whole model at level 1."""
        rate = width_rate(float(level))
        if rate >= 1:
            return Submodel()   # the whole model: no masks to apply or count
        key = (rate, roll, next(iter(params.values())).device)
        name = level_name(level)   # an exact fraction's name, never a float key
        hit = self._last.get(name)
        if hit is None or hit[0] != key:
            masks, slices = width_slices(self.facts, params, rate, roll)
            hit = self._last[name] = (key, Submodel(masks, slices=slices,
                                                    scales={n: 1.0 / rate for n in self.scaled}))
        return hit[1]
