"""What a config may say of its data: the dataset against the model (image or text), where the data lies, the
partition's classes, the local work, the participation; and the text track's own keys. Read from the registry
(never a dataset module), so validating a config stays cheap (fedlase/config.py)."""
from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .levels import parse_level
from .registry import DATASETS, MODELS, TASKS


def check_data(cfg):
    """ConfigError (one line, naming the key) for data the run cannot use; returns (dataset, model) entries."""
    data, model = DATASETS.get(cfg.dataset), MODELS.get(cfg.model)
    if data.kind != model.kind:
        fitting = ", ".join(n for n, m in MODELS.items() if m.kind == data.kind)
        raise ConfigError("model", f"{cfg.model} is a model for {model.kind} data but dataset {cfg.dataset} is "
                          f"{data.kind}; pick a {data.kind} model ({fitting})")
    if cfg.local_epochs is None and cfg.local_steps is None:
        raise ConfigError("local_steps", "must be a positive integer (or set local_epochs)")
    if cfg.partition == "pathological" and cfg.classes_per_client > data.num_classes:
        raise ConfigError("classes_per_client", f"must be between 1 and the {data.num_classes} classes of "
                          f"{cfg.dataset}, got {cfg.classes_per_client}")
    if cfg.data_dir is not None and not data.reads_data_dir:
        folders = ", ".join(n for n, d in DATASETS.items() if d.reads_data_dir)
        raise ConfigError("data_dir", f"dataset {cfg.dataset} is bundled with its package and reads no folder; drop "
                          f"data_dir (the datasets read from one: {folders})")
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise ConfigError("data_dir", f"folder {cfg.data_dir!r} does not exist")
    if data.needs_data_dir and cfg.data_dir is None:
        raise ConfigError("data_dir", f"dataset {cfg.dataset} needs data_dir: the folder holding its files")
    check_task(cfg, data, model)
    if cfg.head_norm != "none" and model.kind != "text":
        raise ConfigError("head_norm", f"applies to text models; {cfg.model} is an image model "
                          "(its BN layers follow `bn`)")
    return data, model


def check_task(cfg, data, model) -> None:
    """`task` against the model (its entry's `tasks`), the dataset (a task other than classify reads its texts)
    and the task's own check."""
    task = getattr(cfg, "task", "classify")
    if task not in model.tasks:
        fitting = ", ".join(n for n, m in MODELS.items() if task in m.tasks) or "none registered"
        raise ConfigError("task", f"model {cfg.model} does not run task={task} (it runs {', '.join(model.tasks)}); "
                          f"models that do: {fitting}")
    if task == "classify":
        return
    if data.texts is None:
        fitting = ", ".join(n for n, d in DATASETS.items() if d.texts is not None) or "none registered"
        raise ConfigError("dataset", f"{cfg.dataset} has no documents for task={task}; datasets that do: {fitting}")
    entry = TASKS.get(task)
    if entry.check is not None:
        entry.check(cfg)


def parse_participation(value) -> list[float]:
    """0.1, [0.1, 0.2] or '{0.1,0.15,0.2}' -> a list of fractions in (0, 1]."""
    allowed = "a fraction in (0,1] or a set of them such as {0.1,0.15,0.2}"
    if isinstance(value, str):
        value = value.strip().strip("{}[]").split(",")
    if isinstance(value, dict) and value and all(v is None for v in value.values()):
        value = list(value)   # YAML reads an unquoted {0.1, 0.15} in a config file as a set-like mapping
    if not isinstance(value, (list, tuple)):
        value = [value]
    try:
        out = [float(parse_level(v)) for v in value]
    except (ValueError, ZeroDivisionError):
        raise ConfigError("participation", f"cannot read {value!r}; {allowed}") from None
    if not out or any(not 0 < p <= 1 for p in out):
        raise ConfigError("participation", f"{value!r} is outside (0,1]; {allowed}")
    return out
