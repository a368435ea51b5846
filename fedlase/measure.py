"""What needs a whole Experiment to be measured: the cost table of a config (`fedlase cost`) and the child
process that measures one level's peak memory (fedlase/cost.py starts it)."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from .checkpoint import load as load_checkpoint
from .cost import LevelCost, _status_kb, _trained, level_costs, untimed
from .engine import Experiment

__all__ = ["cost_table", "memory_child"]


def cost_table(cfg, memory: bool = True, checkpoint: str | None = None) -> list[LevelCost]:
    """The cost of every level of a config (`fedlase cost`); `checkpoint`: a run's checkpoint.pt whose model
    the submodels are taken from (default: the initial model)."""
    exp = Experiment(untimed(cfg.to_dict()))
    if checkpoint:
        load_params(exp, checkpoint)
    return level_costs(exp, memory=memory, checkpoint=checkpoint)


def load_params(exp, checkpoint: str) -> None:
    state = load_checkpoint(checkpoint)   # weights-only (fedlase/checkpoint.py)
    exp.state.params = {k: v.to(exp.device) for k, v in state["params"].items()}
    exp.state.buffers = {k: v.to(exp.device) for k, v in state["buffers"].items()}


def memory_child() -> None:
    """Read {config, level, checkpoint} as JSON on stdin, train one client of that level for one round, print
    {peak, train} in bytes (see fedlase/cost.py for what they mean)."""
    from .catalog import load_builtins
    load_builtins()
    spec = json.loads(sys.stdin.read())
    exp = Experiment(untimed(spec["config"]))
    if spec["checkpoint"]:
        load_params(exp, spec["checkpoint"])
    client, sub, _ = _trained(exp, exp.levels[spec["level"]])
    try:   # reset the high-water mark to the current RSS ("5": Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    before = _status_kb("VmRSS")
    exp.trainer.update(client, exp.params, exp.buffers, sub, 1)
    peak = _status_kb("VmHWM")
    if peak is None:   # no /proc: the process's high-water mark (kilobytes on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train = None if before is None else max(0, peak - before) * 1024
    print(json.dumps({"peak": peak * 1024, "train": train}))
