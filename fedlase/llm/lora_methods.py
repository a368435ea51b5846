"""The adapter methods: LoRA with a rank per level, each aggregated as its paper does (docs/llm.md, "Adapter
methods"; docs/methods.md says where fedlase departs from each paper).

A level of rank k trains the first k rank components of every adapter (a slice of the rank dimension:
`AdapterMethod.submodel`); the rest of the trainable set (a task head outside the transformer) is trained whole by
every client and averaged as the rule averages it. The server step runs the default rule's screen, then the
method's own aggregation of the accepted payloads in `server_update` (fedlase/methods/base.py), the one mechanism
through which a method's server step is fed:

- `hetlora` (Cho et al., EMNLP 2024): each client's adapter zero-padded to the largest rank, the padded A and B
  averaged with weights ||B_k A_k||_F normalised over the round (per adapted module); each level then trains the
  first components of the result (truncation). Optionally its rank self-pruning (`prune`) and the local penalty
  on the components it tests (`penalty`, a `LocalObjective`: `TailPenalty`).
- `flexlora` (Bai et al., NeurIPS 2024): the clients' full products B_k A_k averaged by data size, and the
  average cut back to rank r by a truncated SVD, B = U_r S_r, A = V_r^T (the singular values on B, as the
  authors' code puts them); a level of rank k trains its first k components, the best rank-k approximation.
- `flora` (Wang et al., NeurIPS 2024): the exact data-weighted sum of the products (stacking), scaled as peft
  scales an adapter, merged into the frozen base every round, and the adapters re-initialised. The merged update
  is part of the method's state (so of the checkpoint), never the base.

docs/methods.md says, per method, which authors' code each was checked against and where it departs.
- `lora_fedavg`: every client at one rank (the smallest level's, or the full one), A and B averaged separately
  by the run's rule (the homogeneous baseline); it takes every server stage, dp included.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ConfigError
from ..masks import Submodel, slice_block
from ..methods.base import LocalObjective, Method, Option
from ..registry import register_method
from ..slicing import width_slices
from .adapters import init_a

__all__ = ["AdapterMethod", "FLoRA", "FlexLoRA", "HetLoRA", "LoRAFedAvg", "TailPenalty", "client_adapter"]


def client_adapter(name: str, params: dict[str, torch.Tensor], delta: dict[str, torch.Tensor],
                   sub: Submodel) -> torch.Tensor:
    """A client's trained tensor `name` at the global rank, zero outside the components it held: its start (the
    global tensor) plus its delta, on its slice. The delta may be the slice's small tensor (a sliced client's
    payload) or full-size and zero outside its mask."""
    g, d = params[name], delta[name]
    if d.shape != g.shape:   # the small tensor of its slice: put in its block of a zero tensor
        block = slice_block(sub.slices[name])
        out = torch.zeros_like(g)
        out[block] = g[block] + d
        return out
    mask = sub.masks.get(name)
    return g + d if mask is None else (g + d) * mask


class AdapterMethod(Method):
    """Base of the adapter methods: a level trains its rank's slice of every adapter (`rank`), the other trainable
    tensors whole."""
    adapters = True
    # every engine (runs_on's default): a Flower node builds the base from the config and gets the adapters; a text
    # model refuses batched clients itself
    server_stages = ("attack",)   # its own aggregation follows the default rule's screen (fedlase/server_step.py)

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.pairs = list(model.adapters)   # fedlase/llm/adapters.py, AdaptedModel (the lora key is checked first)
        self._subs: dict = {}
        self.sizes: dict[int, int] = {}     # client -> its training samples (`bind_data`)

    def rank(self, level) -> int:
        """The rank a level trains: its `lora.ranks` entry."""
        return self.model.level_rank(self.system.find(level).index if getattr(level, "index", None) is None
                                     else level.index)

    def submodel(self, params, level, round):
        return self.rank_slice(params, self.rank(level))

    def rank_slice(self, params, k: int) -> Submodel:
        """The submodel that trains the first k rank components of every adapter (and the rest whole)."""
        if k >= self.model.r:
            return Submodel()   # the whole adapter: nothing to cut
        device = next(iter(params.values())).device
        if (k, device) not in self._subs:   # depends on the rank and the device only, never on the values
            keep = {a.group(): torch.arange(self.model.r) < k for a in self.pairs}
            masks, slices = width_slices(self.facts, params, 1.0, keep=keep)
            self._subs[(k, device)] = Submodel(masks, slices=slices)
        return self._subs[(k, device)]

    def bind_data(self, y_train, client_train, num_classes):
        self.sizes = {c: len(i) for c, i in enumerate(client_train)}   # FlexLoRA's and FLoRA's weights

    def shares(self, updates: list) -> list[float]:
        """Each update's share of the round's training samples (the papers' data-size weights)."""
        n = [self.sizes.get(u.client, 1) for u in updates]
        return [k / sum(n) for k in n]

    def trained(self, params, updates, subs, name) -> list[torch.Tensor]:
        return [client_adapter(name, params, u.delta, u.sub or subs[u.level]) for u in updates]


@register_method
class HetLoRA(AdapterMethod):
    """HetLoRA: ranks per level, each client's adapter zero-padded to the largest rank and averaged with weights
    ||B_k A_k||_F normalised over the round; each level trains the first components (truncation)."""
    name = "hetlora"
    # runs_on keeps "batched" although `penalty` attaches a LocalObjective, which the vmapped step does not run: a
    # LoRA model is a text model, which never batches (fedlase/method_config.py), and the objective's loss is the
    # task's, so task=lm takes it (fedlase/llm/lm_task.py, check_lm)
    options = {"prune": Option(None, "rank self-pruning: a client whose last ceil(prune x k) rank components "
                               "(k: its rank) sent a product smaller than they had when it received them trains "
                               "k - ceil(prune x k) components from the next round on (at least 1); the paper's "
                               "decay factor is 1 - prune; unset: off", kind=float, low=0, low_open=True, high=1,
                               high_open=True),
               "penalty": Option(0.0, "the paper's lambda: each client adds lambda x the sum over adapted modules "
                                 "of ||B_tail A_tail||_F (tail: the last ceil(prune x k) of its k rank components, "
                                 "those self-pruning tests) to its task's loss, which drives the tail down so that "
                                 "it prunes; needs prune; 0: off", kind=float, low=0)}

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.check_penalty(self.args)
        self.pruned: dict[int, int] = {}   # client -> the rank it pruned itself to (below its level's)

    @classmethod
    def check_args(cls, options: dict) -> dict:
        return cls.check_penalty(super().check_args(options))

    @staticmethod
    def check_penalty(args: dict) -> dict:
        """The penalty acts on the components self-pruning tests, which `prune` sets: refused without it."""
        if args["penalty"] > 0 and args["prune"] is None:
            raise ConfigError("method_args.penalty", "penalises the last ceil(prune x k) rank components, which "
                              "method_args.prune sets; set prune too (e.g. method_args.prune=0.5)")
        return args

    def submodel(self, params, level, round):
        sub = super().submodel(params, level, round)
        k = self.rank(level)
        own = {c: self.rank_slice(params, r) for c, r in self.pruned.items() if r < k}
        if self.args["penalty"] > 0:   # one objective for the level and its pruned clients: it reads each one's rank
            local = TailPenalty(self.pairs, self.args["prune"], self.args["penalty"])
            return dataclasses.replace(sub, local=local, own={c: dataclasses.replace(s, local=local)
                                                              for c, s in own.items()})
        return dataclasses.replace(sub, own=own) if own else sub

    def eval_submodel(self, params, level, round):
        return super().submodel(params, level, round)   # a level is evaluated at its rank

    def server_update(self, rnd, params, new, updates, subs):
        out = dict(new)   # a head outside the transformer: the rule's mean
        trained = {}
        for ad in self.pairs:
            a_k, b_k = self.trained(params, updates, subs, ad.a), self.trained(params, updates, subs, ad.b)
            out[ad.a], out[ad.b] = hetlora_average(a_k, b_k)
            if self.args["prune"] is not None:
                trained[ad] = (a_k, b_k)
        if self.args["prune"] is not None:
            received = [(params[ad.a], params[ad.b]) for ad in trained]   # every client's start: the global adapter
            before: dict[int, float] = {}   # its tail's norm per rank, the same for every client of that rank
            for i, u in enumerate(updates):
                k = self.held_rank(u.sub or subs[u.level])
                keep = self_pruned_rank(received, [(a[i], b[i]) for a, b in trained.values()], k,
                                        self.args["prune"], before)
                if keep < k:
                    self.pruned[u.client] = keep
        return out

    def held_rank(self, sub) -> int:
        """The rank a submodel trains: the rows its slice keeps of an A (all r without a slice)."""
        first = self.pairs[0].a
        return len(sub.slices[first][0]) if first in sub.slices else self.model.r

    def state_dict(self) -> dict:
        return {"pruned": dict(self.pruned)}

    def load_state_dict(self, state: dict) -> None:
        self.pruned = {int(c): int(k) for c, k in state.get("pruned", {}).items()}


def tail_start(k: int, prune: float) -> int | None:
    """Where the tail of a client of rank k starts: its last m = ceil(prune k) components are k - m .. k - 1 (the
    paper's floor(gamma k) .. k - 1, gamma = 1 - prune); None where that would leave no component."""
    lo = k - math.ceil(prune * k)
    return lo if lo >= 1 else None


def self_pruned_rank(received: list[tuple[torch.Tensor, torch.Tensor]], sent: list[tuple[torch.Tensor, torch.Tensor]],
                     k: int, prune: float, before: dict[int, float] | None = None) -> int:
    """The rank a client of rank k keeps under HetLoRA's self-pruning: its tail (`tail_start`) is pruned (the
    paper's r_k -> floor(gamma r_k), gamma = 1 - prune) when its product sum_j B[:, j] A[j] (Frobenius norm over
    every adapted module) is smaller in what it sent than in what it received at the round's start, the paper's
    test. `received`, `sent`: the (A, B) of every module at rank r, in one order. `before`: the received tail's
    norm by rank, kept across the calls of one round (every client of a rank received the same adapter)."""
    lo = tail_start(k, prune)
    if lo is None:
        return k
    def tail(adapters) -> float:
        return math.sqrt(sum(float(torch.linalg.matrix_norm(b[:, lo:k] @ a[lo:k])) ** 2 for a, b in adapters))
    before = {} if before is None else before
    if k not in before:
        before[k] = tail(received)
    return lo if tail(sent) < before[k] else k


class TailPenalty(LocalObjective):
    """HetLoRA's local regularisation: `weight` x the sum over the adapted modules of ||B_tail A_tail||_F, the tail
    being the last ceil(prune k) of the k components the client trains (the ones its self-pruning tests), added to
    the task's loss (`LocalObjective.penalty`). k is read off the submodel the client trains (`start`): the rows of
    A it holds, gathered (a slice) or kept by its mask (sliced=false), so one objective serves every level and every
    pruned client, and a Flower node rebuilds it from the level alone."""

    def __init__(self, pairs: list, prune: float, weight: float):
        self.pairs, self.prune, self.weight = pairs, prune, weight
        self.tail: tuple[int, int] | None = None   # (first, end) of the tail of the client now training

    def start(self, model, sub, params, buffers, x, batches):
        a = self.pairs[0].a
        k = int(sub.masks[a].any(dim=1).sum()) if a in sub.masks else params[a].shape[0]
        lo = tail_start(k, self.prune)
        self.tail = None if lo is None else (lo, k)   # rank 1 has no tail (self-pruning keeps it)
        return sub

    def penalty(self, weights):
        if self.tail is None:
            return None
        lo, k = self.tail
        return self.weight * sum(product_norm(weights[ad.b][:, lo:k], weights[ad.a][lo:k]) for ad in self.pairs)


def product_norm(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """||b a||_F for b (out x m), a (m x in), differentiable, from the m x m Gram matrices (||BA||_F^2 =
    sum((B^T B) * (A A^T))): the out x in product of every module would be kept for the backward at every step.
    Its gradient is 0 where the product is 0 (as B starts), the norm's subgradient there, never NaN."""
    sq = ((b.T @ b) * (a @ a.T)).sum().clamp(min=0)   # >= 0 but for rounding
    nonzero = sq > 0
    return torch.where(nonzero, torch.where(nonzero, sq, torch.ones_like(sq)).sqrt(), torch.zeros_like(sq))


def hetlora_average(a_k: list[torch.Tensor], b_k: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B): the zero-padded A_k and B_k averaged with weights ||B_k A_k||_F / sum_j ||B_j A_j||_F (equal weights
    where every product is zero, as before any B has moved from its zero start)."""
    norms = torch.stack([torch.linalg.matrix_norm(b @ a) for a, b in zip(a_k, b_k)])
    total = norms.sum()   # compared on the device: no host read per module
    w = torch.where(total > 0, norms / total.clamp(min=torch.finfo(norms.dtype).tiny), 1.0 / len(norms))
    return sum(wk * a for wk, a in zip(w, a_k)), sum(wk * b for wk, b in zip(w, b_k))


@register_method
class FlexLoRA(AdapterMethod):
    """FlexLoRA: the clients' products B_k A_k averaged by data size, then a truncated SVD back to the rank;
    each level trains the first components (the best approximation of its rank)."""
    name = "flexlora"

    def server_update(self, rnd, params, new, updates, subs):
        out, shares = dict(new), self.shares(updates)
        for ad in self.pairs:
            a_k, b_k = self.trained(params, updates, subs, ad.a), self.trained(params, updates, subs, ad.b)
            avg = sum(s * (b @ a) for s, a, b in zip(shares, a_k, b_k))
            out[ad.b], out[ad.a] = svd_factors(avg, self.model.r)
        return out


def svd_factors(w: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A) of rank r with B A the best rank-r approximation of `w` (out x in): the truncated SVD U_r S_r V_r^T,
    the singular values on B, B = U_r S_r, A = V_r^T (orthonormal rows), as the authors' code splits it; the
    components in decreasing order, so the first k are the best rank-k approximation."""
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return (u[:, :r] * s[:r]).contiguous(), vh[:r].contiguous()   # r <= min(out, in): lora.r


@register_method
class FLoRA(AdapterMethod):
    """FLoRA: the exact data-weighted sum of the clients' products (stacking), merged into the frozen base every
    round, and fresh adapters for the next."""
    name = "flora"
    runs_on = ("embedded", "batched")
    confined = ("FLoRA merges the adapters into the frozen base every round, so a Flower node, which builds its "
                "base from the config, would train on the pretrained one; the merged updates are as large as the "
                "adapted weights, so they do not travel")

    def __init__(self, model, system=(1.0,), **options):
        super().__init__(model, system, **options)
        self.merged: dict[str, torch.Tensor] = {}   # base weight name -> the updates merged into it so far
        weights = dict(model.named_parameters())
        self.base = {ad.base: weights[ad.base] for ad in self.pairs}   # the module's own (frozen) parameters
        # their pretrained tensors, never written: a merged base is a new tensor (a decoder's base may be shared by
        # every model built from one loaded file, fedlase/llm/decoder.py)
        self.pretrained = {n: w.data for n, w in self.base.items()}

    def server_update(self, rnd, params, new, updates, subs):
        out, shares = dict(new), self.shares(updates)
        g = self.generator(self.system.levels[0], rnd)   # the fresh adapters' draw: (run seed, round)
        for ad in self.pairs:
            a_k, b_k = self.trained(params, updates, subs, ad.a), self.trained(params, updates, subs, ad.b)
            stacked_b = torch.cat(b_k, 1)                                     # B_1 ... B_K side by side
            stacked_a = torch.cat([s * a for s, a in zip(shares, a_k)], 0)   # A_1 ... A_K along the rank, weighted
            update = self.model.scaling * (stacked_b @ stacked_a)   # = sum_k s_k B_k A_k, as peft scales it
            self.merged[ad.base] = self.merged[ad.base] + update if ad.base in self.merged else update
            out[ad.a] = init_a(tuple(params[ad.a].shape), g).to(params[ad.a])
            out[ad.b] = torch.zeros_like(params[ad.b])
        self.apply_merged()
        return out

    def apply_merged(self) -> None:
        """The base weights set to their pretrained values plus the merged updates, as new tensors (computed the
        same way on a resumed run, so it is bit-identical). The server thus holds the pretrained targets beside the
        merged ones: the price of an exact resume."""
        with torch.no_grad():
            for ad in self.pairs:
                if ad.base in self.merged:
                    m = self.merged[ad.base]
                    self.base[ad.base].data = self.pretrained[ad.base] + (m.T if ad.transposed else m)

    def state_dict(self) -> dict:
        return {"merged": dict(self.merged)}

    def load_state_dict(self, state: dict) -> None:
        self.merged = {k: v.to(self.base[k].device) for k, v in state.get("merged", {}).items()}
        self.apply_merged()


@register_method
class LoRAFedAvg(AdapterMethod):
    """LoRA-FedAvg: every client at one rank (the smallest level's, or the full rank), A and B averaged by the
    run's rule: the homogeneous baseline."""
    name = "lora_fedavg"
    server_stages = ("rule", "attack", "dp")   # the rule's own mean: every stage reaches it
    options = {"rank": Option("smallest", "the rank every client trains: smallest (the smallest level's, which "
                              "every device holds) or full (lora.r, as if every device could)",
                              choices=("smallest", "full"))}

    def rank(self, level) -> int:
        return self.model.r if self.args["rank"] == "full" else self.model.level_rank(len(self.system.levels) - 1)
