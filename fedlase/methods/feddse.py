"""FedDSE (WWW 2024): distribution-aware submodel extraction. Each client extracts, from the current global
model, the neurons most activated on its own data, within its budget (see docs/methods.md, "FedDSE").

The paper's code is not public and only its abstract could be read, so everything below past "most activated
on its own data, within its budget" is this implementation's reading; each choice that could matter is an
option. A neuron is a channel of a channel group (the groups width slices cut: a residual stage is one group).
A client of level l keeps, in every group of size K, the ceil(sqrt(l) K) channels that score highest on its
first `samples` training samples of the round under the global model (`score`), ties to the lower index; the
image channels and the classes are never cut. Its kept channels train as a smaller dense model (as a
width slice, where the model can slice; else as masks). The server knows a client's mask from its update's
support: each coordinate is averaged over the clients whose delta there is nonzero (coverage `nonzero`). A level
is evaluated with the channels its clients selected most often in the latest round the server took their replies
(`eval`): each client sends its choice in its reply, beside its delta (a bool vector per group, `CHOICE`), and
the server step counts those of the replies it accepted (`server_update`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..layers import BatchNorm
from ..masks import Submodel
from ..registry import register_method
from ..slicing import group_keep, group_sizes, state_widths, width_rate, width_slices
from .base import LocalObjective, Method, Option


def top_channels(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Bool vector: the `keep` highest scores, ties to the lower index."""
    order = torch.sort(-score, stable=True).indices[:keep]
    out = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    out[order] = True
    return out


CHOICE = "feddse.keep."   # a reply's tensor of the client's choice in group g is CHOICE + g (no parameter's name)


class ActivationExtraction(LocalObjective):
    """At the client's start: score every channel on its data with the global model, keep the best of each
    group; the rest of training is the plain cross-entropy on that mask. The client's reply carries its choice
    beside its delta (`finish`)."""

    def __init__(self, method: FedDSE, level, round: int):
        self.method, self.level, self.round = method, level, round
        self.chosen: dict[str, torch.Tensor] | None = None   # the choice of the client training now, until it replies

    def start(self, model, sub, params, buffers, x, batches):
        m = self.method
        idx = torch.cat(list(batches))[: m.args["samples"]]
        scores = m.channel_scores(params, buffers, x[idx])
        rate = width_rate(float(self.level))
        self.chosen = {g: top_channels(s, min(s.numel(), max(1, math.ceil(rate * s.numel() - 1e-9))))
                       for g, s in scores.items()}
        return m.own_slice(params, self.chosen)

    def finish(self, client, params, sub, delta):
        """The reply: the delta and the channels this client chose (start and finish run in turn for one client:
        fedlase.client.ClientTrainer.update)."""
        chosen, self.chosen = self.chosen, None
        if chosen is None:
            raise RuntimeError("FedDSE: a client replied without choosing its channels (finish before start)")
        return {**delta, **{CHOICE + g: k for g, k in chosen.items()}}


@register_method
class FedDSE(Method):
    """FedDSE: each client keeps, per layer, the channels most activated on its own data (within its budget)."""
    name = "feddse"
    # its own LocalObjective: not vmapped (no batched clients); a Flower node rebuilds it from the level and round,
    # and each client's choice travels in its reply (`own_reply`)
    runs_on = ("embedded", "flower-sim", "flower-deploy")
    coverage = "nonzero"   # the client's mask is known from its update's support
    masks_from_data = True   # a client picks its channels on its own data
    options = {
        "score": Option("mean", "a channel's score on the client's data (a guess): mean (its mean activation "
                        "after BN and ReLU) or rate (how often that activation is positive)", choices=("mean", "rate")),
        "samples": Option(128, "how many of the client's samples (its first batches of the round) score the "
                          "channels (a guess)", low=1),
        "eval": Option("selected", "the channels a level is evaluated with (a guess): selected (those its clients "
                       "selected most often in the latest round it trained) or first (the first channels, "
                       "HeteroFL's slice)", choices=("selected", "first")),
    }

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.groups = self.facts.channel_groups("feddse")
        # which BN layer scores which group: the group of its weight (a residual stage: the mean of its BNs)
        self.scored = {name: self.groups[f"{name}.weight"][0] for name, mod in model.named_modules()
                       if isinstance(mod, BatchNorm) and f"{name}.weight" in self.groups}
        self.counts: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}   # level index -> (round, selections)
        self.sizes = group_sizes(self.groups, dict(model.named_parameters()))   # group -> channels
        state_widths(self, lambda lvl: width_rate(float(lvl)), units=False)   # single channels, not units

    def submodel(self, params, level, round):
        if float(level) >= 1:
            return Submodel()   # the whole model: nothing to select
        return Submodel(local=ActivationExtraction(self, level, round))

    @torch.no_grad()
    def channel_scores(self, params, buffers, x) -> dict[str, torch.Tensor]:
        """Group -> per-channel score of the global model on x (batch statistics in BN, as in training)."""
        sums: dict[str, torch.Tensor] = {}
        seen: dict[str, int] = {}
        modules = dict(self.model.named_modules())

        def hook(name):
            def record(_mod, _inp, out):
                a = F.relu(out).transpose(0, 1).flatten(1)                 # (channels, samples x positions)
                s = a.mean(1) if self.args["score"] == "mean" else (a > 0).float().mean(1)
                g = self.scored[name]
                sums[g] = sums[g] + s if g in sums else s
                seen[g] = seen.get(g, 0) + 1
            return record

        handles = [modules[n].register_forward_hook(hook(n)) for n in self.scored]
        try:
            self.model.train()
            torch.func.functional_call(self.model, (params, buffers), (x,))
        finally:
            for h in handles:
                h.remove()
        scores = {g: s / seen[g] for g, s in sums.items()}
        # a group no BN follows (none in the bundled models) keeps its first channels
        first = group_keep(self.facts, self.groups, params, 1.0)
        return {g: scores.get(g, torch.zeros(k.numel(), device=k.device)) for g, k in first.items()}

    def own_reply(self, level) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """A client below the whole model sends its choice: one bool per channel of each group."""
        if float(level) >= 1:
            return {}
        return {CHOICE + g: ((k,), torch.bool) for g, k in self.sizes.items()}

    def server_update(self, rnd, params, new, updates, subs):
        """Count the choices of the round's accepted replies toward their levels' evaluation submodels (a rejected
        reply's, or a round's without enough replies, are not counted); the model is the rule's."""
        for u in updates:
            keep = {n.removeprefix(CHOICE): k for n, k in u.delta.items() if n.startswith(CHOICE)}
            if keep:
                self.record(u.level, rnd, keep)
        return new

    def record(self, level, round: int, keep: dict[str, torch.Tensor]) -> None:
        """Count a client's selection toward its level's evaluation submodel (the latest round only)."""
        r, counts = self.counts.get(level.index, (None, {}))
        if r != round:
            counts = {}
        for g, k in keep.items():
            counts[g] = counts[g] + k.long().cpu() if g in counts else k.long().cpu()
        self.counts[level.index] = (round, counts)

    def eval_submodel(self, params, level, round):
        if float(level) >= 1:
            return Submodel()
        rate = width_rate(float(level))
        keep = group_keep(self.facts, self.groups, params, rate)   # first channels
        _, counts = self.counts.get(level.index, (None, {}))
        if self.args["eval"] == "selected" and counts:
            keep = {g: top_channels(counts[g].float(), int(k.sum())).to(k.device) if g in counts else k
                    for g, k in keep.items()}
        return self.own_slice(params, keep)

    def own_slice(self, params, keep: dict[str, torch.Tensor]) -> Submodel:
        """The submodel keeping these channels: trained and evaluated as the smaller dense model where the model
        can slice (the same network as its masks: a dropped channel's conv, BN and next-layer inputs are all
        zero under the masks), else as masks."""
        masks, slices = width_slices(self.facts, params, 0.0, keep=keep)
        return Submodel(masks, slices=slices)

    def state_dict(self) -> dict:
        return {"counts": self.counts}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state.get("counts", {}))
