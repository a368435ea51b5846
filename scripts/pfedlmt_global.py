"""pFedLMT's personalized "global" accuracy at a run's final checkpoint, for runs made with
method_args.global_eval=false (docs/results.md, "FedLMT and pFedLMT beside the submodel methods"): each client's
own model (the shared prefix and its own part) on the whole test set, meaned over the level's clients, then over
levels, as `global_eval=true` computes it during a run. One JSON line per run folder.

    python scripts/pfedlmt_global.py runs/lmt-compare/pfedlmt,seed=*
"""
import json
import sys

from fedlase import checkpoint
from fedlase.catalog import load_builtins
from fedlase.config import config_from_dict
from fedlase.engine import Experiment


def main(runs: list[str]) -> None:
    load_builtins()
    for run in runs:
        state = checkpoint.load(f"{run}/checkpoint.pt")   # weights-only, as `fedlase evaluate`
        raw = dict(state["config"])
        raw["out"], raw["method_args"] = run, {**raw["method_args"], "global_eval": True}
        exp = Experiment.from_config(config_from_dict(raw))
        exp.load_state_dict(state)
        ev = exp.evaluate(exp.round)
        levels = {k: v["global_acc"] for k, v in ev["levels"].items()}
        print(json.dumps({"run": run, "round": exp.round, "global_acc": ev["global_acc"],
                          "local_acc": ev["local_acc"], "levels": levels}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
