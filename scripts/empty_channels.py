"""How many conv output channels and linear rows a threshold mask (FIARSE, FedLASE) leaves entirely empty,
per level, after 0 and more rounds; and the share of a client's multiply-adds those channels cost (docs/
benchmarks.md, issue 10 item 3). Runs the engine directly (no analysis, no checkpoints).

    python scripts/empty_channels.py model=cnn --rounds 0,20,60
    python scripts/empty_channels.py model=resnet18 width=0.25 dataset=cifar10 data_dir=... --rounds 0,20
"""
import argparse
import sys

from fedlase.analysis import empty_rows, row_macs
from fedlase.catalog import load_builtins
from fedlase.config import load_config
from fedlase.engine import Experiment

load_builtins()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", default="0,20,60")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    marks = sorted(int(r) for r in a.rounds.split(","))
    for method in ("fiarse", "fedlase"):
        exp = Experiment.from_config(load_config(None, ["checkpoint_every=0", "threads=1", "device=cpu",
                                                        *a.overrides, f"method={method}"]))
        macs = row_macs(exp.model, exp.x_test[:1])
        for r in range(0, marks[-1] + 1):
            if r:
                exp.run_round(r)
                exp.state.round = r
            if r in marks:
                for lvl in exp.levels:
                    empty, total, share = empty_rows(exp.method.submodel(exp.params, lvl, max(r, 1)), macs)
                    print(f"{method:8s} round {r:3d} level {lvl.name:5s}: {empty:5d} of {total:5d} conv output "
                          f"channels / linear rows empty; their multiply-adds: {100 * share:.2f}% of the dense model's",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
