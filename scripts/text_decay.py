"""Per-level global accuracy over rounds, fixed against random level assignment (docs/text.md, "Large-level decay").

    python scripts/text_decay.py runs/text-sweep/fedlase runs/text-decay/fedlase-random [...]

Each argument is a run-folder prefix: every finished folder `PREFIX,seed=N` is one seed of that group. For each group
and level it prints the global accuracy at every evaluated round (mean over seeds), the largest drop between two
consecutive evaluations (the swing; mean over seeds), and the local-minus-global gap at the last round (a level
that fits its own clients' label mix has a large one). Reads metrics.jsonl only; trains and evaluates nothing."""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def load(prefix: str) -> dict[int, list[dict]]:
    """seed -> evaluated metrics lines of that run, in round order."""
    runs = {}
    for folder in sorted(glob.glob(f"{prefix},seed=*")):
        if not os.path.exists(f"{folder}/summary.json"):   # still running, or stopped: not a whole run
            continue
        seed = int(folder.rsplit("=", 1)[1])
        with open(f"{folder}/metrics.jsonl") as f:
            runs[seed] = [json.loads(line) for line in f if line.strip()]
    if not runs:
        sys.exit(f"text_decay: no finished run matches {prefix},seed=*")
    return runs


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"


def main(prefixes: list[str]) -> None:
    groups = {p: load(p) for p in prefixes}
    any_run = next(iter(next(iter(groups.values())).values()))
    rounds = [line["round"] for line in any_run]
    print("| group | seeds | level | " + " | ".join(f"round {r}" for r in rounds)
          + " | largest drop between evaluations | local - global at the end |")
    print("|---|---|---|" + "---|" * (len(rounds) + 2))
    for prefix, runs in groups.items():
        for level in next(iter(runs.values()))[-1]["levels"]:   # each group's own levels, largest first
            acc = {s: [100 * line["levels"][level]["global_acc"] for line in lines] for s, lines in runs.items()}
            cells = [mean_std([acc[s][i] for s in acc]) for i in range(len(rounds))]
            drop = [max([0.0] + [a - b for a, b in zip(acc[s], acc[s][1:])]) for s in acc]
            gap = [100 * (lines[-1]["levels"][level]["local_acc"] - lines[-1]["levels"][level]["global_acc"])
                   for lines in runs.values()]
            print(f"| {prefix} | {len(runs)} | {level} | " + " | ".join(cells)
                  + f" | {mean_std(drop)} | {mean_std(gap)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
