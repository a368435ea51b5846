"""Datasets (loaded once, shared by all clients), their partitions over clients, and training-time augmentation.

Importing this package loads only the partition code: the loaders and the augmentation are loaded on first use,
and the built-ins are registered by fedlase/data/builtins.py (through fedlase.catalog.load_builtins). So the
engine, which needs the partition and augmentation code, loads no dataset loader and registers nothing."""
import importlib

# the partition code is light and the engine needs it; importing it here also keeps the name `partition` the
# function, not the submodule of the same name
from fedlase.data.partition import SCHEMES, local_test_split, partition

_NAMES = {"DEFAULT_DATA_DIRS": "sources", "IMAGE_DATASETS": "sources", "Dataset": "sources",
          "load_dataset": "sources", "augment_batch": "augment"}
__all__ = sorted([*_NAMES, "SCHEMES", "local_test_split", "partition"])


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'fedlase.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fedlase.data.{_NAMES[name]}"), name)
