"""CPU time of one training round at the smallest level only: 4 clients x 5 local steps of level 1/64 on
ResNet-18 (width 0.25, one torch thread, Fashion-MNIST), per method (issue 30: FedLASE with layer-adaptive
widths against sliced HeteroFL and masked FedLASE).

    python scripts/lowest_level_time.py [turns] [method[:arg=value:...],...] [key=value ...]

e.g. `fedlase_width:score=equal` is fedlase_width with method_args.score=equal.

The methods run by turns (one round each, in turn, `turns` times after a warm-up round each), so load from other
processes falls on all of them alike; the clock is the process's CPU time and the fastest round per method is
kept. Prints JSON: CPU-s per round (submodel extraction, training, aggregation; no evaluation) and each
method's ratio to heterofl."""
import json
import sys
import time

import torch

from fedlase.catalog import load_builtins
from fedlase.config import load_config
from fedlase.engine import Experiment

load_builtins()
torch.set_num_threads(1)
turns = int(sys.argv[1]) if len(sys.argv) > 1 else 5
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["heterofl", "fedlase_width", "fedlase"]
extra = sys.argv[3:]
base = ["dataset=fashion_mnist", "model=resnet18", "width=0.25", "system={1/64}_{4}", "participation=1.0",
        "local_steps=5", "batch_size=32", "checkpoint_every=0", "seed=0", "threads=1", "lr=0.01",
        "momentum=0.8", "out=runs/issue30/lowest-level-time"]


def method_overrides(spec: str) -> list[str]:
    name, *args = spec.split(":")
    return [f"method={name}", *(f"method_args.{a}" for a in args)]


exps = {m: Experiment.from_config(load_config(None, [*base, *method_overrides(m), *extra])) for m in methods}
for exp in exps.values():
    exp.run_round(1)
best = {m: float("inf") for m in methods}
for rnd in range(2, 2 + turns):
    for m, exp in exps.items():
        t = time.process_time()
        exp.run_round(rnd)
        best[m] = min(best[m], time.process_time() - t)
ref = best.get("heterofl")
print(json.dumps({"cpu_s": {m: round(v, 3) for m, v in best.items()},
                  "ratio_to_heterofl": {m: round(v / ref, 3) for m, v in best.items()} if ref else None}))
