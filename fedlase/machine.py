"""What this machine lets a process use, read where it runs: the memory it may still allocate, the CPUs it may
use (affinity and cgroup quota) and so torch's threads, and the folders it may write.

The config's Option checks (`threads_rule`, `sim_actors_rule`, `writable_folder`) and fedlase/resources.py's
memory checks read it; nothing here knows a config."""
from __future__ import annotations

import math
import os
import resource
from pathlib import Path


# ---- memory ------------------------------------------------------------------------------------------------------
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


def status_kb(key: str) -> int | None:
    """A figure of this process's /proc/self/status in KiB (VmRSS, VmHWM, ...); None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
