"""Who trains in a round, at which level, and on which batches: plain functions of (settings, round, client).

Every round and client draws from its own seeded stream, so any engine (embedded, batched, a Flower node)
computes the same draws, and a resumed run draws exactly what an uninterrupted one would."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .data.augment import augment_batch
from .levels import Level, System
from .train import LocalWork, client_batches


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (seed, round, client, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> 1)


@enum.unique
class Stream(enum.IntEnum):
    """What a seeded stream is for: the integer after (seed, round) in every `derive_seed` call. Every tag of
    the package is declared here, once: two uses sharing a tag would silently draw correlated numbers."""
    SAMPLING = 0   # who trains in a round, at which level (sample_clients)
    BATCHES = 1    # a client's batches and augmentation (client_job)
    DROPOUT = 2    # torch's global stream while a client trains (dropout_seed)
    METHOD = 3     # a method's own draws (fedlase.methods.base.Method.generator)
    ATTACK = 4     # simulated attacks: who attacks, and each attack's noise (fedlase/server_step.py)
    PRIVACY = 5    # differential privacy: the noise on a round's sum and on its clipped count (fedlase/privacy.py)
    POPULATION = 6     # each client's speed and bandwidth factors (fedlase/population.py)
    AVAILABILITY = 7   # each client's online/offline durations (fedlase/population.py)
    HYPERNET = 8       # RecipFL's hypernetwork: its initialisation, and its dropout while generating a client's model
    FINETUNE = 9       # the batches of a client's fine-tune before its local evaluation (eval_finetune)


@dataclass(frozen=True)
class Sampling:
    """What decides who trains in a round and at which level: the run's seed, its system of levels, the
    participation fractions (one drawn per round) and the assignment of levels to clients. A view of the
    validated config (`from_config`), with no defaults of its own."""
    seed: int
    system: System
    participation: tuple[float, ...]
    assignment: str   # fixed, random or dynamic (see sample_clients)

    @classmethod
    def from_config(cls, cfg) -> Sampling:
        return cls(cfg.seed, cfg.levels, tuple(cfg.participation), cfg.assignment)


def sample_clients(plan: Sampling, rnd: int) -> list[tuple[int, Level]]:
    """(client, level) pairs of round `rnd`, sorted by client id.

    fixed: each client keeps the level of its index; random: the system's counts permuted over clients;
    dynamic: each sampled client's level drawn independently, with probabilities proportional to the counts."""
    rng = np.random.default_rng(derive_seed(plan.seed, rnd, Stream.SAMPLING))
    system, n = plan.system, plan.system.num_clients
    frac = plan.participation[rng.integers(len(plan.participation))]
    chosen = np.sort(rng.choice(n, size=max(1, int(round(frac * n))), replace=False))
    index = list(system.client_level)
    if plan.assignment == "random":
        index = list(rng.permutation(index))
    elif plan.assignment == "dynamic":
        p = np.array([lv.count for lv in system.levels], dtype=np.float64)
        drawn = rng.choice(len(system.levels), size=len(chosen), p=p / p.sum())
        return [(int(c), system.levels[int(i)]) for c, i in zip(chosen, drawn)]
    return [(int(c), system.levels[int(index[c])]) for c in chosen]


def client_job(seed: int, work: LocalWork, train_idx: torch.Tensor, rnd: int, client: int,
               augment: bool) -> tuple[list[torch.Tensor], Callable | None]:
    """The client's local batches (index tensors into the training set) and augmentation for this round,
    from its own seeded stream; every training path (sequential, batched, Flower, bench) draws them here."""
    gen = torch.Generator().manual_seed(derive_seed(seed, rnd, Stream.BATCHES, client))
    positions = client_batches(len(train_idx), work, gen)
    # one gather for the whole round's batches, then cut (the same indices as batch by batch)
    batches = list(train_idx[torch.cat(positions).to(train_idx.device, non_blocking=True)].split(
        [len(b) for b in positions]))
    return batches, (lambda xb: augment_batch(xb, gen)) if augment else None


def dropout_seed(seed: int, rnd: int, client: int) -> int:
    """The seed of the global torch stream while a client trains (dropout draws from it)."""
    return derive_seed(seed, rnd, Stream.DROPOUT, client)


def seed_global_stream(seed: int, device: torch.device) -> None:
    """Seed torch's global generator of `device` (the CPU's, or the current CUDA device's), where dropout draws.
    `torch.manual_seed` would also queue a lazy seeding of every accelerator backend, with a stack trace each
    call (~1 ms a client on a CPU machine)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
