"""Shrunken updates against the default rule (issue 56, item 4; docs/results.md, "A minority of shrunken
updates"): k of ten clients (k = 1..5, drawn from each seed) send their update times 1e-3, 1e-2 or 1e-1, beside
the run in which the same k clients never reply (`attack=nan`: rejected), on the digits case of issue 39, seeds
0-2; and, for five of ten, `robust=none` beside the default.

    python scripts/robust_shrunk.py run [--jobs 1]     # writes runs/robust-shrunk/sweep.yaml, runs fedlase sweep
    python scripts/robust_shrunk.py table              # the markdown tables from whatever has finished

`run` is resumable (a run with summary.json is skipped) and ordered seed by seed. Every run names its rule.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from robust_matrix import cell, sweep  # scripts/robust_matrix.py, beside this file

from fedlase.report_tables import paired_t

OUT = Path("runs/robust-shrunk")
SEEDS = (0, 1, 2)
KS = (1, 2, 3, 4, 5)
FACTORS = (1e-3, 1e-2, 1e-1)
DIGITS = {"dataset": "digits", "system": "{1,1/4}_{9,1}", "participation": 1, "rounds": 20, "eval_every": 20,
          "local_steps": 1, "lr": 0.1, "method": "fedlase", "threads": 1, "checkpoint_every": 0}


def runs() -> list[dict]:
    out = []
    for s in SEEDS:
        out += [{"name": f"{r}-honest-s{s}", "robust": r, "seed": s} for r in ("bounded", "none")]
        for k in KS:
            who = {"fraction": k / 10}
            out.append({"name": f"bounded-absent{k}-s{s}", "robust": "bounded", "attack": "nan",
                        "attack_args": who, "seed": s})
            for f in FACTORS:
                for r in (("bounded", "none") if k == 5 else ("bounded",)):
                    out.append({"name": f"{r}-k{k}-x{f:g}-s{s}", "robust": r, "attack": "scale",
                                "attack_args": {**who, "factor": f}, "seed": s})
    return out


def run(jobs: int) -> None:
    sweep(OUT, {"base": DIGITS, "out": str(OUT), "runs": runs()}, jobs)


def acc(name: str, seed: int) -> float | None:
    f = OUT / f"{name}-s{seed}" / "summary.json"
    return 100 * json.loads(f.read_text())["final"]["global_acc"] if f.exists() else None


def accs(name: str) -> list[float]:
    return [a for s in SEEDS if (a := acc(name, s)) is not None]


def paired(a: str, b: str) -> str:
    """mean difference a - b over the seeds both have, (worst seed), and, with every seed, the paired t-test's p."""
    d = [x - y for s in SEEDS if (x := acc(a, s)) is not None and (y := acc(b, s)) is not None]
    if not d:
        return "-"
    m, _, p = paired_t(d)
    return f"{m:+.2f} (worst {min(d):+.2f})" + (f", p={p:.2f}" if len(d) == len(SEEDS) and math.isfinite(p) else "")


def table() -> None:
    print("| shrunken clients | absent (never reply) | " + " | ".join(f"x{f:g}" for f in FACTORS)
          + " | x" + " / x".join(f"{f:g}" for f in FACTORS) + " minus absent (worst seed) |")
    print("|---" * (3 + len(FACTORS)) + "|")
    for k in KS:
        row = [f"{k} of 10", cell(accs(f"bounded-absent{k}"))] + [cell(accs(f"bounded-k{k}-x{f:g}"))
                                                                  for f in FACTORS]
        row.append(" / ".join(paired(f"bounded-k{k}-x{f:g}", f"bounded-absent{k}") for f in FACTORS))
        print("| " + " | ".join(row) + " |")
    print()
    print("| five of ten | bounded | none | bounded minus none |")
    print("|---|---|---|---|")
    for f in FACTORS:
        print(f"| x{f:g} | {cell(accs(f'bounded-k5-x{f:g}'))} | {cell(accs(f'none-k5-x{f:g}'))} | "
              f"{paired(f'bounded-k5-x{f:g}', f'none-k5-x{f:g}')} |")
    print(f"| honest | {cell(accs('bounded-honest'))} | {cell(accs('none-honest'))} | "
          f"{paired('bounded-honest', 'none-honest')} |")
    nan = [r["name"] for r in runs() if (a := acc(r["name"][:r["name"].rindex("-s")], r["seed"])) is not None
           and math.isnan(a)]
    if nan:
        print("\nNaN accuracy:", ", ".join(nan))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run").add_argument("--jobs", type=int, default=1)
    sub.add_parser("table")
    a = ap.parse_args()
    run(a.jobs) if a.cmd == "run" else table()


if __name__ == "__main__":
    main()
