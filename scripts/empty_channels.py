"""How many conv output channels and linear rows a threshold mask (FIARSE, FedLASE) leaves entirely empty,
per level, after 0 and more rounds; and the share of a client's multiply-adds those channels cost (docs/
benchmarks.md, issue 10 item 3). Runs the engine directly (no analysis, no checkpoints).

    python scripts/empty_channels.py model=cnn --rounds 0,20,60
    python scripts/empty_channels.py model=resnet18 width=0.25 dataset=cifar10 data_dir=... --rounds 0,20
"""
import argparse
import sys

import torch
from torch import nn

from fedlase.catalog import load_builtins
from fedlase.config import load_config
from fedlase.engine import Experiment

load_builtins()


def conv_macs(model, x):
    """name of each conv/linear weight -> multiply-adds per output channel for one input image."""
    out = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            def hook(mod, i, o, name=name):
                per_out = o[0].numel() // o.shape[1] * mod.weight[0].numel()   # positions x (cin * k * k)
                out[f"{name}.weight"] = per_out
            hooks.append(m.register_forward_hook(hook))
    model.eval()
    with torch.no_grad():
        model(x[:1])
    for h in hooks:
        h.remove()
    return out


def empty_report(exp, rnd, macs):
    rows = []
    for lvl in exp.levels:
        sub = exp.method.submodel(exp.params, lvl, rnd)
        empty = total = 0
        saved = full = 0
        for n, m in sub.masks.items():
            if m.dim() < 2:
                continue
            rows_kept = m.reshape(m.shape[0], -1).any(1)
            empty += int((~rows_kept).sum())
            total += m.shape[0]
            full += macs.get(n, 0) * m.shape[0]
            saved += macs.get(n, 0) * int((~rows_kept).sum())
        rows.append((lvl.name, empty, total, saved / max(full, 1)))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", default="0,20,60")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    marks = sorted(int(r) for r in a.rounds.split(","))
    for method in ("fiarse", "fedlase"):
        exp = Experiment(load_config(None, ["checkpoint_every=0", "threads=1", "device=cpu", *a.overrides,
                                            f"method={method}"]))
        macs = conv_macs(exp.model, exp.x_test)
        for r in range(0, marks[-1] + 1):
            if r:
                exp.run_round(r)
                exp.state.round = r
            if r in marks:
                for name, empty, total, share in empty_report(exp, max(r, 1), macs):
                    print(f"{method:8s} round {r:3d} level {name:5s}: {empty:5d} of {total:5d} conv output "
                          f"channels / linear rows empty; their multiply-adds: {100 * share:.2f}% of the dense model's",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
