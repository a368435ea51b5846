"""Local training of one client on its submodel, written functionally (parameters are a dict passed to
`torch.func.functional_call`), so the same code serves the embedded engine, Flower's ClientApp, and a
batched path that stacks several clients' parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .masks import Submodel


@dataclass(frozen=True)
class LocalWork:
    """How much and how a client trains in one round."""
    steps: int | None = 20           # local steps; ignored when epochs is set
    epochs: float | None = None
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    @classmethod
    def from_config(cls, cfg) -> "LocalWork":
        return cls(cfg.local_steps, cfg.local_epochs, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.momentum,
                   cfg.weight_decay, tuple(cfg.betas))

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


def make_optimizer(params: list[torch.Tensor], work: LocalWork) -> torch.optim.Optimizer:
    if work.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=work.lr, betas=work.betas, weight_decay=work.weight_decay)
    return torch.optim.SGD(params, lr=work.lr, momentum=work.momentum, weight_decay=work.weight_decay)


def has_tied_weights(model: nn.Module) -> bool:
    """Whether a parameter appears under two names. Only then must functional_call look for tied weights,
    which costs ~0.2 ms a call (a quarter of a small CNN's forward on digits)."""
    return sum(1 for _ in model.named_parameters(remove_duplicate=False)) != sum(1 for _ in model.parameters())


def local_train(model: nn.Module, global_params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                sub: Submodel, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], work: LocalWork,
                augment: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """Train `sub` of the global model on (x, y) for the given batches; return the delta, zero outside the
    submodel's mask, and the mean training loss.

    The local optimizer is fresh each round (as in FIARSE and HeteroFL). Coordinates outside the mask get no
    gradient; whatever weight decay does to them locally is dropped with the mask on the delta."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in global_params.items()}
    bufs = {**{n: b.clone() for n, b in buffers.items()}, **sub.buffers}
    opt = make_optimizer(list(params.values()), work)
    model.train()
    tie = has_tied_weights(model)
    total = torch.zeros((), dtype=torch.float64, device=x.device)   # summed where the loss is: no sync a step
    for idx in batches:
        xb, yb = x[idx], y[idx]
        if augment is not None:
            xb = augment(xb)
        loss = F.cross_entropy(functional_call(model, (sub.apply(params), bufs), (xb,), tie_weights=tie), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += loss.detach().double()
    delta = {}
    with torch.no_grad():
        for n, p in params.items():
            d = p - global_params[n]
            delta[n] = d * sub.masks[n] if n in sub.masks else d
    return delta, float(total) / max(len(batches), 1)
