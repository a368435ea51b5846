"""Registries: the one place each kind of choice (dataset, model, partition, method, analysis) is named.

Config validation, `fedlase methods`, sweeps and Flower all read choices from here, so a dataset, model or
method registered from outside the package (a `register` call before the run, or a `fedlase.plugins` entry
point) is as valid as a built-in one. This module imports nothing of fedlase but its errors, so anything
may import it; the built-ins register themselves when `fedlase.catalog` imports their modules."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> entry, in registration order. `key` is the config key whose values these names are."""

    def __init__(self, key: str):
        self.key = key
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T, replace: bool = False) -> T:
        if not replace and name in self._entries:
            raise ValueError(f"{self.key} {name!r} is registered already (pass replace=True to override it)")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry, or a one-line ConfigError naming the key and every registered name."""
        if name not in self._entries:
            raise ConfigError(self.key, f"{name!r} is not one of {', '.join(self._entries)}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries


@dataclass(frozen=True)
class DatasetEntry:
    """load(cfg) -> fedlase.data.Dataset. `num_classes` is known before loading (config checks use it);
    `kind` ('image' or 'text') must match the model's."""
    load: Callable[[Any], Any]
    num_classes: int
    kind: str = "image"
    help: str = ""
    needs_data_dir: bool = False
    shape: tuple[int, ...] | None = None   # one input's shape, known before loading (for checks); None: varies


@dataclass(frozen=True)
class ModelEntry:
    """build(cfg, dataset) -> nn.Module (dataset: the loaded fedlase.data.Dataset)."""
    build: Callable[[Any, Any], Any]
    kind: str = "image"
    help: str = ""


@dataclass(frozen=True)
class PartitionEntry:
    """split(labels, num_clients, rng_seed, cfg) -> list of index arrays, one per client."""
    split: Callable[..., Any]
    help: str = ""
    options: tuple[str, ...] = field(default=())   # config keys it reads (alpha, classes_per_client)


DATASETS: Registry[DatasetEntry] = Registry("dataset")
MODELS: Registry[ModelEntry] = Registry("model")
PARTITIONS: Registry[PartitionEntry] = Registry("partition")
METHODS: Registry[type] = Registry("method")     # Method subclasses
TRACKERS: Registry[type] = Registry("analysis")  # Tracker subclasses


def register_dataset(name: str, load: Callable, num_classes: int, kind: str = "image", help: str = "",
                     needs_data_dir: bool = False, replace: bool = False,
                     shape: tuple[int, ...] | None = None) -> DatasetEntry:
    """Make `dataset=name` valid everywhere: load(cfg) returns a fedlase.data.Dataset."""
    return DATASETS.add(name, DatasetEntry(load, num_classes, kind, help, needs_data_dir, shape), replace)


def register_model(name: str, build: Callable, kind: str = "image", help: str = "",
                   replace: bool = False) -> ModelEntry:
    """Make `model=name` valid everywhere: build(cfg, dataset) returns an nn.Module."""
    return MODELS.add(name, ModelEntry(build, kind, help), replace)


def register_partition(name: str, split: Callable, help: str = "", options: tuple[str, ...] = (),
                       replace: bool = False) -> PartitionEntry:
    return PARTITIONS.add(name, PartitionEntry(split, help, options), replace)


def register_method(cls: type, replace: bool = False) -> type:
    """Make `method=cls.name` valid everywhere; usable as a class decorator."""
    METHODS.add(cls.name, cls, replace)
    return cls


def register_tracker(cls: type, replace: bool = False) -> type:
    TRACKERS.add(cls.key, cls, replace)
    return cls
