"""What a config may say given its method: the method's own options, and what the method declares of where it
runs (`Method.runs_on`: the engines, and batched clients), whether the clock can charge it (`Method.clocked`) and
which models it takes (`Method.models`). Read from the registry (never a method module), so validating a config
stays cheap (fedlase/config.py)."""
from __future__ import annotations

from .errors import ConfigError
from .registry import METHODS, MODELS


def check_method(cfg) -> None:
    """ConfigError (one line, naming the key) when the method refuses what the config asks of it."""
    method = METHODS.get(cfg.method)
    if not isinstance(cfg.method_args, dict):
        raise ConfigError("method_args", f"expected a mapping of options, got {cfg.method_args!r}")
    method.check_args(cfg.method_args)
    if cfg.engine not in method.runs_on:   # declared by the method (Method.runs_on), not found out by a run
        why = f": {method.confined}" if method.confined else ""
        raise ConfigError("engine", f"method {cfg.method} runs on {', '.join(method.runs_on)} only (its "
                          f"runs_on{why}), not engine={cfg.engine}")
    if cfg.batched_clients == "true" and (why := batching_refused(cfg)):
        raise ConfigError("batched_clients", why)
    if cfg.simulated and not method.clocked:   # declared by the method (Method.clocked)
        key = next(k for k in ("device_model", "deadline", "population", "schedule")
                   if getattr(cfg, k) not in (None, "sync"))
        raise ConfigError(key, f"method {cfg.method} has no simulated time: the clock (fedlase/simtime.py) cannot "
                          "charge what its clients and server compute")
    if method.models is not None and cfg.model not in method.models:   # declared by the method (Method.models)
        raise ConfigError("model", f"method {cfg.method} runs on model {' or '.join(method.models)} only (its "
                          f"models), not {cfg.model}")


def batching_refused(cfg) -> str | None:
    """Why this run's clients cannot train batched (fedlase/batched.py), or None: `batched_clients=true` is refused
    with it, `auto` falls back to sequential. (A model with dropout is refused when the run builds it.)"""
    method, model = METHODS.get(cfg.method), MODELS.get(cfg.model)
    if cfg.engine != "embedded":   # Flower trains each client in its own ClientApp
        return f"needs engine=embedded, got engine={cfg.engine}"
    if "batched" not in method.runs_on:   # declared by the method (Method.runs_on), not found out by a run
        return f"method {cfg.method} runs on {', '.join(method.runs_on)} only (its runs_on), not batched_clients=true"
    if model.kind == "text":   # the forward trims batches with a data-dependent size
        return f"{cfg.model} is a text model, which vmap cannot batch; set batched_clients=false"
    return None
