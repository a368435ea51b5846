"""Local training of one client on its submodel, written functionally (parameters are a dict passed to
`torch.func.functional_call`), so the same code serves the embedded engine, Flower's ClientApp, and a
batched path that stacks several clients' parameters."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .masks import Submodel


@dataclass(frozen=True)
class LocalWork:
    """How much and how a client trains in one round: a view of the validated config, built once from it
    (`fedlase.client.ClientSettings.from_config`), with no defaults of its own (the config's are the ones)."""
    steps: int | None                # local steps; ignored when epochs is set
    epochs: float | None
    batch_size: int
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    betas: tuple[float, float]
    clip_norm: float | None          # clip each step's gradient to this total L2 norm (HeteroFL/FedRolex: 1)
    precision: str                   # fp32, or bf16: each step's forward and loss under autocast
    task: str = "classify"           # the loss: classify's cross-entropy, or a registered task's (`task_loss`)

    def num_steps(self, n_samples: int) -> int:
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * n_samples / self.batch_size))
        return self.steps


def client_batches(n_samples: int, work: LocalWork, generator: torch.Generator) -> list[torch.Tensor]:
    """Positions (into the client's index array) of each local batch: successive shuffled passes over the
    client's data, cut into batches; a pass's last partial batch is kept."""
    steps, bs = work.num_steps(n_samples), min(work.batch_size, n_samples)
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        perm = torch.randperm(n_samples, generator=generator)
        batches += list(perm.split(bs))
    return batches[:steps]


class SGD:
    """torch.optim.SGD's update (weight decay, momentum; no dampening or Nesterov), written out: a process's
    first torch.optim step imports torch._dynamo, about 3 s that every Flower ClientApp process (one per
    message) would pay. Same operations in the same order, so bit-identical (tests/test_engine.py)."""

    def __init__(self, params: list[torch.Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params, self.lr, self.momentum, self.weight_decay = list(params), lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        # each operation on every tensor at once: torch's foreach ops, one launch per operation on a GPU rather
        # than one per tensor; on a CPU they run the same per-tensor operations, so the same bits
        held = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in held]
        grads = [p.grad for p in params]
        if self.weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)   # private: foreach ops, as above
        if self.momentum != 0:
            old = [k for k, i in enumerate(held) if self.buffers[i] is not None]
            if old:
                bufs = [self.buffers[held[k]] for k in old]
                torch._foreach_mul_(bufs, self.momentum)   # private: foreach ops, as above
                torch._foreach_add_(bufs, [grads[k] for k in old], alpha=1)   # private: foreach ops, as above
            for k, i in enumerate(held):
                if self.buffers[i] is None:
                    self.buffers[i] = grads[k].detach().clone()
            grads = [self.buffers[i] for i in held]
        if params:
            torch._foreach_add_(params, grads, alpha=-self.lr)   # private: foreach ops, as above


def make_optimizer(params: list[torch.Tensor], work: LocalWork):
    if work.optimizer == "adamw":   # fused on a GPU: one kernel a step (on a CPU as before, bit for bit)
        return torch.optim.AdamW(params, lr=work.lr, betas=work.betas, weight_decay=work.weight_decay,
                                 fused=True if params and params[0].is_cuda else None)
    return SGD(params, lr=work.lr, momentum=work.momentum, weight_decay=work.weight_decay)


def autocast(work: LocalWork, device: torch.device):
    """The context a local step's forward and loss run in: bf16 autocast under `precision=bf16` (parameters,
    gradients and the optimizer stay fp32, as autocast keeps them), else none (fp32, bit for bit as before)."""
    if work.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """A 4-D tensor (an image batch, a conv weight) in channels-last memory on CUDA, where cuDNN's convolutions
    run faster so; anything else as it is. Only the memory layout changes, never a value; on a CPU nothing."""
    if t.dim() == 4 and t.device.type == "cuda":
        return t.contiguous(memory_format=torch.channels_last)
    return t


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a run trains, by name: all but the frozen ones (`requires_grad` False: a LoRA run's base,
    fedlase/llm/adapters.py), which the module holds once and no run state, payload or checkpoint carries."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def has_tied_weights(model: nn.Module) -> bool:
    """Whether a parameter appears under two names. Only then must functional_call look for tied weights,
    which costs ~0.2 ms a call (a quarter of a small CNN's forward on digits)."""
    return sum(1 for _ in model.named_parameters(remove_duplicate=False)) != sum(1 for _ in model.parameters())


def local_train(model: nn.Module, global_params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                sub: Submodel, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], work: LocalWork,
                augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
                classes: torch.Tensor | None = None, scatter: bool = True) -> tuple[dict[str, torch.Tensor], float]:
    """Train `sub` of the global model on (x, y) for the given batches; return the delta, zero outside the
    submodel's mask, and the mean training loss.

    The local optimizer is fresh each round (as in FIARSE and HeteroFL). Coordinates outside the mask get no
    gradient; whatever weight decay does to them locally is dropped with the mask on the delta.
    `work.clip_norm` clips each step's gradient (all parameters together; coordinates outside the mask have a
    zero gradient, so this is the norm of the submodel's own gradient, as the official structured codes clip
    their sliced model). `classes` (the client's present classes, as indices or a bool mask over the classes)
    sets the other classes' logits to 0 before the loss, as HeteroFL's and FedRolex's official `mask=1`.
    A submodel with `slices` trains the gathered smaller tensors (same module: conv, linear and BN take their
    shapes from the tensors) and its delta is scattered back to full size, zero outside the slice, unless
    `scatter=False` (then the small tensors come back; `Aggregator.add` takes them as they are).

    A submodel with `local` (a method's `LocalObjective`, fedlase/methods/base.py) trains the method's way:
    `local.start` may replace the submodel for this client (its own mask, or its own slice, which then trains
    as any slice, with a full-size delta), `local.loss` turns each batch into the loss (None: the task's loss of
    one forward) and `local.penalty` adds a term to it; without one, the loss is the task's loss of one forward
    (the path every other method takes)."""
    if sub.slices:
        small, loss = local_train(model, sub.gather(global_params), sub.gather({**buffers, **sub.buffers}),
                                  sub.inner(), x, y, batches, work, augment, classes)
        return (sub.scatter(small, global_params) if scatter else small), loss
    local = sub.local
    if local is None and sub.is_whole(train=True) and _fits(model, global_params, {**buffers, **sub.buffers}):
        return _train_whole(model, global_params, {**buffers, **sub.buffers}, x, y, batches, work, augment, classes)
    params = {n: channels_last(p.detach().clone()).requires_grad_(True) for n, p in global_params.items()}
    bufs = {**{n: b.clone() for n, b in buffers.items()}, **sub.buffers}
    if local is not None:
        if classes is not None:
            raise ValueError("label_split is not supported with a method's own local objective")
        own = local.start(model, sub, params, bufs, x, batches)
        if own.slices:   # the client's own slice (FedDSE): it trains as any slice, its delta comes back full-size
            return local_train(model, global_params, buffers, own, x, y, batches, work, augment, None, True)
        sub = own
    model.train()
    tie = has_tied_weights(model)

    def forward(w, b, *a, **k):
        return functional_call(model, (w, b), a, k, tie_weights=tie)

    def batch_loss(xb, yb):
        weights = sub.apply(params, train=True)
        loss = local.loss(forward, weights, bufs, xb, yb) if local is not None else None
        if loss is None:   # the task's loss (an objective may leave it to the task)
            loss = task_loss(work, forward(weights, bufs, xb), xb, yb, classes)
        extra = local.penalty(weights) if local is not None else None
        return loss if extra is None else loss + extra
    mean_loss = _steps(batch_loss, list(params.values()), x, y, batches, work, augment)
    delta = {}
    with torch.no_grad():
        for n, p in params.items():
            d = p - global_params[n]
            delta[n] = d * sub.masks[n] if n in sub.masks else d
    return delta, mean_loss


def task_loss(work: LocalWork, out: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor,
              classes: torch.Tensor | None) -> torch.Tensor:
    """One batch's loss: the cross-entropy of the logits (task=classify), or the task's own (task=lm's next-token
    loss: fedlase.registry.TASKS)."""
    if work.task == "classify":
        return _cross_entropy(out, yb, classes)
    from .registry import TASKS
    return TASKS.get(work.task).loss(out, xb, yb)


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor, classes: torch.Tensor | None) -> torch.Tensor:
    return F.cross_entropy(logits if classes is None else label_mask_logits(logits, classes), y)


def _steps(batch_loss: Callable, plist: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
           batches: list[torch.Tensor], work: LocalWork, augment: Callable | None) -> float:
    """One optimizer step per batch on `batch_loss(xb, yb)` (a fresh optimizer over `plist`, gradients clipped
    as `work` says); returns the mean loss."""
    opt = make_optimizer(plist, work)
    total = torch.zeros((), dtype=torch.float64, device=x.device)   # summed where the loss is: no sync a step
    for idx in batches:
        xb, yb = x[idx], y[idx]
        if augment is not None:
            xb = augment(xb)
        with autocast(work, x.device):
            loss = batch_loss(channels_last(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if work.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(plist, work.clip_norm)
        opt.step()
        total += loss.detach().double()
    return float(total) / max(len(batches), 1)


_TRAINING_MODULES: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _training_module(model: nn.Module) -> tuple[nn.Module, dict, dict]:
    """A private copy of `model` in training mode, and its parameters and buffers by name; made once per model."""
    if model not in _TRAINING_MODULES:
        net = deepcopy(model).train()
        if next(net.parameters()).device.type == "cuda":   # conv weights channels-last, as `channels_last`
            net.to(memory_format=torch.channels_last)
        own, bufs = dict(net.named_parameters()), dict(net.named_buffers())
        _TRAINING_MODULES[model] = (net, own, bufs)
    return _TRAINING_MODULES[model]


_SHAPES: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _fits(model: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> bool:
    """Whether `params` and `buffers` are all of the model's own, by name and shape (not a width slice's
    smaller tensors, nor only the trainable ones of a model with frozen parameters). Read off the model itself:
    the private copy (`_training_module`) is made only for a model that fits, never for a LoRA run's base."""
    if model not in _SHAPES:
        _SHAPES[model] = {n: t.shape for n, t in [*model.named_parameters(), *model.named_buffers()]}
    shapes = _SHAPES[model]
    return len(params) + len(buffers) == len(shapes) and all(
        shapes.get(n) == t.shape for d in (params, buffers) for n, t in d.items())


def _train_whole(model: nn.Module, global_params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], work: LocalWork,
                 augment: Callable | None, classes: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], float]:
    """`local_train` of a submodel that is the whole model (FedAvg, level 1): the same steps on a private copy of
    the module whose own parameters are set to the global ones, called directly. `functional_call` would swap
    every tensor into the module twice a step, ~10% of a small CNN's step (docs/benchmarks.md); the values
    and operations are the same, so the delta is bit-identical. The caller's module is never written."""
    net, own, own_buffers = _training_module(model)
    with torch.no_grad():
        for n, p in global_params.items():
            own[n].copy_(p)
        for n, b in buffers.items():
            own_buffers[n].copy_(b)
    params = {n: own[n] for n in global_params}   # the caller's order: gradient clipping sums in it
    mean_loss = _steps(lambda xb, yb: task_loss(work, net(xb), xb, yb, classes), list(params.values()), x, y,
                       batches, work, augment)
    with torch.no_grad():
        delta = {n: p - global_params[n] for n, p in params.items()}
    return delta, mean_loss


# ---- label-split masking (HeteroFL's and FedRolex's official `mask=1`) ---------------------------------------

def class_keep(classes: torch.Tensor, num_classes: int, device=None) -> torch.Tensor:
    """A bool vector over the classes: True for the given classes (indices, or already a bool mask)."""
    classes = torch.as_tensor(classes, device=device)
    if classes.dtype == torch.bool:
        if classes.numel() != num_classes:
            raise ValueError(f"a class mask must have {num_classes} entries, got {classes.numel()}")
        return classes
    keep = torch.zeros(num_classes, dtype=torch.bool, device=device)
    keep[classes.long()] = True
    return keep


def label_mask_logits(logits: torch.Tensor, present_classes: torch.Tensor) -> torch.Tensor:
    """The official label-split masking: the logits of classes outside `present_classes` are set to 0 (not
    -inf: those classes stay in the softmax with logit 0 and get no gradient; in an argmax an absent class
    wins when every present logit is negative). The one place of this rule: the local loss (`local_train`) and
    the local accuracy (`evaluate.predict`) both call it; pass a bool vector (`class_keep`) to build it once."""
    return logits.masked_fill(~class_keep(present_classes, logits.shape[-1], logits.device), 0.0)


def classifier_names(model: nn.Module) -> tuple[str, str | None]:
    """(weight, bias) names of the classifier: the last linear layer registered (the CNN's `classifier`,
    ResNet-18's `linear`)."""
    last = None
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            last = (f"{mod_name}.weight", f"{mod_name}.bias" if mod.bias is not None else None)
    if last is None:
        raise ValueError("the model has no linear layer to restrict to the client's classes")
    return last


def label_split_masks(params: dict[str, torch.Tensor], weight: str, bias: str | None,
                      present_classes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masks that restrict a client to its classes' classifier rows; AND them into its Submodel's masks
    (`restrict_submodel`). The delta is then zero on the other rows and the aggregation counts the client
    only on its own rows, as the official `combine` does; in the forward the masked rows (weight and bias)
    give those classes a logit of exactly 0, the same as `label_mask_logits`."""
    w = params[weight]
    keep = class_keep(present_classes, w.shape[0], w.device)
    out = {weight: keep.view(-1, *([1] * (w.dim() - 1))).expand_as(w).clone()}
    if bias is not None:
        out[bias] = keep.clone()
    return out


def restrict_submodel(sub: Submodel, extra: dict[str, torch.Tensor]) -> Submodel:
    """A copy of `sub` whose masks are ANDed with `extra` (a parameter without a mask takes `extra`'s).
    For a threshold parameter (FIARSE, FedLASE) the forward keeps its own |w| >= tau rule, so `extra` then
    restricts only the returned delta and the credit; pass `classes` to `local_train` for the loss."""
    masks = dict(sub.masks)
    for n, m in extra.items():
        masks[n] = masks[n] & m if n in masks else m
    return dataclasses.replace(sub, masks=masks)
