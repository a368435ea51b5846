"""The one place that makes a process's training reproducible bit for bit (config key `deterministic`).

On a CPU fedlase's runs were always bit-identical; on a GPU two identical runs differed (cuDNN picks its
convolution algorithms by timing them, some kernels add in whatever order their threads finish, cuBLAS splits
work over several workspaces). `apply(True)` asks torch for its deterministic algorithms, turns cuDNN's
benchmarking off and sizes cuBLAS's workspace as NVIDIA documents for reproducible results. Every process that
trains calls it before it touches CUDA: the embedded engine (`build_parts`: so sweep children and Ray tasks,
which run through it), Flower's ClientApps (`trainer_for`) and the node worker (its start-up sets the cuBLAS
variable before torch loads; its first message applies the rest).

Promised: the same config on the same GPU model, driver, CUDA, torch and fedlase gives the same bits, on a
rerun and on a resume. An operation that torch has no deterministic kernel for warns (`warn_only`) instead of
stopping a run: a run that warned is not covered. `apply(False)` gives these up for speed: cuDNN then
benchmarks its convolution algorithms for each new shape and keeps the fastest."""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("fedlase")

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"   # NVIDIA's reproducible setting (":16:8" is the other; a user's own is kept)


def cublas_workspace() -> None:
    """Set cuBLAS's workspace for reproducible results unless the user chose one. torch reads it once, when it
    first calls cuBLAS in the process, so it must come before any CUDA work (it costs nothing without CUDA)."""
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_DETERMINISTIC)


def apply(deterministic: bool) -> None:
    """Put this process's torch in the reproducible mode (`deterministic`) or in its fastest one."""
    import torch
    if deterministic:
        if torch.cuda.is_initialized() and CUBLAS_ENV not in os.environ:
            log.warning("deterministic: CUDA started before fedlase set %s; set it in the environment before "
                        "starting Python for bit-identical GPU runs", CUBLAS_ENV)
        cublas_workspace()
    # what the public call does but for importing inductor's config (1.2-1.5 CPU s a process, half of importing
    # torch): fedlase compiles nothing; a program that imported inductor, or a torch without it, takes the public call
    private = getattr(torch._C, "_set_deterministic_algorithms", None)   # private: tests/test_structure.py
    if private is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    else:
        private(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def enabled() -> bool:
    """Whether this process trains in the reproducible mode (what the tests check from inside the training)."""
    import torch
    return (torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
            and not torch.backends.cudnn.benchmark and os.environ.get(CUBLAS_ENV) is not None)
