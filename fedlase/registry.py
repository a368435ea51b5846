"""Registries: the one place each kind of choice (dataset, model, partition, method, analysis, server rule,
attack) is named.

Config validation, `fedlase methods`, sweeps and Flower all read choices from here, so a dataset, model or
method registered from outside the package (a `register` call before the run, or a `fedlase.plugins` entry
point) is as valid as a built-in one. This module imports nothing of fedlase but its errors, so anything
may import it. The built-ins are registered where a program starts (the CLI, `fedlase.make_config`/`fedlase.run`,
Flower's apps, a sweep's child processes) by `fedlase.catalog.load_builtins()`, so importing the config or the
engine loads no method, model or dataset module.

Registering the same definition again is a no-op, so a plugin module may be imported twice: once as the
running script (`__main__`) and once by its name (the `plugins` key). Another definition under a taken name is
an error unless `replace=True`. `with temporary():` undoes every registration made inside it (tests, sessions that
try a plugin for a while)."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")

KINDS = ("image", "text")   # a dataset's and a model's `kind`; they must match


def _origin(obj) -> tuple:
    """Where a class or function is defined: (source file, qualified name, line of a function). The same
    definition imported twice (as `__main__` and by its module name) has one origin."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    code = getattr(obj, "__code__", None)
    return (os.path.realpath(path) if path else getattr(obj, "__module__", None), getattr(obj, "__qualname__", None),
            code.co_firstlineno if code else None)


def same_definition(a, b) -> bool:
    """True when two registered entries are one definition (a plugin module imported twice)."""
    if a is b:
        return True
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return all(same_definition(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if hasattr(a, "__qualname__") and hasattr(b, "__qualname__"):
        cells = [[c.cell_contents for c in getattr(f, "__closure__", None) or ()] for f in (a, b)]
        return _origin(a) == _origin(b) and len(cells[0]) == len(cells[1]) and \
            all(same_definition(x, y) for x, y in zip(*cells))
    return a == b


class Registry(Generic[T]):
    """name -> entry, in registration order. `key` is the config key whose values these names are."""
    every: list[Registry] = []   # all registries, in creation order (what `temporary()` restores by default)

    def __init__(self, key: str):
        self.key = key
        self._entries: dict[str, T] = {}
        Registry.every.append(self)

    def add(self, name: str, entry: T, replace: bool = False) -> T:
        """Register `entry` as `name`; the same definition again is a no-op (the first one stays)."""
        if name in self._entries and not replace:
            if same_definition(self._entries[name], entry):
                return self._entries[name]
            raise ValueError(f"{self.key} {name!r} is registered already (pass replace=True to override it)")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        """The entry, or a one-line ConfigError naming the key and every registered name."""
        if name not in self._entries:
            if not self._entries:   # a program that never called load_builtins()
                raise ConfigError(self.key, f"{name!r}: no {self.key} is registered; call "
                                  "fedlase.catalog.load_builtins() first (the CLI and fedlase.make_config do)")
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


@contextlib.contextmanager
def temporary(*registries: Registry) -> Iterator[None]:
    """On leaving the block, `registries` (default: all) hold exactly what they held on entering it: a name
    registered inside is gone, an entry replaced inside is back."""
    saved = [(r, dict(r._entries)) for r in registries or Registry.every]
    try:
        yield
    finally:
        for r, entries in saved:
            r._entries = entries


@dataclass(frozen=True)
class DatasetEntry:
    """load(cfg) -> fedlase.data.Dataset. `num_classes` is known before loading (config checks use it);
    `kind` ('image' or 'text') must match the model's.

    `check(cfg)`, optional, runs at config validation, before anything is loaded: it raises ConfigError on a
    value this dataset cannot take, and may return what it knows of the data without loading it, a dict with
    any of `train`/`test` (sample counts), `bytes` (what loading it will hold in memory) and `key` (the config
    key `bytes` scales with; default `dataset`).

    `needs_data_dir`: a config must set data_dir; `reads_data_dir` false: the data comes with the package, and
    a data_dir (which it would ignore) is refused."""
    load: Callable[[Any], Any]
    num_classes: int
    kind: str = "image"
    help: str = ""
    needs_data_dir: bool = False
    shape: tuple[int, ...] | None = None   # one input's shape, known before loading (for checks); None: varies
    check: Callable[[Any], dict | None] | None = None
    reads_data_dir: bool = True
    # texts(cfg) -> (documents, labels, train indices, test indices, a hash of the data): the raw texts, for a
    # task that cuts them its own way (task=lm's blocks, fedlase/llm/lm_task.py); None: task=classify only
    texts: Callable[[Any], tuple] | None = None


@dataclass(frozen=True)
class ModelEntry:
    """build(cfg, dataset) -> nn.Module (dataset: the loaded fedlase.data.Dataset).

    `check(cfg)`, optional, runs at config validation, before the model is built: it raises ConfigError on a
    value this model cannot take (max_length beyond its positions) and may return the model's sizes for the
    memory checks of fedlase/resources.py (`check_run`): `params` (parameter count), `sample_bytes` (all the
    activations of one sample's forward) and `largest_bytes` (its largest activation). Without them, the
    sizes are measured on torch's meta device (`resources.model_sizes`)."""
    build: Callable[[Any, Any], Any]
    kind: str = "image"
    help: str = ""
    check: Callable[[Any], dict | None] | None = None
    tasks: tuple[str, ...] = ("classify",)   # the `task` values it serves
    # tokenizer(cfg) -> (identity hash, load()): a model whose tokenizer is not its folder's files (a GGUF
    # decoder's); None: the text datasets read model_path's (or the packaged MiniLM's) tokenizer files
    tokenizer: Callable[[Any], tuple] | None = None


@dataclass(frozen=True)
class TaskEntry:
    """What a model is trained for besides `classify` (the built-in default, not registered: cross-entropy of
    the logits against the labels, accuracy).

    load(cfg, dataset_entry) -> fedlase.data.Dataset: its samples (its y: what the partitions split by);
    loss(output, xb, yb) -> one batch's scalar loss, what every client trains on (fedlase/train.py);
    score(output, xb, yb) -> (summed loss, counted targets, correct predictions) of a batch, what evaluation
    sums (fedlase/evaluate.py); check(cfg), optional: a ConfigError for what it cannot run."""
    load: Callable[[Any, Any], Any]
    loss: Callable[..., Any]
    score: Callable[..., Any]
    check: Callable[[Any], None] | None = None
    help: str = ""


@dataclass(frozen=True)
class PartitionEntry:
    """split(labels, num_clients, cfg) -> list of index arrays, one per client (cfg: the validated Config:
    seed, alpha, classes_per_client, ...)."""
    split: Callable[..., Any]
    help: str = ""


DATASETS: Registry[DatasetEntry] = Registry("dataset")
MODELS: Registry[ModelEntry] = Registry("model")
PARTITIONS: Registry[PartitionEntry] = Registry("partition")
METHODS: Registry[type] = Registry("method")     # Method subclasses
TRACKERS: Registry[type] = Registry("analysis")  # Tracker subclasses
RULES: Registry[type] = Registry("robust")       # server rules: fedlase.server_step.Rule subclasses
ATTACKS: Registry[type] = Registry("attack")     # simulated attacks: fedlase.robust_config.Attack subclasses
TASKS: Registry[TaskEntry] = Registry("task")    # tasks besides the built-in classify
# attach(model, checked options, seed) -> the model with adapters as its trainable set, by the config key that
# asks for them (`lora`: fedlase/llm/adapters.py); the core builds a model through it without importing the llm
ADAPTERS: Registry[Callable] = Registry("adapters")


def task_names() -> tuple[str, ...]:
    """The `task` values: classify, then the registered ones."""
    return ("classify", *TASKS.names())


def load_dataset(cfg):
    """The run's data: the dataset's own load for task=classify, else the task's load of the dataset."""
    entry = DATASETS.get(cfg.dataset)
    task = getattr(cfg, "task", "classify")
    return entry.load(cfg) if task == "classify" else TASKS.get(task).load(cfg, entry)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def register_dataset(name: str, load: Callable, num_classes: int, kind: str = "image", help: str = "",
                     needs_data_dir: bool = False, replace: bool = False,
                     shape: tuple[int, ...] | None = None, check: Callable | None = None,
                     reads_data_dir: bool = True, texts: Callable | None = None) -> DatasetEntry:
    """Make `dataset=name` valid everywhere: load(cfg) returns a fedlase.data.Dataset."""
    return DATASETS.add(name, DatasetEntry(load, num_classes, _check_kind(kind), help, needs_data_dir, shape,
                                           check, reads_data_dir, texts), replace)


def register_model(name: str, build: Callable, kind: str = "image", help: str = "",
                   replace: bool = False, check: Callable | None = None,
                   tasks: tuple[str, ...] = ("classify",), tokenizer: Callable | None = None) -> ModelEntry:
    """Make `model=name` valid everywhere: build(cfg, dataset) returns an nn.Module; `tasks`: the `task` values
    it serves."""
    return MODELS.add(name, ModelEntry(build, _check_kind(kind), help, check, tuple(tasks), tokenizer), replace)


def register_task(name: str, load: Callable, loss: Callable, score: Callable, check: Callable | None = None,
                  help: str = "", replace: bool = False) -> TaskEntry:
    """Make `task=name` valid everywhere (see TaskEntry)."""
    return TASKS.add(name, TaskEntry(load, loss, score, check, help), replace)


def register_adapters(key: str, attach: Callable, replace: bool = False) -> Callable:
    """Make the config key `key` (a mapping of options) put adapters on a model: attach(model, options, seed)
    returns the model whose trainable set they are (fedlase.client.build_model_for calls it)."""
    return ADAPTERS.add(key, attach, replace)


def register_partition(name: str, split: Callable, help: str = "", replace: bool = False) -> PartitionEntry:
    """Make `partition=name` valid everywhere: split(labels, num_clients, cfg) returns each client's indices."""
    return PARTITIONS.add(name, PartitionEntry(split, help), replace)


def register_method(cls: type, replace: bool = False) -> type:
    """Make `method=cls.name` valid everywhere; usable as a class decorator."""
    METHODS.add(cls.name, cls, replace)
    return cls


def register_tracker(cls: type, replace: bool = False) -> type:
    TRACKERS.add(cls.key, cls, replace)
    return cls


def check_analysis(value) -> dict[str, dict]:
    """The `analysis` config value -> {name: options} of the trackers switched on, in registry order (a
    checkpoint stores tracker states as a list). `false` (or null) switches an analysis off."""
    if not isinstance(value, dict):
        raise ConfigError("analysis", f"expected a mapping such as {{ratios: true}}, got {value!r}")
    for name in value:
        if name not in TRACKERS:
            raise ConfigError(f"analysis.{name}", f"unknown analysis; known: {', '.join(TRACKERS.names())}")
    return {name: cls.parse_options(value[name]) for name, cls in TRACKERS.items()
            if value.get(name) not in (None, False)}


def import_plugins(modules) -> None:
    """Import the `plugins` modules (each registers its methods, datasets, models); ConfigError if one fails.
    A module that Python's path lacks is looked for in the working folder too (`_from_working_folder`)."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
        raise ConfigError("plugins", f"expected a list of module names, got {modules!r}")
    for name in modules:
        try:
            _import_plugin(name)
        except ConfigError:
            raise
        except Exception as e:   # the user's module: report it in one line, whatever it raised
            raise ConfigError("plugins", f"cannot import {name!r}: {type(e).__name__}: {e}") from None


def _import_plugin(name: str) -> None:
    top = name.partition(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    folder = _from_working_folder(name, top, found)
    if folder is None:
        importlib.import_module(name)
        return
    sys.path.append(folder)   # last: it can only add modules, never replace an installed one
    try:
        importlib.import_module(name)
    finally:
        if sys.path and sys.path[-1] == folder:
            sys.path.pop()


def _from_working_folder(name: str, top: str, found: bool) -> str | None:
    """The working folder, when the plug-in `name` is to be imported from it (a user runs fedlase beside their
    my_methods.py; the `fedlase` script, unlike `python -m`, has no working folder on Python's path); None when
    Python's path has it. The rules that keep a folder from changing what else runs: the folder is searched last
    and only while the plug-ins are imported; a module there named like one of Python's own or fedlase is refused
    (the other one would win unnoticed); a folder that other users may write is not searched. One line says why
    a plug-in is not found, and where it was looked for."""
    try:
        here = os.getcwd()
    except OSError:   # the working folder is gone
        here = None
    local = here is not None and any(os.path.exists(os.path.join(here, f)) for f in (top + ".py", top))
    if local and (top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "fedlase"):
        owner = "fedlase" if top == "fedlase" else f"Python's module {top}"
        theirs = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the folder fedlase is imported from
        if top != "fedlase" or os.path.realpath(here) != os.path.realpath(theirs):
            raise ConfigError("plugins", f"cannot import {name!r}: {top} in the working folder {here} is named "
                              f"like {owner}, which Python would import instead; give the plug-in a name of its own")
    if found:
        return None
    if not local:
        raise ConfigError("plugins", f"cannot import {name!r}: no module {top!r} on Python's path or in the working "
                          f"folder {here}; run fedlase where {top}.py is, or put its folder on PYTHONPATH "
                          f"(PYTHONPATH=/path/to/folder fedlase ...)")
    info = os.stat(here)
    if info.st_mode & stat.S_IWOTH or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        raise ConfigError("plugins", f"cannot import {name!r}: the working folder {here} may be written by other "
                          f"users, so fedlase imports no plug-in from it; put the folder on PYTHONPATH if you trust "
                          f"it, or move {top} to a folder of your own")
    return here


def register_rule(cls: type, replace: bool = False) -> type:
    """Make `robust=cls.name` valid everywhere (a fedlase.server_step.Rule subclass); a class decorator."""
    RULES.add(cls.name, cls, replace)
    return cls


def register_attack(cls: type, replace: bool = False) -> type:
    """Make `attack=cls.name` valid everywhere (a fedlase.server_step.Attack subclass); a class decorator."""
    ATTACKS.add(cls.name, cls, replace)
    return cls
