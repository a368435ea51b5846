"""The experiment config: one typed record, read from YAML and/or `key=value` overrides, validated once.

Every field is declared with its `Option` (fedlase/options.py): help text, allowed values read from the
registries (fedlase/registry.py), range, and whether it changes the result. `fedlase run --help` documents
every key from this one place, and a resumed run may differ from its checkpoint only in fields declared
`affects_result=False`.

This module sits low in the import graph: it reads choices from the registries when a config is validated
(never at import), and imports no method, model or dataset module. A program registers the built-ins first
(`fedlase.catalog.load_builtins()`: the CLI, the Python API, Flower's apps and sweep children do)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .data_config import check_data, parse_participation
from .deploy_config import check_deployment, ray_address_rule
from .errors import ConfigError
from .levels import System
from .machine import sim_actors_rule, threads_rule, writable_folder
from .method_config import check_method
from .options import Option, check_value
from .registry import (
    ATTACKS,
    DATASETS,
    METHODS,
    MODELS,
    PARTITIONS,
    RULES,
    check_analysis,
    import_plugins,
    task_names,
)
from .resources import check_run
from .robust_config import COVERAGES
from .sim_config import CHARGES

ENGINES = ("embedded", "flower-sim", "flower-deploy")   # `engine`; a method's runs_on adds "batched" (methods/base.py)
BN_MODES = ("batch", "static")   # `bn`: how a model's BatchNorm layers keep statistics (fedlase/models/resnet.py)


def _f(default, help: str, **kw):
    """A config field with its Option; kw: kind, choices, low, high, low_open, high_open, check, affects_result."""
    meta = {"option": Option(default, help, **kw)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _positive(**kw):
    return {"low": 0, "low_open": True, **kw}


@dataclass(frozen=True)
class Config:
    """The run's settings. Frozen: `validate` returns a checked copy and nothing changes a config after it (a
    variant is `dataclasses.replace(cfg, key=value)`); what is derived from it is a view (`levels`, and the typed
    settings built from it: ClientSettings, EvalSettings, Sampling)."""
    method: str = _f("fiarse", "submodel method (see `fedlase methods`)", choices=METHODS.names)
    method_args: dict = _f({}, "options of the method, e.g. method_args.score=max (see `fedlase methods`)")
    dataset: str = _f("fashion_mnist", "dataset", choices=DATASETS.names)
    data_dir: str | None = _f(None, "folder with the data files (default for fashion_mnist: the Debian package's)",
                              kind=str, tags=("path",))
    model: str = _f("cnn", "model", choices=MODELS.names)
    model_path: str | None = _f(None, "model=hf: a local Hugging Face model folder (never downloaded)", kind=str,
                                tags=("path",))
    max_length: int = _f(128, "text datasets: tokens per text (longer texts are cut); task=lm: tokens per block",
                         low=1)
    task: str = _f("classify", "what the model learns: classify (labels, accuracy) or lm (next-token prediction on "
                   "a text dataset's documents cut into max_length-token blocks, perplexity; a decoder model: "
                   "docs/llm.md)", choices=task_names)
    eval_blocks: int = _f(16, "task=lm: test blocks each evaluation scores per level (global, a seeded subset) and "
                          "per client (local); the whole test split when larger than it", low=1, tags=("eval",))
    word_embeddings: str = _f("budget", "text models: budget: the word-embedding table is inside the resource "
                              "budget and extracted like a layer (the official FIARSE code); whole: every client "
                              "holds it whole, outside the budget, like the width methods (docs/text.md)",
                              choices=("budget", "whole"))
    width: float = _f(1.0, "width multiplier of the model's channels, > 0", **_positive())
    bn: str = _f("batch", "batch: batch statistics (FIARSE); static: stats recomputed before evaluation (HeteroFL)",
                 choices=BN_MODES)
    system: str = _f("{1,1/4,1/16,1/64}_{10,20,30,40}",
                     "resource levels and client counts, {levels}_{counts}; {1}_{100} is homogeneous",
                     tags=("parsed",))
    assignment: str = _f("fixed", "fixed: levels by client index, for the whole run; random: the fixed counts "
                         "permuted over clients each round; dynamic: each client's level drawn independently each "
                         "round, in proportion to the counts (the official HeteroFL/FedRolex `dynamic`)",
                         choices=("fixed", "random", "dynamic"))
    partition: str = _f("balanced_dirichlet", "how the training set is split over clients", choices=PARTITIONS.names)
    alpha: float = _f(0.3, "Dirichlet concentration for (balanced_)dirichlet, > 0", **_positive())
    classes_per_client: int = _f(2, "classes per client for pathological, 1..number of classes", low=1)
    local_test_ratio: float | None = _f(None, "local test split size / local train size (default: test/train of the "
                                        "data)", kind=float, **_positive())
    participation: Any = _f(0.1, "fraction of clients sampled per round, or a set drawn per round, e.g. {0.1,0.15,0.2}",
                            kind=object, low=0, low_open=True, high=1,
                            tags=("parsed",))   # a number or a set: parse_participation
    local_steps: int | None = _f(20, "local SGD steps per round (set local_epochs instead to train by epochs)",
                                 kind=int, low=1)
    local_epochs: float | None = _f(None, "local epochs per round; overrides local_steps when set", kind=float,
                                    **_positive())
    batch_size: int = _f(32, "local batch size", low=1)
    optimizer: str = _f("sgd", "sgd or adamw", choices=("sgd", "adamw"))
    lr: float = _f(0.05, "learning rate, > 0", **_positive())
    momentum: float = _f(0.0, "SGD momentum, in [0, 1)", low=0, high=1, high_open=True)
    weight_decay: float = _f(0.0, "weight decay, >= 0", low=0)
    betas: list = _f([0.9, 0.999], "AdamW betas, two numbers in [0, 1)")
    clip_norm: float | None = _f(None, "clip each local step's gradient to this norm (the official HeteroFL and "
                                 "FedRolex codes use 1); unset: no clipping", kind=float, **_positive())
    label_split: bool = _f(False, "HeteroFL's and FedRolex's official `mask=1`: a client's loss and local metric set "
                           "the logits of classes absent from its data to 0, and it trains and is credited with its "
                           "classes' classifier rows only (docs/methods-structured.md)")
    lora: dict = _f({}, "LoRA adapters as the trainable set, the model's transformer frozen (docs/llm.md): lora.r "
                    "(the rank at level 1), lora.alpha, lora.dropout, lora.targets (module names; unset: the attention "
                    "and MLP projections), lora.ranks (the adapter methods' rank per level); unset: the whole model "
                    "trains")
    head_norm: str = _f("none", "text models: none, or batch (BatchNorm over the pooled features before the "
                        "classifier, per level as `bn` says; docs/text.md)", choices=("none", "batch"))
    coverage: str | None = _f(None, "which clients a coordinate's step is averaged over: mask (the clients whose "
                              "mask holds it), nonzero (those whose delta is nonzero: the official FIARSE server), "
                              "kept (mask, but a BN or bias channel only where the client kept a weight of that "
                              "channel); unset: the method's own (`fedlase methods` lists each one's); see "
                              "docs/methods.md", kind=str, choices=COVERAGES)
    robust: str = _f("bounded", "the server's rule (docs/methods.md, Robust aggregation; a plug-in may register "
                     "more): bounded clips every update to the round's median norm per coordinate held after "
                     "rejecting non-finite updates or losses and norms over 3x that median; screen is the plain "
                     "mean after that screen at 100x (the default before issue 39), none the plain mean of "
                     "everything; every other built-in runs after the 100x screen",
                     choices=RULES.names)
    robust_args: dict = _f({}, "options of the rule, e.g. robust_args.screen=10, robust_args.trim=0.2")
    attack: str = _f("none", "simulated faulty or malicious clients, applied to the chosen clients' deltas as the "
                     "server receives them", choices=ATTACKS.names)
    attack_args: dict = _f({}, "options of the attack, e.g. attack_args.factor=1e3 attack_args.fraction=0.1 "
                           "(or attack_args.level=1/4, attack_args.clients=[3])")
    dp: dict = _f({}, "client-level differential privacy (DP-FedAvg with a per-coordinate calibration; "
                  "docs/methods.md): dp.clip and dp.noise_multiplier (or dp.target_epsilon), dp.delta, "
                  "dp.max_epsilon, dp.adaptive; unset: off")
    eval_order: str = _f("test", "global accuracy on: test (the test set in stored order, batches of "
                         "eval_batch_size) or clients (the clients' local test parts in client order, batches of "
                         "20: the official FIARSE evaluation)", choices=("test", "clients"), tags=("eval",))
    rounds: int = _f(100, "communication rounds", low=1, affects_result=False)
    device_model: dict | None = _f(None, "simulated devices (fedlase/simtime.py): speed (FLOP/s), bandwidth (bytes/s) "
                                   "and memory (bytes) of a level-1 device, a level-l device getting l of each, or "
                                   "lists per level; set (even {}) to record sim_time in metrics.jsonl; unset: "
                                   "none recorded, `fedlase report` computes it with the defaults (1e10, 1.25e6, "
                                   "no memory limit); with `deadline` it decides who is dropped, so it is part of "
                                   "the result",
                                   kind=dict)
    sim_charge: str = _f("dense", "simulated time of masked methods: dense (the FLOPs fedlase computes) or sparse "
                         "(the FLOPs if their sparsity were exploited)", choices=CHARGES)
    deadline: float | None = _f(None, "simulated seconds a round waits: clients whose simulated time exceeds it are "
                                "dropped before training (metrics: missed_deadline); unset: none", kind=float,
                                low=0, low_open=True)
    population: dict | None = _f(None, "simulated device population (fedlase/population.py): "
                                 "population.speed_spread / bandwidth_spread (lognormal sigma within a level), "
                                 "population.online / offline (mean seconds of each), or a FedScale trace "
                                 "(population.capacity, population.behave: pickles, read as plain data only); "
                                 "unset: a level's devices alike and always online", kind=dict)
    schedule: str = _f("sync", "sync: synchronous rounds; fedbuff: buffered asynchronous steps; fedasync: a step "
                       "per arrival (event-driven on the simulated clock; schedule_args; docs/async.md)",
                       choices=("sync", "fedbuff", "fedasync"))
    schedule_args: dict = _f({}, "options of an asynchronous schedule, e.g. schedule_args.concurrency=20 "
                             "schedule_args.buffer=10 schedule_args.staleness=poly (docs/async.md)")
    eval_every: int = _f(10, "evaluate every N rounds (server steps under fedbuff/fedasync; and always after the "
                         "last)", low=1, affects_result=False)
    eval_every_seconds: float | None = _f(None, "also evaluate at the first round (server step) ending after each "
                                          "multiple of this many simulated seconds; unset: rounds only",
                                          kind=float, low=0, low_open=True, affects_result=False)
    eval_batch_size: int = _f(1000, "batch size for evaluation", low=1, tags=("eval",))
    eval_finetune: float = _f(0, "epochs each client trains its model on its own data (the run's local optimizer "
                              "settings, no clipping) before its local accuracy is measured: RecipFL's per-client "
                              "metric is 1; 0: none (the global accuracy never fine-tunes)", kind=float, low=0,
                              tags=("eval",))
    seed: int = _f(0, "seed of model init, partition, sampling and local batches", low=0)
    deterministic: bool = _f(True, "torch's deterministic algorithms, cuDNN without benchmarking and cuBLAS's "
                             "reproducible workspace, in every process that trains: on a GPU, reruns and resumes "
                             "are then bit-identical on the same GPU model, driver, torch and fedlase; false: "
                             "faster convolutions, results that vary from run to run (a CPU run is identical "
                             "either way; fedlase/determinism.py)", affects_result=False)
    device: str = _f("auto", "cpu, cuda or auto", choices=("cpu", "cuda", "auto"), affects_result=False,
                     tags=("eval",))
    threads: int = _f(0, "torch CPU threads, at most the CPUs this process may use (affinity and CPU quota); 0: "
                      "those CPUs, at most the physical cores", low=0, check=threads_rule, affects_result=False,
                      tags=("eval",))
    batched_clients: str = _f("auto", "true: train a round's clients together in vmapped passes (pays on a GPU; "
                              "same result up to float rounding; see docs/benchmarks.md); false: one after another; "
                              "auto: batched on CUDA where the method, model and settings allow, else sequential",
                              choices=("auto", "true", "false"), affects_result=False)   # rounding only, as device
    precision: str = _f("fp32", "the local steps' forward and loss: fp32, or bf16 under autocast (parameters, "
                        "optimizer state and aggregation stay fp32; see docs/benchmarks.md)", choices=("fp32", "bf16"))
    sliced: bool = _f(True, "a width-slice submodel (heterofl, fedrolex, fedavg_small) trains and is evaluated as "
                      "the physically smaller model; false: as masks over the full model (same result up to float "
                      "rounding, for checking)")
    engine: str = _f("embedded", "embedded (one process), flower-sim (Flower's Simulation Engine) or flower-deploy "
                     "(a running Flower SuperLink; see docs/flower.md)",
                     choices=ENGINES, affects_result=False)
    min_replies: int = _f(1, "Flower: good replies a round needs to update the model (else it is left unchanged)",
                          low=1, affects_result=False)
    reply_timeout: float = _f(600.0, "Flower: seconds the server waits for a round's replies, > 0",
                              affects_result=False, **_positive())
    superlink: str = _f("127.0.0.1:8000", "Flower: the SuperLink address (host:port) that engine=flower-deploy "
                        "submits to", affects_result=False)
    tls_ca: str | None = _f(None, "Flower: CA certificate (PEM) that signed the SuperLink's; "
                            "engine=flower-deploy and the "
                            "SuperNodes verify the SuperLink with it (docs/flower.md)", kind=str, affects_result=False,
                            tags=("path", "submitter"))
    tls_cert: str | None = _f(None, "Flower: the SuperLink's TLS certificate (PEM), for scripts/flower-deploy-local.py "
                              "(default: a throwaway one)", kind=str, affects_result=False,
                              tags=("path", "submitter"))
    tls_key: str | None = _f(None, "Flower: the SuperLink's TLS private key (PEM), with tls_cert", kind=str,
                             affects_result=False, tags=("path", "submitter"))
    node_keys: str | None = _f(None, "Flower: folder of the nodes' public keys node-<i>.key.pub (python -m "
                               "fedlase.flower.security); engine=flower-deploy requires it and pins partition i to "
                               "node i's key (docs/flower.md)", kind=str, affects_result=False,
                               tags=("path", "submitter"))
    ray_address: str | None = _f(None, "engine=flower-sim: join the running Ray cluster at this address (host:port, "
                                 "or auto) instead of starting a private Ray; unset: a private one sized to this "
                                 "machine (docs/cluster.md)", kind=str, check=ray_address_rule, affects_result=False,
                                 tags=("raw",))
    sim_actors: int | None = _f(None, "engine=flower-sim: clients trained at once, each in a Ray actor (a process "
                                "that imports torch) of its own, at most the CPUs this process may use; unset: one "
                                "per such CPU. Fewer actors cost less memory and start-up, not a different result",
                                kind=int, low=1, check=sim_actors_rule, affects_result=False)
    insecure: bool = _f(False, "Flower: true turns TLS and node authentication off (loopback or a trusted network "
                        "only; warns)", affects_result=False)
    out: str = _f("runs/default", "output folder: metrics.jsonl, summary.json, checkpoint.pt", check=writable_folder,
                  affects_result=False, tags=("path",))
    checkpoint_every: int = _f(10, "write a checkpoint every N rounds (0: never)", low=0, affects_result=False)
    analysis: dict = _f({}, "training-time analyses, e.g. analysis.magnitudes=true (see docs)")
    plugins: list = _f([], "Python modules imported before the config is checked, in every process of the run "
                       "(they register methods, datasets or models; see docs/library.md)")

    @functools.cached_property
    def levels(self) -> System:
        """The resource levels and each client's, parsed from `system`: a view, derived once, never written."""
        return System.parse(self.system)

    @property
    def num_clients(self) -> int:
        return self.levels.num_clients

    @property
    def simulated(self) -> bool:
        """Whether the run needs simulated time: a device model, a deadline, a population or an asynchronous
        schedule (event-driven on the clock)."""
        return (self.device_model is not None or self.deadline is not None or self.population is not None
                or self.schedule != "sync")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def options() -> dict[str, Option]:
    """Every config key's Option, in declaration order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(Config) if "option" in f.metadata}


def tagged(*tags: str) -> tuple[str, ...]:
    """The config keys whose Option carries any of these tags (fedlase.options.TAGS), in declaration order:
    every list of keys that code treats alike is read from the declarations."""
    return tuple(k for k, o in options().items() if set(o.tags) & set(tags))


def result_keys() -> set[str]:
    """Keys that change a run's result: a checkpoint resumes only under the same values of these."""
    return {k for k, o in options().items() if o.affects_result}


_BETA = Option(0.9, "an AdamW beta", low=0, high=1, high_open=True)


def validate(cfg: Config) -> Config:
    """The checked copy of `cfg`: every value checked and coerced (`cfg` itself is left as it was). Raises
    ConfigError naming the key and the allowed values."""
    if isinstance(cfg.batched_clients, bool):   # true/false as YAML reads them: the choices' names
        cfg = dataclasses.replace(cfg, batched_clients=str(cfg.batched_clients).lower())
    checked = {name: check_value(name, opt, getattr(cfg, name)) for name, opt in options().items()
               if not (opt.type in (dict, list) or "parsed" in opt.tags)}   # those have their own rules
    System.parse(cfg.system)
    participation = parse_participation(cfg.participation)
    if not isinstance(cfg.betas, (list, tuple)) or len(cfg.betas) != 2:
        raise ConfigError("betas", f"must be two numbers in [0, 1), got {cfg.betas}")
    cfg = dataclasses.replace(cfg, **checked, participation=participation,
                              betas=[check_value("betas", _BETA, b) for b in cfg.betas])
    check_method(cfg)
    data, model = check_data(cfg)
    check_analysis(cfg.analysis)
    from .robust_config import check_attack, check_dp, check_robust, check_stages
    check_robust(cfg.robust, cfg.robust_args)
    check_attack(cfg.attack, cfg.attack_args, cfg.levels)
    check_stages(cfg, options()["robust"].default)
    from .lora_config import check_lora
    cfg = dataclasses.replace(cfg, lora=check_lora(cfg))   # adapters (fedlase/llm/adapters.py); {}: none
    if not isinstance(cfg.dp, dict):
        raise ConfigError("dp", f"expected a mapping such as {{clip: 1, noise_multiplier: 1}}, got {cfg.dp!r}")
    cfg = dataclasses.replace(cfg, dp=check_dp(cfg))
    from .sim_config import check_device_model, check_population, check_schedule
    check_device_model(cfg.device_model, len(cfg.levels.levels))
    check_population(cfg.population)   # kept as given, like schedule_args: defaults are filled where they are used
    check_schedule(cfg, participation)
    check_deployment(cfg, tagged("submitter"))
    check_run(cfg, data, model)   # sizes against the model, the data and the machine's memory (resources.py)
    object.__setattr__(cfg, _VALIDATED, True)   # on this very object: a copy made by dataclasses.replace has none
    return cfg


# The mark `validate` leaves on the config it returns. It lives in the instance's __dict__, not in a field, so
# `dataclasses.replace`, `Config(...)` and `to_dict` never carry it, while pickling (sweep children, Ray tasks) does.
_VALIDATED = "_fedlase_validated"


def checked(cfg: Config) -> Config:
    """`cfg` if `validate` made it, else its validated copy (or ConfigError): what every run starts from
    (fedlase.dispatch.run_config, fedlase.engine.build_parts, Flower's ServerApp), so that a Config made by
    `Config(...)` or changed by `dataclasses.replace` is checked before anything trains, whatever the path."""
    if not isinstance(cfg, Config):
        raise TypeError(f"expected a fedlase Config, got {type(cfg).__name__}")
    return cfg if cfg.__dict__.get(_VALIDATED) else validate(cfg)


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


def parse_override(item: str) -> tuple[str, Any]:
    """'lr=0.1' -> ('lr', 0.1). Values are YAML scalars, except keys that are written as raw strings."""
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(item, "overrides are written key=value, e.g. rounds=50")
    if not text.strip():   # `coverage=` must not silently mean "unset"
        raise ConfigError(key, "empty value; give one, or leave the key out for its default")
    if key in tagged("raw", "parsed", "path"):
        return key, text
    try:
        return key, yaml.safe_load(text)
    except yaml.YAMLError:
        return key, text


def load_config(path: str | None = None, overrides: list[str] = (), validate_: bool = True) -> Config:
    """YAML file (optional) + key=value overrides -> a validated Config."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"file {path!r} does not exist")
        text = p.read_text()
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            from .util import yaml_problem
            raise ConfigError("config", yaml_problem(path, text, e)) from None
        if not isinstance(raw, dict):
            raise ConfigError("config", f"{path} must hold a mapping of keys to values")
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw, validate_)


def config_from_dict(raw: dict, validate_: bool = True) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    for key in raw:
        if key not in names:
            close = [n for n in sorted(names) if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(str(key), f"unknown key{hint}; see `fedlase run --help` for the keys")
    for key, opt in options().items():   # `system: {1,1/4}` unquoted in a config or sweep file: YAML's mapping
        value = raw.get(key)
        if opt.type is str and isinstance(value, dict):
            written = ",".join(str(k) if v is None else f"{k}: {v}" for k, v in value.items())
            raise ConfigError(key, f"is a mapping, as YAML reads an unquoted value that starts with {{; quote it: "
                              f"{key}: '{{{written}}}'")
    import_plugins(raw.get("plugins", []))
    cfg = Config(**raw)
    return validate(cfg) if validate_ else cfg
