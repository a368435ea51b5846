"""Submodels as masks over the global model's parameters, and the masked forward used in local training.

A `Submodel` is plain data: boolean masks keyed like `named_parameters()` (a parameter without a mask is
trained whole) and, for threshold methods (FIARSE, FedLASE), the per-parameter thresholds the client keeps
so that its mask is re-evaluated at every forward as |w| >= tau.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .model_hooks import hook

STE_MODES = ("official", "paper")


def maskable_names(model: nn.Module) -> list[str]:
    """Weights and biases of conv and linear layers, in registration (= forward) order: the parameters a
    resource budget counts. BatchNorm parameters are outside the budget. A model may declare its own list
    with a `budgeted_names()` method (a transformer budgets embeddings and encoder linears, not its head)."""
    declared = hook(model, "budgeted_names")
    if declared is not None:
        return list(declared())
    names = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Linear)):
            names += [f"{mod_name}.{p}" for p, _ in mod.named_parameters(recurse=False)]
    return names


@dataclass
class Submodel:
    """What one client trains.

    masks: name -> bool tensor of the parameter's shape; the coordinates the client trains and returns.
    thresholds: name -> tau; when given, the client re-evaluates the mask at each forward as |w| >= tau
        (a weight that falls below tau drops out for the rest of the round). `masks` then holds the mask
        at the start of the round, which is also what the client is credited with in aggregation.
    ste: gradient through a threshold mask: 'official' = g * mask (what the FIARSE code computes),
        'paper' = g * mask * (1 + 2 tau |w| / (|w| + tau)^2) (the FIARSE paper's straight-through rule).
    buffers: buffer overrides used in local training only.
    slices: name -> (kept indices or None, per leading dim) of a parameter or buffer, for a width slice
        (whole rows/columns/channels; `masks` holds the same support). A client then trains the gathered
        smaller dense tensors (`gather`) and scatters its delta back (`scatter`); empty: train masked.
    scales: name -> factor the weight is multiplied by in local training only (HeteroFL's scaler folded into
        the weights: a layer's output times s equals its weight and bias times s).
    local: the method's own local training (a `fedlase.methods.base.LocalObjective`: FjORD's width per batch,
        DepthFL's exits, FedDSE's per-client mask); None: plain cross-entropy of one forward (fedlase/train.py).
    own: client id -> the submodel that client trains instead of this one (HetLoRA's clients whose rank pruned
        itself below their level's); `fedlase.client.ClientTrainer.submodel` reads it. Evaluation ignores it.
    """
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    thresholds: dict[str, float | torch.Tensor] | None = None   # a 0-d tensor on a GPU (kth_largest)
    ste: str = "official"
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    slices: dict[str, tuple] = field(default_factory=dict)
    scales: dict[str, float] = field(default_factory=dict)
    local: object | None = None
    own: dict[int, Submodel] = field(default_factory=dict)

    def apply(self, params: dict[str, torch.Tensor], train: bool = False) -> dict[str, torch.Tensor]:
        """The effective weights: params times their (threshold or fixed) masks, differentiable; in training
        (`train`) also times their scales. The one masked forward of fedlase: local training, evaluation, the
        batched path (on a `stack` of clients' submodels) and the bench's tight loop all weight through it."""
        out = {}
        for name, w in params.items():
            if self.thresholds is not None and name in self.thresholds:
                out[name] = threshold_mask(w, self.thresholds[name], self.ste)
            elif name in self.masks:
                out[name] = w * self.masks[name]
            else:
                out[name] = w
            if train and name in self.scales:
                out[name] = out[name] * self.scales[name]
        return out

    def is_whole(self, train: bool = False) -> bool:
        """Whether `apply` returns the parameters unchanged (no mask, threshold, or, in training, scale)."""
        return not self.masks and not self.thresholds and not (train and self.scales)

    @classmethod
    def stack(cls, subs: list[Submodel], params: dict[str, torch.Tensor]) -> Submodel:
        """One submodel over C clients' parameters stacked as (C, *shape) (fedlase/batched.py): `apply` on the
        stacked parameters is then every client's own masked forward. Masks stack (all ones where a client
        keeps a parameter whole: w * 1 == w), thresholds and scales become one value per client (a threshold
        on a parameter must be every client's or none's; scale 1.0 where a client has none: w * 1.0 == w)."""
        C = len(subs)
        thresholds, masks, scales = {}, {}, {}
        for n, g in params.items():
            view = (C, *[1] * g.dim())
            has_tau = [s.thresholds is not None and n in s.thresholds for s in subs]
            if any(has_tau):
                if not all(has_tau):
                    raise ValueError(f"{n}: some clients of a batched group have a threshold, others not")
                thresholds[n] = torch.stack([torch.as_tensor(s.thresholds[n], dtype=g.dtype, device=g.device)
                                             for s in subs]).view(view)   # a float, or a device's 0-d tensor
            if any(n in s.masks for s in subs):
                masks[n] = torch.stack([s.masks[n] if n in s.masks else torch.ones_like(g, dtype=torch.bool)
                                        for s in subs]).to(g.device)
            if any(n in s.scales for s in subs):
                scales[n] = torch.tensor([s.scales.get(n, 1.0) for s in subs], dtype=g.dtype,
                                         device=g.device).view(view)
        ste = subs[0].ste
        if thresholds and any(s.ste != ste for s in subs):
            raise ValueError("clients of a batched group use different ste modes")
        return cls(masks, thresholds or None, ste, scales=scales)

    # ---- width slices ----------------------------------------------------------------------------------------
    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sliced (smaller) copies of the named tensors; tensors without a slice pass through."""
        return {n: t[slice_block(self.slices[n])] if n in self.slices else t for n, t in tensors.items()}

    def scatter(self, small: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full-size tensors shaped like `like`, zero outside the slice, holding `small` on it."""
        out = {}
        for n, t in small.items():
            if n in self.slices:
                full = torch.zeros_like(like[n])
                full[slice_block(self.slices[n])] = t
                out[n] = full
            else:
                out[n] = t
        return out

    def inner(self) -> Submodel:
        """What trains the gathered slice: the same scales, and masks only where the gathered mask is not
        whole (a width slice is; a label-split restriction ANDed into it need not be). Computed once: every
        client of a level shares its submodel."""
        if "_inner" in self.__dict__:
            return self.__dict__["_inner"]
        masks = {}
        for n, m in self.masks.items():
            g = m[slice_block(self.slices[n])] if n in self.slices else m
            if not bool(g.all()):
                masks[n] = g
        self.__dict__["_inner"] = Submodel(masks, scales=self.scales, local=self.local)
        return self.__dict__["_inner"]

    def masked(self) -> Submodel:
        """This submodel without its slices: trained and evaluated as masks over the full-size model."""
        return Submodel(self.masks, self.thresholds, self.ste, self.buffers, {}, self.scales, self.local)

    def model(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
              sliced: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(weights, buffers) a level is evaluated with: the gathered slice (sliced and a slice), else the
        masked full-size weights and the buffers as they are."""
        if sliced and self.slices:
            return self.gather(params), self.gather(buffers)
        return self.apply(params), buffers

    def kept(self, names: list[str], params: dict[str, torch.Tensor]) -> int:
        """How many of the named parameters' coordinates this submodel holds."""
        return sum(int(self.masks[n].sum()) if n in self.masks else params[n].numel() for n in names)

    def to(self, device) -> Submodel:
        thresholds = None if self.thresholds is None else {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.thresholds.items()}
        return Submodel({k: v.to(device) for k, v in self.masks.items()}, thresholds, self.ste,
                        {k: v.to(device) for k, v in self.buffers.items()},
                        {k: tuple(None if i is None else i.to(device) for i in v) for k, v in self.slices.items()},
                        self.scales, self.local, {c: s.to(device) for c, s in self.own.items()})


def slice_block(index: tuple) -> tuple:
    """An indexing tuple that selects the block kept indices[d] x ... of the leading dims (None: all of a
    dim), e.g. (rows, cols) -> w[rows[:, None], cols[None, :]]."""
    sliced = [d for d, i in enumerate(index) if i is not None]
    if sliced and sliced[-1] - sliced[0] + 1 != len(sliced):   # torch would move split advanced dims first
        raise ValueError("a slice must cut adjacent dims")
    out = []
    for d, i in enumerate(index):
        if i is None:
            out.append(slice(None))
        else:
            shape = [1] * len(sliced)
            shape[sliced.index(d)] = -1
            out.append(i.view(shape))
    return tuple(out)


class _ThresholdMask(torch.autograd.Function):
    """w -> w * 1[|w| >= tau], with the gradient chosen by `paper`."""

    @staticmethod
    def forward(ctx, w, tau: float, paper: bool):
        mask = w.abs() >= tau
        ctx.save_for_backward(w, mask)
        ctx.tau, ctx.paper = tau, paper
        return w * mask

    @staticmethod
    def backward(ctx, g):
        w, mask = ctx.saved_tensors
        grad = g * mask
        if ctx.paper:
            a, tau = w.abs(), ctx.tau
            s = a + tau
            # 0/0 where |w| = tau = 0 (level 1 keeps every weight, zeros included); the factor is 1 along both
            # edges (tau = 0, any |w| > 0; |w| = 0, any tau > 0), so its limit there is taken as 1
            grad = grad * torch.where(s > 0, 1 + 2 * tau * a / s ** 2, 1.0)
        return grad, None, None


def threshold_mask(w: torch.Tensor, tau: float | torch.Tensor, ste: str = "official") -> torch.Tensor:
    """tau: a number, or a tensor broadcastable to w (one threshold per stacked client, fedlase/batched.py)."""
    if ste not in STE_MODES:
        raise ValueError(f"ste must be one of {STE_MODES}, got {ste!r}")
    tau = tau if isinstance(tau, torch.Tensor) else float(tau)
    if ste == "official":   # plain autograd gives the same value and gradient (g * mask) without the
        return w * (w.abs() >= tau)   # Python Function's cost: ~10% of a step on a small model
    return _ThresholdMask.apply(w, tau, True)


_BRACKET_MIN = 1 << 16   # below this size a plain kthvalue is as fast


_DEVICE_SIDE = frozenset({"cuda", "xpu", "mps"})   # devices on which a threshold stays a tensor (kth_largest)


def kth_largest(values: torch.Tensor, k: int) -> float | torch.Tensor:
    """The k-th largest entry of a 1-D tensor by partial selection, not a full sort. Exact.

    torch.kthvalue costs ~30-40 ns an entry on a CPU (0.3-0.4 s for ResNet-18's 11.2M weights, per level and
    round), so a large input is narrowed first: a strided sample brackets the k-th largest, and kthvalue runs
    only on the entries inside the bracket, after counting those above it. If the bracket misses (the sample
    is only an estimate), the plain kthvalue over everything answers: the value is the same either way.

    On a GPU the value is a 0-d tensor on the device: a threshold is only ever compared with weights there,
    and reading it (and the bracket's data-dependent sizes) would make the host wait for the device once or
    more per layer, level and round; the GPU's own selection needs no bracket."""
    n = values.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k={k} outside 1..{n}")
    if values.device.type in _DEVICE_SIDE:
        return torch.kthvalue(values, n - k + 1).values
    if k == n:
        return float(values.min())
    if n >= _BRACKET_MIN:
        sample = values[:: n // 4096].sort(descending=True).values   # ~4096 entries spread over the input
        m = sample.numel()
        j = (k - 1) * m / n                                          # where the k-th largest falls in it
        margin = 4 * math.sqrt(m * (k / n) * (1 - k / n)) + 8         # ~4 standard deviations of that estimate
        a, b = int(j - margin), int(j + margin) + 1
        # cand: entries >= the bracket's low end (all of them when the bracket reaches the sample's end)
        cand = values[values >= sample[b]] if b < m else values
        hi = sample[a] if a > 0 else None
        above = int(torch.count_nonzero(cand > hi)) if hi is not None else 0
        inside = cand[cand <= hi] if hi is not None else cand
        if above < k <= above + inside.numel():
            return float(torch.kthvalue(inside, inside.numel() - (k - above) + 1).values)
    return float(torch.kthvalue(values, n - k + 1).values)
