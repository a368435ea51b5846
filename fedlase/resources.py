"""What a run will hold, estimated from its config before anything is loaded or allocated, so that a value
that cannot fit stops the run with one line naming its key instead of exhausting the machine. What the machine
allows (memory, CPUs, writable folders) is read by fedlase/machine.py; this module compares a config with it.

Checked at config validation (fedlase/config.py), in this order:
- the model's and the dataset's own checks (`check` hooks of their registry entries): `max_length` against
  the model's positions, read from its config.json; the text datasets' sample counts and tokenized size;
- counts against the data, where the dataset knows its sizes before loading: clients (`system`) and
  `batch_size` at most the training samples (a dataset that learns its size only by loading, as the image
  datasets do, is checked right after loading, before training: `check_loaded`);
- `threads` at most the CPUs this process may use (`usable_cpus`: affinity and cgroup CPU quota), and each
  folder a run writes (`out`, analysis.tensorboard) one it can create (`writable_folder`): Option checks;
- memory against what this process may still allocate (`available_memory`): the per-client bookkeeping
  (`system`); the loaded dataset (`dataset`, or `max_length` for a text dataset: its own check); the round's
  updates (`participation`: one full-size delta per sampled client, plus a few copies of the global model);
  the activations of a training batch (`batch_size`) and of an evaluation batch (`eval_batch_size`).

The estimates are rough upper bounds, meant to stop what cannot run, not to plan one: an update is counted
at full model size (a width slice's is smaller), and the batch estimates are made only for a dataset that
reports its sample counts before loading (the text datasets; an image dataset's `check` may add them), since
a batch is never larger than the data it is cut from. A model's parameters and activation sizes come from building it on
torch's `meta` device (no memory, no weights read) and one forward of a single sample there; a model that cannot be
built or run on `meta` (the text models: their forward trims batches by value) gives its sizes through its
registry entry's `check`, or is not estimated."""
from __future__ import annotations

import math
from types import SimpleNamespace

from .errors import ConfigError
from .machine import available_memory

PER_CLIENT_BYTES = 4096       # a client's bookkeeping: its index arrays, level, local test split, tensor objects
GLOBAL_COPIES = 4             # copies of the model a round holds besides the updates (old, new, sums, counts)
LIVE_ACTIVATIONS = 4          # no_grad forward: about this many of the largest activation live at once


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def require(key: str, need: float, what: str, fix: str, available: int | None = None) -> None:
    """ConfigError(key) when `need` bytes are more than the memory available."""
    available = available_memory() if available is None else available
    if available is not None and need > available:
        raise ConfigError(key, f"{what} needs about {_gib(need)} but this process has {_gib(available)} of memory; "
                          f"{fix}")


def meta_model(build, cfg, data_entry):
    """The run's model built on torch's meta device (shapes, no memory, no weights read), or None when it
    cannot be built there or its dataset gives no input shape before loading."""
    if data_entry.shape is None:
        return None
    import torch
    shape = tuple(data_entry.shape)
    fake = SimpleNamespace(name=cfg.dataset, num_classes=data_entry.num_classes, in_channels=shape[0],
                           image_size=shape[-1], augment=False)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return build(cfg, fake)
    except Exception:   # noqa: BLE001 -- a model that cannot be built on meta is simply not estimated
        return None


def model_sizes(build, cfg, data_entry, activations: bool = True) -> dict:
    """{'params', 'sample_bytes' (all activations of one sample), 'largest_bytes' (its largest activation)}
    of a model built on torch's meta device and run on meta samples; {} when it cannot be built there, only
    `params` when its forward cannot run there or `activations` is false. The meta forward runs torch's Python
    meta kernels, whose first call imports torch._dynamo (about 1 CPU-s), so a caller that will not read the
    activation figures skips it."""
    model = meta_model(build, cfg, data_entry)
    if model is None:
        return {}
    import torch
    sizes = {"params": sum(p.numel() for p in model.parameters())}
    if not activations:
        return sizes
    shape = tuple(data_entry.shape)
    outputs: list[int] = []

    def hook(module, inputs, output):
        if isinstance(output, torch.Tensor):
            outputs.append(output.numel() * output.element_size())
    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    try:   # two samples: batch-statistics BN needs more than one value per channel
        with torch.no_grad(), torch.device("meta"):
            model.eval()(torch.empty((2, *shape)))
        sizes.update(sample_bytes=sum(outputs) // 2, largest_bytes=max(outputs, default=0) // 2)
    except Exception:   # noqa: BLE001 -- a forward that cannot run on meta: parameters only
        pass
    for h in handles:
        h.remove()
    return sizes


def check_clients(clients: int, n_train: int, dataset: str) -> None:
    """No more clients than training samples (a partition could leave a client none)."""
    if clients > n_train:
        raise ConfigError("system", f"{clients} clients but {dataset} has {n_train} training samples")


def check_counts(cfg, n_train: int) -> None:
    """Clients (`system`) and `batch_size` against the training samples: at validation for a dataset that
    knows its size before loading, else right after loading (`check_loaded`), before any training."""
    check_clients(cfg.levels.num_clients, n_train, cfg.dataset)
    if cfg.batch_size > n_train:
        raise ConfigError("batch_size", f"{cfg.batch_size} is more than the {n_train} training samples of "
                          f"{cfg.dataset}")


def check_loaded(cfg, data) -> None:
    """The counts of `check_counts` once the data is loaded (an image dataset learns its size only then, and
    a data_dir may hold any number of samples); the engine calls it before it trains."""
    check_counts(cfg, len(data.y_train))
    check_work(cfg, len(data.y_train))   # local_epochs in steps, now that the data's size is known


# The most local steps a run may take in all (every client's, summed over the run), about 12 days of training at
# 1 ms a step: a count beyond it (rounds=1e30, local_steps=1e12) is a typo, not an experiment, and would run for ever.
MAX_LOCAL_STEPS = 10**9


def check_work(cfg, n_train: int | None) -> None:
    """ConfigError when a lower bound on the run's local steps (rounds x clients a step trains x steps a client
    takes) exceeds MAX_LOCAL_STEPS; the key named is the largest factor's."""
    clients = cfg.levels.num_clients
    per_step = math.ceil(min(cfg.participation) * clients) if cfg.schedule == "sync" else 1   # async: >= 1 a step
    if cfg.local_epochs is not None:
        per_client = max(1, math.floor(cfg.local_epochs * (n_train or 0) / clients / cfg.batch_size))
        key = "local_epochs"
    else:
        per_client, key = cfg.local_steps, "local_steps"
    total = cfg.rounds * per_step * per_client
    if total > MAX_LOCAL_STEPS:
        key = "rounds" if cfg.rounds >= per_client else key
        raise ConfigError(key, f"the run would take at least {total:.3g} local steps in all (rounds={cfg.rounds:g} x "
                          f"{per_step} clients x {per_client:g} steps), more than fedlase's limit of "
                          f"{MAX_LOCAL_STEPS:.0e} (about 12 days at 1 ms a step); lower it")


def check_run(cfg, data_entry, model_entry) -> None:
    """Every check above, for a config whose values are each valid on their own; ConfigError on the first."""
    model_info = (model_entry.check(cfg) if model_entry.check else None) or {}
    data_info = (data_entry.check(cfg) if data_entry.check else None) or {}
    n_train, n_test = data_info.get("train"), data_info.get("test")
    clients = cfg.levels.num_clients
    check_work(cfg, n_train)
    if n_train is not None:
        check_counts(cfg, n_train)
    available = available_memory()
    if available is None:
        return
    require("system", clients * PER_CLIENT_BYTES, f"the bookkeeping of {clients} clients",
            "use fewer clients", available)
    key = data_info.get("key", "dataset")   # the key the loaded size scales with (text: max_length)
    require(key, data_info.get("bytes", 0), f"{cfg.dataset} in memory", f"lower {key}", available)
    # a model's own figures first; the activation figures only where the batch checks below read them
    sizes = model_info or model_sizes(model_entry.build, cfg, data_entry, activations=n_train is not None)
    if "params" in sizes:
        sampled = math.ceil(max(cfg.participation) * clients)
        require("participation", (sampled + GLOBAL_COPIES) * sizes["params"] * 4,
                f"a round of {sampled} clients, each update {sizes['params']} parameters,",
                "lower participation or the client counts in system", available)
    if n_train is None:
        return
    if "sample_bytes" in sizes:   # training keeps every activation (and its gradient) of the batch
        require("batch_size", 2 * cfg.batch_size * sizes["sample_bytes"], f"a training batch of {cfg.batch_size}",
                "lower batch_size", available)
    if "largest_bytes" in sizes:   # evaluation batches cut the test set and the BN-recompute samples
        batch = min(cfg.eval_batch_size, max(n_test or 0, n_train))
        require("eval_batch_size", LIVE_ACTIVATIONS * batch * sizes["largest_bytes"],
                f"an evaluation batch of {batch}", "lower eval_batch_size", available)
