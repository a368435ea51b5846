"""Regenerate tests/reference/two_rounds.json, the 2-round runs that tests/test_reference.py compares with.

    python scripts/reference_runs.py            # how far this machine is from the stored values; writes nothing
    python scripts/reference_runs.py --write    # replace the stored reference with this machine's runs

The reference holds the six methods whose results the engine's restructure had to keep: FedLASE, FIARSE,
HeteroFL, FedRolex, FedAvg and FedAvg-small, each under bn=batch and bn=static (12 runs). The methods added
since (FjORD, DepthFL, FedDSE, fedlase_width) are not in it: their own tests hold their results. Each run is
BASE plus its arguments, run as the test runs it (sliced=false, coverage=mask), on one thread of this CPU.

The test's tolerances were measured across CPUs for the stored values (its docstring says how), so `--write`
only for a change that is meant to move results, and say so in the commit; the check is what to run first.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "reference" / "two_rounds.json"
BASE = ["dataset=digits", "model=cnn", "width=0.25", "system={1,1/4}_{2,2}", "participation=0.5", "local_steps=2",
        "batch_size=16", "lr=0.05", "rounds=2", "eval_every=1", "threads=1", "checkpoint_every=1", "device=cpu"]
COMMON = ["partition=iid", "system={1,1/4,1/16}_{2,2,2}", "participation=0.5", "width=0.5", "model=cnn"]
METHODS = {"fedlase": ["method_args.extract_all_layers=true"], "fiarse": [], "heterofl": [], "fedrolex": [],
           "fedavg": [], "fedavg_small": []}
AS_TESTED = ["sliced=false", "coverage=mask"]   # tests/test_reference.py: the structured methods' masked path


def runs() -> dict[str, list[str]]:
    """key (method/bn) -> the run's arguments after BASE, in the stored order."""
    return {f"{method}/{bn}": [*COMMON, f"method={method}", f"bn={bn}", *extra]
            for method, extra in METHODS.items() for bn in ("batch", "static")}


def run(args: list[str]) -> dict:
    from fedlase.catalog import load_builtins
    from fedlase.config import load_config
    from fedlase.engine import run_experiment
    load_builtins()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*BASE, *args, *AS_TESTED, f"out={tmp}/r"])
        final = run_experiment(cfg, progress=False)["final"]
    return {"args": args, "train_loss": final["train_loss"],
            "levels": {name: {k: lv[k] for k in ("global_acc", "local_acc", "kept")}
                       for name, lv in final["levels"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"replace {REFERENCE.name} with this machine's runs")
    args = p.parse_args(argv)
    stored = json.loads(REFERENCE.read_text())
    fresh = {"base": BASE, "runs": {key: run(a) for key, a in runs().items()}}
    if args.write:
        REFERENCE.write_text(json.dumps(fresh, indent=1))   # as stored: no final newline
        print(f"wrote {REFERENCE}")
        return 0
    same_plan = stored["base"] == BASE and {k: v["args"] for k, v in stored["runs"].items()} == runs()
    print(f"runs and arguments as stored: {same_plan}")
    for key, new in fresh["runs"].items():
        old = stored["runs"].get(key)
        if old is None:
            print(f"{key}: not in the stored reference")
            continue
        loss = abs(new["train_loss"] - old["train_loss"]) / abs(old["train_loss"])
        acc = max(abs(new["levels"][lv][k] - old["levels"][lv][k]) for lv in old["levels"]
                  for k in ("global_acc", "local_acc"))
        kept = all(new["levels"][lv]["kept"] == old["levels"][lv]["kept"] for lv in old["levels"])
        print(f"{key}: train_loss rel. {loss:.1e}, accuracy {acc * 360:.0f} of 360 images, kept equal: {kept}")
    return 0 if same_plan else 1


if __name__ == "__main__":
    sys.exit(main())
