"""The one run path: a validated config is dispatched to (runs or resumes on) the engine it names.

`fedlase run`, `fedlase.run`, and both sweep paths (in process, and each `--jobs` child) call `run_config`,
so they cannot disagree about what runs: `engine=flower-sim` and `engine=flower-deploy` go through Flower
(which writes its app folder, `<out>/flower-app`), `engine=embedded` through the round loop in this process.
The summary a run writes is the config that ran, engine included."""
from __future__ import annotations

from .catalog import load_builtins
from .config import Config, checked


def run_config(cfg: Config, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume, with `resume`) the experiment `cfg` on its engine; returns summary.json's content."""
    load_builtins()   # idempotent: every process that runs a config has its choices registered
    cfg = checked(cfg)   # Config(...) or dataclasses.replace(...) is validated here, on every engine's path
    if cfg.engine.startswith("flower"):
        from .flower import run_flower  # needs the `flower` extra
        return run_flower(cfg, resume=resume, progress=progress)
    from .engine import run_experiment
    from .simtime import clock_for  # the engine is handed its clock: it imports nothing built on it
    return run_experiment(cfg, resume=resume, progress=progress, clock=clock_for)
