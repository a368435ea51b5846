"""A node's own data, and only it: the client's training samples cut once from the dataset and kept in a
node-local cache, so every later ClientApp process (Flower starts one per message) loads a few arrays in
milliseconds instead of the whole dataset and its partition.

The cache key is everything that decides which samples a partition holds (dataset, its folder, tokenization,
partition scheme and options, seed, system) plus the partition id; a changed setting gives a new entry."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..data import Dataset
from ..client import ClientSettings, ClientTrainer, build_model_for, client_splits
from ..registry import DATASETS

# Config keys that decide a partition's samples.
DATA_KEYS = ("dataset", "data_dir", "model", "model_path", "max_length", "partition", "alpha",
             "classes_per_client", "seed", "system", "local_test_ratio")


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDLASE_CACHE", Path.home() / ".cache" / "fedlase")) / "clients"


def cache_key(cfg, pid: int) -> str:
    spec = json.dumps({k: getattr(cfg, k) for k in DATA_KEYS}, sort_keys=True, default=str)
    return f"{hashlib.sha256(spec.encode()).hexdigest()[:20]}-{pid}"


def client_dataset(cfg, pid: int, cache_dir: Path | None = None) -> Dataset:
    """Partition `pid`'s training samples as a Dataset (no test data: evaluation is central)."""
    folder = (cache_dir or default_cache_dir()) / cache_key(cfg, pid)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        # copy-on-write maps: a message reads only the pages of the samples it trains on
        x = torch.from_numpy(np.load(folder / "x.npy", mmap_mode="c"))
        y = torch.from_numpy(np.load(folder / "y.npy", mmap_mode="c"))
    else:
        data = DATASETS.get(cfg.dataset).load(cfg)
        train, _ = client_splits(cfg, data.y_train.numpy(), data.y_test.numpy(), data.num_classes)
        idx = torch.as_tensor(train[pid])
        x, y = data.x_train[idx].contiguous(), data.y_train[idx].contiguous()
        meta = {"name": data.name, "num_classes": data.num_classes, "augment": data.augment}
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "x.npy", x.numpy())
        np.save(tmp / "y.npy", y.numpy())
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.replace(tmp, folder)   # atomic: a concurrent process may have written it first
        except OSError:
            pass
    return Dataset(meta["name"], x, y, x[:0], y[:0], meta["num_classes"], meta["augment"])


def client_trainer(cfg, pid: int, device: torch.device, cache_dir: Path | None = None,
                   data: Dataset | None = None) -> ClientTrainer:
    """What partition `pid`'s node needs to train: its samples (`data`, else from the cache), the model, the
    local work."""
    if cfg.threads:   # as the embedded engine does: the run's torch CPU threads hold on the nodes too
        torch.set_num_threads(cfg.threads)
    data = data if data is not None else client_dataset(cfg, pid, cache_dir)
    model = build_model_for(cfg, data).to(device)
    x, y = data.x_train.to(device), data.y_train.to(device)
    return ClientTrainer(ClientSettings.from_config(cfg), model, x, y, {pid: torch.arange(len(y), device=device)},
                         data.augment)
