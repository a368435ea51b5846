"""CPU time per local step of a code tree, for before/after comparisons of the engine (docs/benchmarks.md).

    git worktree add /tmp/before <commit>
    python scripts/step_time.py /tmp/before fiarse,fedavg model=cnn
    python scripts/step_time.py . fiarse,fedavg model=cnn

Imports fedlase from the given tree, runs one warm-up round and three measured rounds (10 clients x 10 steps of
batch 32, skewed system, Fashion-MNIST, one torch thread) per method, and prints the fastest round's CPU time
per step as JSON. Run the trees alternately a few times and compare the minima.
"""
import json
import sys
import time

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402

from fedlase.catalog import load_builtins  # noqa: E402
from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment  # noqa: E402

load_builtins()

torch.set_num_threads(1)
out = {}
for method in sys.argv[2].split(","):
    exp = Experiment.from_config(load_config(None, ["dataset=fashion_mnist", *sys.argv[3:], "participation=0.1",
                                                    "system={1,1/4,1/16,1/64}_{10,20,30,40}", "checkpoint_every=0",
                                                    "seed=0", "local_steps=10", "batch_size=32", f"method={method}",
                                                    "threads=1"]))
    exp.run_round(1)
    best = float("inf")
    for rnd in range(2, 5):
        t = time.process_time()
        exp.run_round(rnd)
        best = min(best, time.process_time() - t)
    out[method] = round(1e3 * best / 100, 3)   # ms per step: 10 clients x 10 steps
print(json.dumps(out))
