"""The experiment config: one typed record, read from YAML and/or `key=value` overrides, validated once.

Every field carries its help text, so `fedlase run --help` documents every key from this one place."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class Config:
    method: str = _f("fiarse", "submodel method: fedlase, fiarse, heterofl, fedrolex, fedavg, fedavg_small")
    method_args: dict = _f({}, "options of the method, e.g. method_args.score=max (see `fedlase methods`)")
    dataset: str = _f("fashion_mnist", "fashion_mnist, cifar10, cifar100 or digits")
    data_dir: str | None = _f(None, "folder with the data files (default for fashion_mnist: the Debian package's)")
    model: str = _f("cnn", "cnn (small CNN) or resnet18 (CIFAR ResNet-18)")
    width: float = _f(1.0, "width multiplier of the model's channels, > 0")
    bn: str = _f("batch", "batch: batch statistics (FIARSE); static: stats recomputed before evaluation (HeteroFL)")
    system: str = _f("{1,1/4,1/16,1/64}_{10,20,30,40}",
                     "resource levels and client counts, {levels}_{counts}; {1}_{100} is homogeneous")
    assignment: str = _f("fixed", "fixed: levels by client index, for the whole run; random: re-drawn each round")
    partition: str = _f("balanced_dirichlet", "iid, dirichlet, balanced_dirichlet (as FIARSE) or pathological")
    alpha: float = _f(0.3, "Dirichlet concentration for (balanced_)dirichlet, > 0")
    classes_per_client: int = _f(2, "classes per client for pathological, 1..number of classes")
    local_test_ratio: float | None = _f(None, "local test split size / local train size (default: test/train of the data)")
    participation: Any = _f(0.1, "fraction of clients sampled per round, or a set drawn per round, e.g. {0.1,0.15,0.2}")
    local_steps: int | None = _f(20, "local SGD steps per round (set local_epochs instead to train by epochs)")
    local_epochs: float | None = _f(None, "local epochs per round; overrides local_steps when set")
    batch_size: int = _f(32, "local batch size")
    optimizer: str = _f("sgd", "sgd or adamw")
    lr: float = _f(0.05, "learning rate, > 0")
    momentum: float = _f(0.0, "SGD momentum, in [0, 1)")
    weight_decay: float = _f(0.0, "weight decay, >= 0")
    betas: list = _f([0.9, 0.999], "AdamW betas, two numbers in [0, 1)")
    rounds: int = _f(100, "communication rounds")
    eval_every: int = _f(10, "evaluate every N rounds (and always after the last)")
    eval_batch_size: int = _f(1000, "batch size for evaluation")
    seed: int = _f(0, "seed of model init, partition, sampling and local batches")
    device: str = _f("auto", "cpu, cuda or auto")
    threads: int = _f(0, "torch CPU threads (0: torch's default)")
    batched_clients: bool = _f(False, "train a round's clients together in vmapped passes (pays on GPU; same "
                               "result up to float rounding; see docs/benchmarks.md)")
    engine: str = _f("embedded", "embedded (one process), flower-sim (Flower's Simulation Engine) or flower-deploy "
                     "(a running Flower SuperLink; see docs/flower.md)")
    min_replies: int = _f(1, "Flower: good replies a round needs to update the model (else it is left unchanged)")
    reply_timeout: float = _f(600.0, "Flower: seconds the server waits for a round's replies, > 0")
    superlink: str = _f("127.0.0.1:8000", "Flower: the SuperLink address (host:port) that engine=flower-deploy submits to")
    out: str = _f("runs/default", "output folder: metrics.jsonl, summary.json, checkpoint.pt")
    checkpoint_every: int = _f(10, "write a checkpoint every N rounds (0: never)")
    analysis: dict = _f({}, "training-time analyses, e.g. analysis.magnitudes=true (see docs)")

    # filled by validate()
    levels: list = field(default_factory=list, init=False, repr=False, metadata={"derived": True})

    @property
    def client_levels(self) -> list[float]:
        """The resource level of each client, by client index (the `fixed` assignment)."""
        return [lvl for lvl, n in self.levels for _ in range(n)]

    @property
    def num_clients(self) -> int:
        return sum(n for _, n in self.levels)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("derived")}


CHOICES = {
    "dataset": ("fashion_mnist", "cifar10", "cifar100", "digits"),
    "model": ("cnn", "resnet18"),
    "bn": ("batch", "static"),
    "assignment": ("fixed", "random"),
    "partition": ("iid", "dirichlet", "balanced_dirichlet", "pathological"),
    "optimizer": ("sgd", "adamw"),
    "device": ("cpu", "cuda", "auto"),
    "engine": ("embedded", "flower-sim", "flower-deploy"),
}
NUM_CLASSES = {"fashion_mnist": 10, "cifar10": 10, "cifar100": 100, "digits": 10}

_SYSTEM = re.compile(r"^\{([^{}]*)\}_\{([^{}]*)\}$")


def parse_level(text: str) -> float:
    """'1/4' or '0.25' -> 0.25."""
    return float(Fraction(text.strip()))


def parse_system(text: str) -> list[tuple[float, int]]:
    """'{1,1/4,1/16,1/64}_{10,20,30,40}' -> [(1.0, 10), (0.25, 20), (0.0625, 30), (0.015625, 40)]."""
    allowed = "written {levels}_{counts}, e.g. {1,1/4,1/16,1/64}_{10,20,30,40}: levels in (0,1], counts positive integers"
    m = _SYSTEM.match(str(text).replace(" ", ""))
    if not m:
        raise ConfigError("system", f"cannot parse {text!r}; {allowed}")
    lv, ct = m.group(1).split(","), m.group(2).split(",")
    if len(lv) != len(ct):
        raise ConfigError("system", f"{len(lv)} levels but {len(ct)} counts in {text!r}; {allowed}")
    out = []
    for a, b in zip(lv, ct):
        try:
            level = parse_level(a)
        except (ValueError, ZeroDivisionError):
            raise ConfigError("system", f"level {a!r} is not a number or fraction; {allowed}") from None
        if not 0 < level <= 1:
            raise ConfigError("system", f"level {a} is outside (0,1]; {allowed}")
        if not re.fullmatch(r"\d+", b) or int(b) < 1:
            raise ConfigError("system", f"count {b!r} is not a positive integer; {allowed}")
        out.append((level, int(b)))
    if len({lvl for lvl, _ in out}) != len(out):
        raise ConfigError("system", f"a level appears twice in {text!r}")
    return out


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
        out = [float(Fraction(str(v).strip())) for v in value]
    except (ValueError, ZeroDivisionError):
        raise ConfigError("participation", f"cannot read {value!r}; {allowed}") from None
    if not out or any(not 0 < p <= 1 for p in out):
        raise ConfigError("participation", f"{value!r} is outside (0,1]; {allowed}")
    return out


def _coerce(name: str, value, default):
    """Check a value against the type of its field's default."""
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
             list: "a list"}
    want = type(default) if default is not None else None
    if want is None or value is None:
        return value
    if want in (int, float) and isinstance(value, str):   # YAML 1.1 reads '1e-2' as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    if want is str and isinstance(value, (int, float)):
        return str(value)
    raise ConfigError(name, f"expected {kinds.get(want, want.__name__)}, got {value!r}")


_NUMERIC_OPTIONAL = {"data_dir": str, "local_test_ratio": float, "local_steps": int, "local_epochs": float}


def validate(cfg: Config) -> Config:
    """Check every value; fill derived fields. Raises ConfigError naming the key and the allowed values."""
    for f in dataclasses.fields(cfg):
        if f.metadata.get("derived") or f.name in ("participation",):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name in _NUMERIC_OPTIONAL:
            default = _NUMERIC_OPTIONAL[f.name]()
        setattr(cfg, f.name, _coerce(f.name, getattr(cfg, f.name), default))
    for key, allowed in CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(key, f"{getattr(cfg, key)!r} is not one of {', '.join(allowed)}")
    cfg.levels = parse_system(cfg.system)
    cfg.participation = parse_participation(cfg.participation)
    positive = {"width": cfg.width, "lr": cfg.lr, "alpha": cfg.alpha, "batch_size": cfg.batch_size,
                "rounds": cfg.rounds, "eval_every": cfg.eval_every, "eval_batch_size": cfg.eval_batch_size}
    for key, v in positive.items():
        if not v > 0:
            raise ConfigError(key, f"must be > 0, got {v}")
    if cfg.local_epochs is not None and not cfg.local_epochs > 0:
        raise ConfigError("local_epochs", f"must be > 0, got {cfg.local_epochs}")
    if cfg.local_epochs is None and (cfg.local_steps is None or cfg.local_steps < 1):
        raise ConfigError("local_steps", f"must be a positive integer (or set local_epochs), got {cfg.local_steps}")
    if cfg.local_test_ratio is not None and not cfg.local_test_ratio > 0:
        raise ConfigError("local_test_ratio", f"must be > 0, got {cfg.local_test_ratio}")
    if not 0 <= cfg.momentum < 1:
        raise ConfigError("momentum", f"must be in [0, 1), got {cfg.momentum}")
    if cfg.weight_decay < 0:
        raise ConfigError("weight_decay", f"must be >= 0, got {cfg.weight_decay}")
    if len(cfg.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in cfg.betas):
        raise ConfigError("betas", f"must be two numbers in [0, 1), got {cfg.betas}")
    if not cfg.reply_timeout > 0:
        raise ConfigError("reply_timeout", f"must be > 0, got {cfg.reply_timeout}")
    for key in ("checkpoint_every", "threads", "seed", "min_replies"):
        if getattr(cfg, key) < 0:
            raise ConfigError(key, f"must be >= 0, got {getattr(cfg, key)}")
    n_cls = NUM_CLASSES[cfg.dataset]
    if cfg.partition == "pathological" and not 1 <= cfg.classes_per_client <= n_cls:
        raise ConfigError("classes_per_client",
                          f"must be between 1 and the {n_cls} classes of {cfg.dataset}, got {cfg.classes_per_client}")
    from .analysis import check_analysis   # the trackers' own option rules, checked before anything runs
    check_analysis(cfg.analysis)
    if cfg.data_dir is not None and not Path(cfg.data_dir).is_dir():
        raise ConfigError("data_dir", f"folder {cfg.data_dir!r} does not exist")
    if cfg.batched_clients and cfg.engine != "embedded":   # Flower trains each client in its own ClientApp
        raise ConfigError("batched_clients", f"needs engine=embedded, got engine={cfg.engine}")
    return cfg


def set_dotted(d: dict, key: str, value) -> None:
    """Set a dotted key (method_args.score) in a nested dict; a mapping merges into a mapping already there."""
    head, _, rest = key.partition(".")
    if rest:
        sub = d.setdefault(head, {})
        if not isinstance(sub, dict):
            raise ConfigError(head, f"is not a mapping, cannot set {key}")
        set_dotted(sub, rest, value)
    elif isinstance(value, dict) and isinstance(d.get(head), dict):
        for k, v in value.items():
            set_dotted(d[head], str(k), v)
    else:
        d[head] = value


_RAW_STRING_KEYS = {"system", "participation", "out", "data_dir"}


def parse_override(item: str) -> tuple[str, Any]:
    """'lr=0.1' -> ('lr', 0.1). Values are YAML scalars, except keys that are written as raw strings."""
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(item, "overrides are written key=value, e.g. rounds=50")
    if key in _RAW_STRING_KEYS:
        return key, text
    try:
        return key, yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return key, text


def load_config(path: str | None = None, overrides: list[str] = (), validate_: bool = True) -> Config:
    """YAML file (optional) + key=value overrides -> a validated Config."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"file {path!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError("config", f"{path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, dict):
            raise ConfigError("config", f"{path} must hold a mapping of keys to values")
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw, validate_)


def config_from_dict(raw: dict, validate_: bool = True) -> Config:
    names = {f.name for f in dataclasses.fields(Config) if not f.metadata.get("derived")}
    for key in raw:
        if key not in names:
            close = [n for n in sorted(names) if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(str(key), f"unknown key{hint}; see `fedlase run --help` for the keys")
    cfg = Config(**raw)
    return validate(cfg) if validate_ else cfg


def describe_keys() -> str:
    """Help text for every config key, for the CLI."""
    lines = []
    for f in dataclasses.fields(Config):
        if f.metadata.get("derived"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name:<18} {f.metadata['help']} [default: {default}]")
    return "\n".join(lines)
