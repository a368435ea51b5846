"""CPU time of deriving channel groups by tracing (fedlase/models/trace.py), for docs/methods-structured.md.

    OMP_NUM_THREADS=1 .venv/bin/python -m tools.trace_cost

Per model, two calls of the trace and of the sliced-or-masked trial on two random samples (seed 0), each after a
garbage collection, so that freeing an earlier trace's graph is not counted; and the import of Torch-Pruning."""
import gc
import time

import torch
from torch import nn

from fedlase.models import ResNet18, SmallCNN
from fedlase.models.trace import _slices_match, trace_groups


def main():
    start = time.process_time()
    import torch_pruning  # noqa: F401
    print(f"import torch_pruning (torch loaded): {time.process_time() - start:.3f} s")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(30, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 5))
    for name, model, shape in (("cnn 28x28", SmallCNN(in_channels=1), (1, 28, 28)),
                               ("resnet18 32x32", ResNet18(in_channels=3), (3, 32, 32)),
                               ("mlp 30-256-256-5", mlp, (30,))):
        x = torch.randn(2, *shape)
        for call in (1, 2):
            gc.collect()
            a = time.process_time()
            groups = trace_groups(model, x)
            b = time.process_time()
            sliceable = _slices_match(model, groups, x, "trace_cost")
            c = time.process_time()
            print(f"{name} call {call}: trace {b - a:.3f} s, trial {c - b:.3f} s, sliceable={sliceable}")


if __name__ == "__main__":
    main()
