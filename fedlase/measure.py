"""What needs a run's parts built from a config (its data loaded) to be measured: the cost table of a config
(`fedlase cost`) and the child process that measures one level's peak memory (fedlase/cost.py starts it).
Neither builds an Experiment or a clock."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from .checkpoint import load as load_checkpoint
from .cost import LevelCost, level_costs, representative, trained_submodel, with_memory
from .engine import build_parts
from .machine import status_kb
from .train import trainable

__all__ = ["cost_table", "memory_child"]


def cost_table(cfg, memory: bool = True, checkpoint: str | None = None) -> list[LevelCost]:
    """The cost of every level of a config (`fedlase cost`); `checkpoint`: a run's checkpoint.pt whose model
    the submodels are taken from (default: the initial model)."""
    from .errors import UserError
    from .registry import METHODS
    if not METHODS.get(cfg.method).clocked:   # its clients train models the table would not describe
        raise UserError(f"fedlase cost: method {cfg.method} has no cost table: its clients' own models and its "
                        "server's work are not what fedlase/cost.py charges (its Method.clocked is false)")
    p = build_parts(cfg)
    params, buffers = load_params(p.device, checkpoint) if checkpoint else (None, None)
    costs = level_costs(p.model, p.method, p.trainer, p.levels, p.level_clients, params, buffers)
    return with_memory(costs, cfg, checkpoint) if memory else costs


def load_params(device, checkpoint: str) -> tuple[dict, dict]:
    """(params, buffers) of a checkpoint, on `device`."""
    state = load_checkpoint(checkpoint)   # weights-only (fedlase/checkpoint.py)
    return ({k: v.to(device) for k, v in state["params"].items()},
            {k: v.to(device) for k, v in state["buffers"].items()})


def memory_child() -> None:
    """Read {config, level, checkpoint} as JSON on stdin, train one client of that level for one round, print
    {peak, train} in bytes (see fedlase/cost.py for what they mean)."""
    from .catalog import load_builtins
    from .config import config_from_dict
    load_builtins()
    spec = json.loads(sys.stdin.read())
    p = build_parts(config_from_dict(spec["config"]))
    if spec["checkpoint"]:
        params, buffers = load_params(p.device, spec["checkpoint"])
    else:
        # the trainable parameters, as a run's state holds them (a frozen base stays in the module)
        params = {k: v.detach().clone() for k, v in trainable(p.model).items()}
        buffers = {k: v.detach().clone() for k, v in p.model.named_buffers()}
    lvl = p.levels[spec["level"]]
    client = representative(p.level_clients, lvl)
    sub, _ = trained_submodel(p.method, p.trainer, params, client, lvl)
    try:   # reset the high-water mark to the current RSS ("5": Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    before = status_kb("VmRSS")
    p.trainer.update(client, params, buffers, sub, 1)
    peak = status_kb("VmHWM")
    if peak is None:   # no /proc: the process's high-water mark (kilobytes on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train = None if before is None else max(0, peak - before) * 1024
    print(json.dumps({"peak": peak * 1024, "train": train}))
