"""The client side: what a client needs to train its submodel, and nothing of the server's round loop.

The embedded engine (fedlase/engine.py) holds one `ClientTrainer` for every client; a Flower ClientApp builds
one for its own partition only. Both compute the same delta from the same seeded batches (fedlase/sampling.py)
and the same local training (fedlase/train.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .data.partition import local_test_split
from .errors import UserError
from .masks import Submodel
from .registry import ADAPTERS, MODELS, PARTITIONS
from .resources import check_clients
from .sampling import client_job, dropout_seed, seed_global_stream
from .train import LocalWork, class_keep, classifier_names, label_split_masks, local_train, restrict_submodel

if TYPE_CHECKING:
    from .config import Config

__all__ = ["ClientSettings", "ClientTrainer", "build_model_for", "client_splits", "local_work", "pick_device"]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was asked for but torch sees no CUDA device; use device=cpu or auto")
    return torch.device(name)


def client_splits(cfg: Config, y_train: np.ndarray, y_test: np.ndarray, num_classes: int):
    """Each client's training indices (the configured partition) and local test indices."""
    n = cfg.num_clients
    check_clients(n, len(y_train), cfg.dataset)   # a node cutting its data may not have run the config's checks
    train = PARTITIONS.get(cfg.partition).split(y_train, n, cfg)
    ratio = cfg.local_test_ratio or len(y_test) / len(y_train)
    test = local_test_split([y_train[i] for i in train], y_test, num_classes, ratio, seed=cfg.seed)
    return train, test


def build_model_for(cfg: Config, data) -> torch.nn.Module:
    """The global model, initialised from the run's seed (what fedlase learns about it is kept beside it:
    fedlase/model_facts.py); under `lora`, with adapters on its transformer, which is then frozen."""
    from . import models  # noqa: F401 -- here: importing fedlase.models registers the built-in models
    torch.manual_seed(cfg.seed)
    model = MODELS.get(cfg.model).build(cfg, data)
    if cfg.lora:   # the adapters are the trainable set (registered by fedlase/llm/adapters.py)
        model = ADAPTERS.get("lora")(model, cfg.lora, cfg.seed)
    return model


@dataclass(frozen=True)
class ClientSettings:
    """The settings a client trains under: the run's seed (its batches and dropout streams), the local work,
    whether a width slice trains as the smaller model, and HeteroFL's label split. A view of the validated
    config (`from_config`), with no defaults of its own."""
    seed: int
    work: LocalWork
    sliced: bool          # false: a width slice trains as masks over the full model (for checking)
    label_split: bool     # each client trains and is credited with its classes' classifier rows only

    @classmethod
    def from_config(cls, cfg: Config) -> ClientSettings:
        """The view of a validated config (built once per run, by fedlase.engine.build_parts)."""
        return cls(cfg.seed, local_work_of(cfg), cfg.sliced, cfg.label_split)


def local_work_of(cfg: Config) -> LocalWork:
    """The local work a validated config asks for."""
    return LocalWork(cfg.local_steps, cfg.local_epochs, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.momentum,
                     cfg.weight_decay, tuple(cfg.betas), cfg.clip_norm, cfg.precision, cfg.task)


def local_work(**settings) -> LocalWork:
    """The config's default local work with `settings` changed, for code that trains a client outside a run
    (checks, tools): the defaults are the Config's, the one place they are written."""
    from .config import Config
    return dataclasses.replace(local_work_of(Config()), **settings)


class ClientTrainer:
    """What a client needs to train and nothing more: the model, the training tensors, each client's index
    array, and its settings. A Flower ClientApp builds one for its own partition only."""

    def __init__(self, settings: ClientSettings, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 train_idx: dict[int, torch.Tensor], augment: bool):
        self.settings, self.model, self.x, self.y = settings, model, x, y
        self.train_idx, self.augment = train_idx, augment
        self.work = settings.work
        # label_split: each client's classes (HeteroFL/FedRolex `mask=1`) as a bool vector over the model's
        # classes, from its own training labels; the loss, the classifier rows and the local metric use it
        self.classes = None
        if settings.label_split:
            params = dict(model.named_parameters())
            num_classes = params[classifier_names(model)[0]].shape[0]
            self.classes = {c: class_keep(torch.unique(y[i]), num_classes, y.device) for c, i in train_idx.items()}

    def job(self, client: int, rnd: int):
        """The client's batches and augmentation for this round (`sampling.client_job`)."""
        return client_job(self.settings.seed, self.work, self.train_idx[client], rnd, client, self.augment)

    def update(self, client: int, params: dict, buffers: dict, sub: Submodel, rnd: int,
               scatter: bool = True) -> tuple[dict, float]:
        """The client's delta (zero outside its submodel; a width slice's as its small tensors unless
        `scatter`) and mean training loss for this round."""
        batches, augment = self.job(client, rnd)
        devices = [self.x.device] if self.x.device.type == "cuda" else []
        local = sub.local   # its own objective's hooks (methods/base.py, LocalObjective): pFedLMT's own part
        if local is not None:
            params = local.params_for(client, params, sub)
        with torch.random.fork_rng(devices=devices):   # dropout draws from the client's own stream
            seed_global_stream(dropout_seed(self.settings.seed, rnd, client), self.x.device)
            delta, loss = local_train(self.model, params, buffers, self.trained(sub), self.x, self.y, batches,
                                      self.work, augment, self.classes[client] if self.classes is not None else None,
                                      scatter)
        return (delta if local is None else local.finish(client, params, sub, delta)), loss

    def trained(self, sub: Submodel) -> Submodel:
        """The submodel as this client trains it: a width slice as masks over the full model under
        sliced=false (the path kept for checking), else as it is."""
        return sub.masked() if sub.slices and not self.settings.sliced else sub

    def submodel(self, client: int, sub: Submodel, params: dict) -> Submodel:
        """The client's own submodel: its level's (or the one the method gave it, `Submodel.own`), restricted to
        its classes' classifier rows under label_split (so only those rows are trained, sent and credited)."""
        sub = sub.own.get(client, sub)
        if self.classes is None:
            return sub
        return restrict_submodel(sub, label_split_masks(params, *classifier_names(self.model), self.classes[client]))
