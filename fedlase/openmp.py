"""OpenMP's wait policy: OMP_WAIT_POLICY=PASSIVE unless the user chose one, so torch's idle OpenMP threads sleep
instead of spinning on cores that other processes wait for (docs/benchmarks.md, "A shared CPU").

`import fedlase` loads this module, so it imports only `os` and `sys`, which Python has loaded before anything
looks at the working folder: a Flower worker imports the package `fedlase` before it makes its import path safe
(fedlase/flower/worker_start.py), and any other module imported here could be one planted in that folder. For the
same reason: no `from __future__` import."""
import os
import sys

_TORCH_FIRST = []   # [True] once `import fedlase` found torch loaded and no policy chosen; [True, True]: warned


def passive_openmp() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user set it: OpenMP's idle threads then sleep at once instead of
    spinning (GNU OpenMP spins up to ~300k iterations before sleeping), so a run does not burn the CPU that
    other processes on the machine wait for. OpenMP reads it when its runtime loads, so this must run before
    torch is imported: `import fedlase` calls it (`passive_openmp_on_import`), so every entry point (the CLI, a
    sweep, a Flower app) has, and the processes they start inherit it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def passive_openmp_on_import() -> None:
    """At `import fedlase`: the passive wait while it can still take effect (torch, whose OpenMP reads the
    policy when it loads, not imported yet); else, with no policy chosen, remember that idle threads will spin,
    for `warn_spinning_openmp`. Either way the processes a run starts (sweep children, Ray's actors) inherit
    the passive policy."""
    if "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        _TORCH_FIRST.append(True)
    passive_openmp()


def warn_spinning_openmp(threads: int) -> None:
    """Once per process, from `fedlase.run`: a RuntimeWarning when torch was imported before fedlase with no
    OMP_WAIT_POLICY and the run uses more than one thread (`threads` as the config says; 0: as
    fedlase.machine.apply_threads counts them), so its idle OpenMP threads spin: on a busy machine a run can then
    be many times slower."""
    if _TORCH_FIRST != [True]:
        return
    from .machine import default_threads
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if (threads or (int(omp) if omp.isdigit() and int(omp) > 0 else default_threads())) == 1:
        return   # one thread: none idle
    _TORCH_FIRST.append(True)   # warned
    import warnings
    warnings.warn("torch was imported before fedlase, so fedlase could not set OMP_WAIT_POLICY=PASSIVE (OpenMP "
                  "reads it once, when torch loads): idle threads spin, and on a busy machine a run can be many "
                  "times slower. Import fedlase before torch, set OMP_WAIT_POLICY=PASSIVE before Python starts, or "
                  "run with threads=1", RuntimeWarning, stacklevel=3)
