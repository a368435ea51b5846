"""Several runs on one GPU: where `fedlase sweep --jobs N` starts each run that uses CUDA.

The rule: when the sweep starts, each visible GPU's free memory is read once (`torch.cuda.mem_get_info`, in a
short child process, so that the sweep itself holds no CUDA context). A run's need is estimated from its config
(`gpu_need`); it goes to the GPU with the most memory not yet booked by the runs going there, if its need fits,
and its booking is returned when it ends. A run that fits nowhere waits for one to end; when none is running on a
GPU it starts on the freest one anyway (then it is the run's own memory that decides). At most N runs go at once
in all, so N also caps how many share a GPU. Its process sees only its GPU (`CUDA_VISIBLE_DEVICES`).

On a Ray cluster the driver cannot read the nodes' GPUs: a run with device=cuda asks Ray for RAY_GPU_SHARE of a
GPU (fedlase/cluster.py), so up to 1/RAY_GPU_SHARE runs share one (four FIARSE runs on one H200 gave 1.9x the
throughput of one, docs/benchmarks.md)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from .method_config import batching_refused
from .resources import GLOBAL_COPIES, LIVE_ACTIVATIONS, model_sizes

GPU_OVERHEAD = 1 << 30     # a process's CUDA context, cuDNN/cuBLAS workspaces and the allocator's slack
IMAGE_SAMPLES = 70_000     # an image dataset's size before loading: the largest built-in's (Fashion-MNIST)
PER_CLIENT_COPIES = 3      # a training client's parameters, gradients and momentum
RAY_GPU_SHARE = 0.25       # the fraction of a GPU a Ray task with device=cuda asks for


def gpu_need(cfg) -> int:
    """Bytes a run of `cfg` is estimated to hold on its GPU: the overhead, the dataset (the engine keeps it on
    the device), the round's updates and model copies, a training batch's activations and gradients (each
    client's, with batched clients) and an evaluation batch's."""
    from .registry import DATASETS, MODELS
    data, model = DATASETS.get(cfg.dataset), MODELS.get(cfg.model)
    data_info = (data.check(cfg) if data.check else None) or {}
    sizes = (model.check(cfg) if model.check else None) or model_sizes(model.build, cfg, data)
    if "bytes" in data_info:
        data_bytes = data_info["bytes"]
    else:
        data_bytes = IMAGE_SAMPLES * 4 * math.prod(data.shape or (0,))
    sampled = math.ceil(max(cfg.participation) * cfg.levels.num_clients)
    # on a GPU `auto` batches where nothing rules it out
    batched = cfg.batched_clients == "true" or (cfg.batched_clients == "auto" and batching_refused(cfg) is None)
    training = sampled if batched else 1
    params = sizes.get("params", 0) * 4
    return int(GPU_OVERHEAD + data_bytes + (sampled + GLOBAL_COPIES + PER_CLIENT_COPIES * training) * params
               + 2 * training * cfg.batch_size * sizes.get("sample_bytes", 0)
               + LIVE_ACTIVATIONS * cfg.eval_batch_size * sizes.get("largest_bytes", 0))


def visible_free() -> list[int]:
    """Free bytes on each visible GPU (in this process: it creates a CUDA context on each)."""
    import torch
    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def read_free() -> list[int]:
    """`visible_free` in a child process, so that the caller holds no CUDA context; [] when it cannot tell."""
    import torch
    if not torch.cuda.is_available():   # creates no context: no child needed on a machine without a GPU
        return []
    code = "import json; from fedlase.placement import visible_free; print(json.dumps(visible_free()))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        return [int(b) for b in json.loads(res.stdout.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return []


def wants_gpu(cfg) -> bool:
    return cfg.device in ("cuda", "auto") and cfg.engine == "embedded"


class GpuPlan:
    """The sweep's booking of its GPUs' free memory (the rule in this module's docstring)."""

    def __init__(self, free: list[int]):
        self.free = list(free)          # what each GPU had free when the sweep started
        self.booked = [0] * len(free)   # the estimated needs of the runs going on each
        self.running = [0] * len(free)

    def place(self, need: int) -> int | None:
        """The GPU a run needing `need` bytes starts on, booked; None: wait for a run to end."""
        if not self.free:
            return None
        left = [f - b for f, b in zip(self.free, self.booked)]
        gpu = max(range(len(left)), key=lambda i: (left[i], -i))   # the most unbooked memory, then the lowest index
        if need > left[gpu] and any(self.running):
            return None
        self.booked[gpu] += need
        self.running[gpu] += 1
        return gpu

    def release(self, gpu: int, need: int) -> None:
        self.booked[gpu] -= need
        self.running[gpu] -= 1


def gpu_env(gpu: int) -> dict[str, str]:
    """The environment that shows a child process only GPU `gpu` (an index among this process's visible ones)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    return {"CUDA_VISIBLE_DEVICES": ids[gpu] if ids and gpu < len(ids) else str(gpu)}
