"""A node's own data, and only it: the client's training samples cut once from the dataset and kept in a
node-local cache, so every later ClientApp process (Flower starts one per message) loads a few arrays in
milliseconds instead of the whole dataset and its partition.

The cache key is derived, not listed: the config keys that the dataset's loader and the partitioner actually read
(recorded while the first entry of a dataset is cut, kept in `<cache>/<dataset>/keys.json`), their values, and
the partition id. A plugin dataset that reads a key of its own therefore gets a new entry when that key changes.
The key set only grows; an entry is used only if the current values of every key in it match, which is sound
because a loader that reads only those keys computes the same samples from the same values."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..client import ClientSettings, ClientTrainer, build_model_for, client_splits
from ..data import Dataset
from ..machine import apply_threads
from ..registry import load_dataset
from ..util import atomic_write, cache_dir


def default_cache_dir() -> Path:
    """The `clients/` folder of fedlase's cache (fedlase.util.cache_dir(): `$FEDLASE_CACHE`, ...)."""
    return cache_dir() / "clients"


class ReadKeys:
    """The config, noting which of its keys are read (by the dataset's loader and the partitioner)."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


def cache_key(cfg, pid: int, keys) -> str:
    spec = json.dumps({k: getattr(cfg, k) for k in sorted(keys)}, sort_keys=True, default=repr)
    return f"{hashlib.sha256(spec.encode()).hexdigest()[:20]}-{pid}"


def client_dataset(cfg, pid: int, cache_dir: Path | None = None) -> Dataset:
    """Partition `pid`'s training samples as a Dataset (no test data: evaluation is central)."""
    root = (cache_dir or default_cache_dir()) / str(cfg.dataset)
    keys_file = root / "keys.json"
    keys = set(json.loads(keys_file.read_text())) if keys_file.exists() else set()
    folder = root / cache_key(cfg, pid, keys)
    if keys and (folder / "meta.json").exists():
        meta = json.loads((folder / "meta.json").read_text())
        # copy-on-write maps: a message reads only the pages of the samples it trains on
        x = torch.from_numpy(np.load(folder / "x.npy", mmap_mode="c", allow_pickle=False))
        y = torch.from_numpy(np.load(folder / "y.npy", mmap_mode="c", allow_pickle=False))
        return Dataset(meta["name"], x, y, x[:0], y[:0], meta["num_classes"], meta["augment"])
    seen = ReadKeys(cfg)
    data = load_dataset(seen)
    train, _ = client_splits(seen, data.y_train.numpy(), data.y_test.numpy(), data.num_classes)
    idx = torch.as_tensor(train[pid])
    x, y = data.x_train[idx].contiguous(), data.y_train[idx].contiguous()
    meta = {"name": data.name, "num_classes": data.num_classes, "augment": data.augment}
    keys |= seen.read
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(keys_file, lambda t: t.write_text(json.dumps(sorted(keys))))

    def entry(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "x.npy", x.numpy())
        np.save(tmp / "y.npy", y.numpy())
        (tmp / "meta.json").write_text(json.dumps(meta))
    atomic_write(root / cache_key(cfg, pid, keys), entry)
    return Dataset(meta["name"], x, y, x[:0], y[:0], meta["num_classes"], meta["augment"])


def client_trainer(cfg, pid: int, device: torch.device, cache_dir: Path | None = None,
                   data: Dataset | None = None) -> ClientTrainer:
    """What partition `pid`'s node needs to train: its samples (`data`, else from the cache), the model, the
    local work."""
    apply_threads(cfg.threads)   # as the embedded engine does: the run's torch CPU threads hold on the nodes too
    data = data if data is not None else client_dataset(cfg, pid, cache_dir)
    model = build_model_for(cfg, data).to(device)
    x, y = data.x_train.to(device), data.y_train.to(device)
    return ClientTrainer(ClientSettings.from_config(cfg), model, x, y, {pid: torch.arange(len(y), device=device)},
                         data.augment)
