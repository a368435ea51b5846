"""What a run will hold, estimated from its config before anything is loaded or allocated, so that a value
that cannot fit stops the run with one line naming its key instead of exhausting the machine.

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
import os
import resource
from types import SimpleNamespace

from .errors import ConfigError

PER_CLIENT_BYTES = 4096       # a client's bookkeeping: its index arrays, level, local test split, tensor objects
GLOBAL_COPIES = 4             # copies of the model a round holds besides the updates (old, new, sums, counts)
LIVE_ACTIVATIONS = 4          # no_grad forward: about this many of the largest activation live at once


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:   # POSIX systems without /proc/meminfo
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), if it has a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if path is None:
            return None
        root = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(root, "memory.current")) as f:
            return int(limit) - int(f.read())
    except (OSError, ValueError, StopIteration):
        return None


def _address_space_left() -> int | None:
    """RLIMIT_AS (`ulimit -v`, `prlimit --as`) minus the address space in use, if there is a limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        used = 0
    return soft - used


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of the system's MemAvailable, its cgroup's headroom
    and its address-space limit; None when none of them can be read."""
    known = [v for v in (_meminfo_available(), _cgroup_available(), _address_space_left()) if v is not None]
    return max(0, min(known)) if known else None


# ---- CPUs --------------------------------------------------------------------------------------------------------
CGROUP_ROOT = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _quota(folder: str, v2: bool) -> float | None:
    """CPUs one cgroup folder's CFS quota allows (v2 cpu.max "QUOTA PERIOD", v1 cpu.cfs_quota_us and
    cpu.cfs_period_us); None without a quota."""
    try:
        if v2:
            text = _read(os.path.join(folder, "cpu.max"))
            quota, period = text.split()[:2] if text else ("max", "1")
            return None if quota == "max" else int(quota) / int(period)
        quota = int(_read(os.path.join(folder, "cpu.cfs_quota_us")) or -1)
        period = int(_read(os.path.join(folder, "cpu.cfs_period_us")) or 0)
        return quota / period if quota > 0 and period > 0 else None
    except ValueError:
        return None


def cgroup_cpu_limit(root: str | None = None, own: str | None = None) -> float | None:
    """CPUs this process's cgroup quota allows: the tightest quota along its cgroup and the cgroups above it,
    v2 or v1 (`root`: where cgroups are mounted; `own`: the text of /proc/self/cgroup). None: no quota."""
    root = root or CGROUP_ROOT
    own = _read("/proc/self/cgroup") if own is None else own
    folders: list[tuple[str, bool]] = []
    for line in (own or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and not controllers:   # v2: the unified tree (or its hybrid mount point)
            unified = os.path.exists(os.path.join(root, "cgroup.controllers"))
            mount, v2 = (root if unified else os.path.join(root, "unified")), True
        elif "cpu" in controllers.split(","):   # v1: the cpu controller's own tree
            mount, v2 = next((os.path.join(root, m) for m in ("cpu", "cpu,cpuacct", "cpuacct,cpu")
                              if os.path.isdir(os.path.join(root, m))), None), False
        else:
            continue
        if mount is None:
            continue
        rel = path.strip("/")   # the cgroup, and every cgroup above it up to the mount (a container's own root)
        while True:
            folders.append((os.path.join(mount, rel), v2))
            if not rel:
                break
            rel = os.path.dirname(rel)
    limits = [q for folder, v2 in folders if (q := _quota(folder, v2)) is not None]
    return min(limits) if limits else None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask (taskset, Slurm, a container's cpuset), capped by its
    cgroup's CPU quota (docker --cpus, Kubernetes limits), rounded up; at least 1. The one count fedlase uses
    for threads: torch's own default reads neither the quota nor, for MKL, always the mask."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, math.ceil(limit))
    return max(1, n)


def default_threads() -> int:
    """torch's CPU threads at `threads=0`: the usable CPUs, at most the machine's physical cores (a second
    hardware thread of a core adds nothing to dense float work and contends with the first)."""
    try:
        import psutil
        cores = psutil.cpu_count(logical=False)
    except ImportError:
        cores = None
    return max(1, min(usable_cpus(), cores or usable_cpus()))


def apply_threads(threads: int) -> int:
    """Set torch's CPU threads for the config's `threads`; returns the count in force. 0: OMP_NUM_THREADS
    where it is set (by the user, or by Ray for its workers, which torch then follows), else
    `default_threads()`."""
    import torch
    if threads or not os.environ.get("OMP_NUM_THREADS"):
        n = threads or default_threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    return torch.get_num_threads()


def passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user set it: OpenMP's idle threads then sleep at once instead of
    spinning (GNU OpenMP spins up to ~300k iterations before sleeping), so a run does not burn the CPU that
    other processes on the machine wait for. OpenMP reads it when its runtime loads, so this must run before
    torch is imported: the CLI calls it first, and the processes it starts inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _beyond_usable(count: int, otherwise: str) -> str | None:
    usable = usable_cpus()
    if count > usable:
        return (f"{count} is more than the {usable} CPU(s) this process may use (its affinity and CPU quota); "
                f"use 1..{usable}, or {otherwise}")
    return None


def threads_rule(threads: int) -> str | None:
    """An Option `check` for `threads`: why a count beyond the CPUs this process may use is refused (more
    threads than CPUs only contend, and a huge count exhausts the machine's threads before training starts)."""
    return _beyond_usable(threads, f"0 for the default ({default_threads()})")


def sim_actors_rule(actors: int) -> str | None:
    """An Option `check` for `sim_actors`: each actor is a process with its own torch, so more actors than
    usable CPUs only contend and multiply the memory."""
    return _beyond_usable(actors, "leave it unset for one actor per CPU")


# ---- folders a run writes ----------------------------------------------------------------------------------------
KERNEL_FILESYSTEMS = ("/proc", "/sys")   # the kernel's views of itself: a run's files never belong there


def writable_folder(value) -> str | None:
    """An Option `check` for a folder a run writes into (`out`, analysis.tensorboard): why it cannot be, or
    None. Nothing is created here (validation must leave no trace): the folder must be writable, or the
    nearest folder above it that exists must be, so that creating it will succeed; a file where a folder is
    needed, and the kernel's /proc and /sys, are refused."""
    path = os.path.abspath(os.path.expanduser(str(value)))
    real = os.path.realpath(path)
    for top in KERNEL_FILESYSTEMS:
        if real == top or real.startswith(top + "/"):
            return f"{value!r} is under {top}, which holds no folders for a run's files"
    probe = real
    while not os.path.exists(probe):   # the nearest existing folder above it: creating the rest needs it writable
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{value!r} needs a folder, but {probe!r} is not one"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{value!r} cannot be written: {probe!r} is not writable by this user"
    return None


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


def check_counts(cfg, n_train: int) -> None:
    """Clients (`system`) and `batch_size` against the training samples: at validation for a dataset that
    knows its size before loading, else right after loading (`check_loaded`), before any training."""
    clients = cfg.levels.num_clients
    if clients > n_train:
        raise ConfigError("system", f"{clients} clients but {cfg.dataset} has {n_train} training samples")
    if cfg.batch_size > n_train:
        raise ConfigError("batch_size", f"{cfg.batch_size} is more than the {n_train} training samples of "
                          f"{cfg.dataset}")


def check_loaded(cfg, data) -> None:
    """The counts of `check_counts` once the data is loaded (an image dataset learns its size only then, and
    a data_dir may hold any number of samples); the engine calls it before it trains."""
    check_counts(cfg, len(data.y_train))


def check_run(cfg, data_entry, model_entry) -> None:
    """Every check above, for a config whose values are each valid on their own; ConfigError on the first."""
    model_info = (model_entry.check(cfg) if model_entry.check else None) or {}
    data_info = (data_entry.check(cfg) if data_entry.check else None) or {}
    n_train, n_test = data_info.get("train"), data_info.get("test")
    clients = cfg.levels.num_clients
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
