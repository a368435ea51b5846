"""The Python API: build a config, run an experiment, read its results, and add your own method, dataset or
model. Everything here is also importable from `fedlase` itself (see docs/library.md).

    import fedlase
    cfg = fedlase.make_config(dataset="digits", method="fedlase", rounds=5, out="runs/lib")
    summary = fedlase.run(cfg)
    rows = fedlase.read_metrics("runs/lib")
"""
from __future__ import annotations

import json
from pathlib import Path

from .catalog import load_builtins
from .config import Config, config_from_dict, load_config
from .dispatch import run_config
from .errors import RunExists


def make_config(path: str | None = None, **settings) -> Config:
    """A validated Config from an optional YAML file and keyword settings (dotted keys as nested dicts:
    `method_args={"score": "max"}`). Bad values raise fedlase.errors.ConfigError naming the key."""
    load_builtins()
    if path is None:
        return config_from_dict(settings)
    return load_config(path, [f"{k}={json.dumps(v)}" if not isinstance(v, str) else f"{k}={v}"
                              for k, v in settings.items()])


def run(cfg: Config, resume: bool = False, progress: bool = False) -> dict:
    """Run (or resume) the experiment on the engine its config names; returns summary.json's content. Warns once
    when torch's idle threads will spin (torch imported before fedlase, fedlase.openmp.warn_spinning_openmp)."""
    from .openmp import warn_spinning_openmp
    if cfg.device != "cuda":
        warn_spinning_openmp(cfg.threads)
    try:
        return run_config(cfg, resume=resume, progress=progress)
    except RunExists as e:   # the engines word it for the command line's --resume
        raise RunExists(e.out, "pass resume=True") from None


def read_summary(out: str | Path) -> dict:
    """A finished run's summary.json: its config and final evaluation."""
    return json.loads((Path(out) / "summary.json").read_text())


def read_metrics(out: str | Path) -> list[dict]:
    """A run's metrics.jsonl: one dict per evaluation (round, train_loss, per-level accuracies, ...)."""
    path = Path(out) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
