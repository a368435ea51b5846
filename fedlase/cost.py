"""What each resource level of a run really costs a client (`fedlase cost CONFIG`; issue 30).

This module knows no Experiment (the engine's clock uses it); fedlase/measure.py builds one for a config.
Per level, on the submodel of round 1 of the initial model (or of the model a checkpoint holds):
  held        parameters the client must hold to train: the whole model for masked methods (FIARSE, FedLASE:
              the client trains the full-size tensors under masks), the gathered slice for width methods
              (HeteroFL, FedRolex, fedlase_width), BatchNorm parameters included;
  kept        budgeted coordinates of its submodel (what the budget counts);
  step_flops  FLOPs of one local step (forward and backward of one batch) as fedlase computes it, counted by
              torch.utils.flop_counter.FlopCounterMode (matmuls and convolutions only; BN, activations and the
              optimizer are not counted);
  sparse      the FLOPs of that step if the submodel's sparsity were exploited: each conv or linear layer's
              counted FLOPs (forward, weight gradient and input gradient) times the kept fraction of its weight;
              equal to step_flops for a slice, which already computes only what it keeps;
  down / up   payload bytes each way as the Flower codec sends them (fedlase/flower/codec.py: kept values, mask
              bits, slice indices, buffers; up: the delta on the credited mask);
  peak        peak resident memory of one client's local training (all its steps), MEASURED in a fresh child
              process per level: after the process has loaded the data and built the model, its high-water mark
              is reset (Linux /proc/self/clear_refs, "5") and read back after training (VmHWM). Reported as the
              whole process's peak and as `train+`, the peak above the resident size just before training (the
              training's own working set: parameter copies, activations, gradients, optimizer state).
              Caveats: RSS counts pages, not tensors (the allocator may keep freed memory, so repeated steps do
              not add up); the process's baseline (Python, torch, the dataset) is in `peak`; where clear_refs
              cannot be written the high-water mark includes the setup (then `train+` is a lower bound).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["LevelCost", "format_cost_table", "level_costs", "measure_memory", "untimed"]


@dataclass
class LevelCost:
    level: str            # the level's name (1, 1/4, ...)
    fraction: float
    held: int             # parameters held to train
    kept: int             # budgeted coordinates of the submodel
    step_flops: int       # one local step as fedlase computes it
    sparse_flops: int     # the same step with the submodel's sparsity exploited
    down_bytes: int
    up_bytes: int
    steps: int            # local steps of one round (its first client's)
    sliced: bool          # whether the client trains a gathered slice
    peak_bytes: int | None = None
    train_bytes: int | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _client_of(exp, lvl) -> int:
    clients = exp.level_clients.get(lvl) or [0]
    return clients[0]


def _trained(exp, lvl, rnd: int = 1):
    """(client, the submodel as that client trains it) of a level at round `rnd`."""
    client = _client_of(exp, lvl)
    sub = exp.method.submodel(exp.params, lvl, rnd)
    sub = exp.trainer.submodel(client, sub, exp.params)
    return client, sub, exp.trainer.trained(sub)


def _step_flops(exp, client: int, trained) -> tuple[int, int]:
    """(FLOPs of one local step, the same with each layer's FLOPs times its weight's kept fraction)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .train import local_train
    tr = exp.trainer
    batches, augment = tr.job(client, 1)
    one = dataclasses.replace(tr.work, steps=1, epochs=None)
    classes = tr.classes[client] if tr.classes is not None else None
    with torch.random.fork_rng(), FlopCounterMode(display=False) as counter:
        local_train(exp.model, exp.params, exp.buffers, trained, tr.x, tr.y, batches[:1], one, augment, classes)
    counts = counter.get_flop_counts()
    total = int(sum(counts.get("Global", {}).values()))
    # the layers that own a weight: their counted FLOPs scale with its density (a slice's inner masks, if any)
    masks = trained.inner().masks if trained.slices else trained.masks
    saved = 0.0
    for key, ops in counts.items():
        name = key.split(".", 1)[1] + ".weight" if "." in key else None
        if name in masks:
            density = float(masks[name].float().mean())
            saved += sum(ops.values()) * (1.0 - density)
    return total, int(round(total - saved))


def _payload(exp, sub) -> tuple[int, int]:
    """Bytes down and up as the Flower codec encodes them; a method whose local objective the codec cannot
    send (FjORD, DepthFL, FedDSE) is charged the dense model each way."""
    from .errors import UserError
    try:
        from .flower.codec import encode_delta, encode_submodel, record_bytes
        down = encode_submodel(exp.params, exp.buffers, sub)
    except (UserError, ImportError):
        dense = sum(p.numel() * p.element_size() for p in exp.params.values())
        return dense, dense
    zeros = {n: torch.zeros_like(p) for n, p in exp.params.items()}
    return record_bytes(*down.array_records.values()), record_bytes(encode_delta(zeros, sub))


def level_costs(exp, memory: bool = False, checkpoint: str | None = None) -> list[LevelCost]:
    """The cost of every level of an Experiment (largest first), on its current global model. The method's own
    state (FedDSE's selection counts) is restored afterwards, so a run's results do not change. `memory`:
    measure the peak of local training in a child process per level (`checkpoint`: the params it loads)."""
    state = copy.deepcopy(exp.method.state_dict())
    out = []
    try:
        for lvl in exp.levels:
            client, sub, trained = _trained(exp, lvl)
            if trained.slices:
                held = sum(t.numel() for t in trained.gather(exp.params).values())
            else:
                held = sum(p.numel() for p in exp.params.values())
            flops, sparse = _step_flops(exp, client, trained)
            down, up = _payload(exp, sub)
            steps = exp.trainer.work.num_steps(len(exp.trainer.train_idx[client]))
            out.append(LevelCost(lvl.name, float(lvl), held, sub.kept(exp.method.maskable, exp.params), flops,
                                 sparse, down, up, steps, bool(trained.slices)))
    finally:
        exp.method.load_state_dict(state)
    if memory:
        for i, c in enumerate(out):
            c.peak_bytes, c.train_bytes = measure_memory(exp.cfg, i, checkpoint)
    return out


def untimed(raw: dict):
    """The validated config of `raw` (a config's to_dict) without simulated time: an Experiment built from it
    does not cost its levels (a memory child that did would start children of its own, without end)."""
    from .config import config_from_dict
    return config_from_dict({**raw, "device_model": None, "deadline": None})


# ---- measured memory ------------------------------------------------------------------------------------------
def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def measure_memory(cfg, level_index: int, checkpoint: str | None = None) -> tuple[int | None, int | None]:
    """(peak RSS bytes, bytes above the RSS before training) of one client's local training at a level, in a
    fresh child process (so no other level's pages are counted)."""
    spec = json.dumps({"config": cfg.to_dict(), "level": level_index, "checkpoint": checkpoint}, default=str)
    proc = subprocess.run([sys.executable, "-c", "from fedlase.measure import memory_child; memory_child()"],
                          input=spec, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, None
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return got["peak"], got["train"]


# ---- the table --------------------------------------------------------------------------------------------------
def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}".rstrip()
    return f"{x:.0f} {unit}".rstrip()


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2 ** 20:.1f} MiB"


def format_cost_table(costs: list[LevelCost], method: str = "") -> str:
    """The per-level Markdown table."""
    rows = []
    for c in costs:
        rows.append([c.level, f"{c.held:,}" + (" (slice)" if c.sliced else " (dense)"), f"{c.kept:,}",
                     _mib(c.peak_bytes), _mib(c.train_bytes), _si(c.step_flops, "FLOP"), _si(c.sparse_flops, "FLOP"),
                     _si(c.down_bytes, "B"), _si(c.up_bytes, "B"), str(c.steps)])
    head = ["level", "params held", "kept (budget)", "peak RSS", "train+", "step FLOPs", "sparse FLOPs",
            "down", "up", "steps"]
    title = f"Cost per level{' (' + method + ')' if method else ''}: one local step of one batch; peak = measured\n\n"
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return title + "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
