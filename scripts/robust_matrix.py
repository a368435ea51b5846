"""The rules x attacks table of issue 48 (docs/results.md, "Free riders, a wild FedAsync client and colluders"):
every built-in rule against every attack, 3 seeds, on the digits case of issue 39, with each rule's honest cost
paired over seeds against `none`.

    python scripts/robust_matrix.py run [--jobs 2] [--rules R ...]   # runs/robust-matrix/sweep.yaml, fedlase sweep
    python scripts/robust_matrix.py table              # the markdown table from whatever has finished

`run` is resumable (a run with summary.json is skipped); runs are ordered seed by seed, so a sweep cut short
still holds whole seeds. Every run sets its rule explicitly, so the table does not depend on the default of the
day. The attackers are drawn from each run's seed (attack_args.fraction), so each seed has its own.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

OUT = Path("runs/robust-matrix")
SEEDS = (0, 1, 2)
RULES = {   # name -> the config keys that choose the rule (each at its defaults)
    "bounded": {"robust": "bounded"},
    "screen": {"robust": "screen"},
    "centered_clip": {"robust": "centered_clip"},
    "trimmed_mean": {"robust": "trimmed_mean"},
    "median": {"robust": "median"},
    "multikrum": {"robust": "multikrum"},
    "none": {"robust": "none"},
}
# three of ten clients attack (the colluders and sign flippers), five of ten ride free (the issue's)
ATTACKS = {
    "honest": {},
    "scale x50": {"attack": "scale", "attack_args": {"factor": 50, "fraction": 0.3}},
    "sign flip x1": {"attack": "sign_flip", "attack_args": {"factor": 1, "fraction": 0.3}},
    "gaussian 0.01": {"attack": "gaussian", "attack_args": {"std": 0.01, "fraction": 0.3}},
    "free riders x1e-12": {"attack": "scale", "attack_args": {"factor": 1e-12, "fraction": 0.5}},
    "little is enough z=1.5": {"attack": "little_is_enough", "attack_args": {"z": 1.5, "fraction": 0.3}},
    "inner product eps=0.1": {"attack": "inner_product", "attack_args": {"eps": 0.1, "fraction": 0.3}},
}
DIGITS = {"dataset": "digits", "system": "{1,1/4}_{9,1}", "participation": 1, "rounds": 20, "eval_every": 20,
          "local_steps": 1, "lr": 0.1, "method": "fedlase", "threads": 1, "checkpoint_every": 0}


def _tag(attack: str) -> str:
    return attack.split()[0] if attack != "free riders x1e-12" else "free"


def plan(rules=tuple(RULES)) -> dict:
    runs = [{"name": f"{r}-{_tag(a)}-s{s}", **RULES[r], **ATTACKS[a], "seed": s}
            for s in SEEDS for a in ATTACKS for r in rules]
    return {"base": DIGITS, "out": str(OUT), "runs": runs}


def sweep(out: Path, spec: dict, jobs: int) -> None:
    """Write the sweep file `spec` into `out` and run it (resumable: finished runs are skipped)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    subprocess.run([sys.executable, "-m", "fedlase", "sweep", str(path), "--quiet", "--jobs", str(jobs)], check=True)


def run(jobs: int, rules=tuple(RULES)) -> None:
    sweep(OUT, plan(rules), jobs)


def acc(rule: str, attack: str, seed: int) -> float | None:
    f = OUT / f"{rule}-{_tag(attack)}-s{seed}" / "summary.json"
    return 100 * json.loads(f.read_text())["final"]["global_acc"] if f.exists() else None


def cell(vals: list[float]) -> str:
    """mean ± std over the seeds, and how many seeds where not all (n=...)."""
    if not vals:
        return "-"
    sd = f" ± {statistics.stdev(vals):.1f}" if len(vals) > 1 else ""
    return f"{statistics.mean(vals):.1f}{sd}" + ("" if len(vals) == len(SEEDS) else f" (n={len(vals)})")


def table() -> None:
    """Global accuracy (mean over levels, %), mean ± std over the seeds; the worst attack per rule; the honest
    cost: the rule's honest run minus none's, paired by seed, with a two-sided paired t-test."""
    from scipy import stats
    print("| attack | " + " | ".join(RULES) + " |\n|---|" + "---|" * len(RULES))
    worst = {r: math.inf for r in RULES}
    for a in ATTACKS:
        cells = []
        for r in RULES:
            vals = [v for s in SEEDS if (v := acc(r, a, s)) is not None]
            cells.append(cell(vals))
            if vals:
                worst[r] = min(worst[r], statistics.mean(vals))
        print(f"| {a} | " + " | ".join(cells) + " |")
    print("| worst (mean over seeds) | " + " | ".join(f"{w:.1f}" for w in worst.values()) + " |")
    cost = []
    for r in RULES:
        pairs = [(x, y) for s in SEEDS if (x := acc("none", "honest", s)) is not None
                 and (y := acc(r, "honest", s)) is not None]
        d = [y - x for x, y in pairs]
        if r == "none" or not d:
            cost.append("-")
            continue
        p = float(stats.ttest_rel([y for _, y in pairs], [x for x, _ in pairs]).pvalue) \
            if len(d) > 1 and any(x != d[0] for x in d) else math.nan
        cost.append(f"{statistics.mean(d):+.2f} (p={p:.2f})")
    print("| honest cost vs none (points, paired) | " + " | ".join(cost) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--rules", nargs="+", choices=tuple(RULES), default=tuple(RULES), help="run: these rules only")
    a = ap.parse_args()
    run(a.jobs, a.rules) if a.what == "run" else table()


if __name__ == "__main__":
    main()
