"""Adapters against full-parameter submodels on MiniLM at equal simulated time (docs/results.md, "Adapters against
submodels on MiniLM"). experiments/lora-bbc.yaml evaluates only after round 8; on the simulated clock the adapter
runs end there after about 6,500-7,600 s, when a full-parameter client has sent its 90 MB model once or twice.
So the budget of each seed is T = the time its slowest adapter run ends (every adapter run has finished by then
and counts its final accuracy, which favours none of them), and the full-parameter groups are read from
experiments/lora-bbc-early.yaml (the same runs' first two rounds, evaluated after each), interpolated at T.

    python scripts/lora_equal_time.py [runs/lora-bbc] [runs/lora-bbc-early]

prints a Markdown table per charge: each group's rounds done by T, global and local accuracy at T (mean ± std over
the seeds, %) and the paired difference from HetLoRA."""
from __future__ import annotations

import math
import sys
from collections import defaultdict

import numpy as np

from fedlase.catalog import load_builtins
from fedlase.report_clocks import acc_at, run_clocks, time_curve
from fedlase.report_runs import Group, find_runs
from fedlase.report_tables import paired_t
from fedlase.sim_config import CHARGES


def groups_by_name(dirs: list[str]) -> list[Group]:
    """The runs grouped by their sweep name (the folder name before ',seed=')."""
    by = defaultdict(list)
    for r in find_runs(dirs):
        by[r.path.name.split(",seed=")[0]].append(r)
    return [Group(name, (name,), sorted(runs, key=lambda r: r.config["seed"])) for name, runs in by.items()]


def main(full_dir: str = "runs/lora-bbc", early_dir: str = "runs/lora-bbc-early") -> None:
    load_builtins()
    early = groups_by_name([early_dir])
    late_full = {g.label for g in early}
    adapters = [g for g in groups_by_name([full_dir]) if g.label not in late_full]
    groups = adapters + early
    _, clocks = run_clocks(groups)
    seeds = sorted({r.config["seed"] for g in groups for r in g.runs})
    for charge in CHARGES:
        ends = {s: max(clocks[id(r)][charge].elapsed(r.summary["rounds"]) for g in adapters for r in g.runs
                       if r.config["seed"] == s) for s in seeds}
        print(f"\n{charge} charge: T per seed = " + ", ".join(f"{ends[s]:.0f} s (seed {s})" for s in seeds) + "\n")
        print("| group | rounds done by T | global acc at T | local acc at T | global vs hetlora (p) |")
        print("|---|---|---|---|---|")
        base = {}
        rows = []
        for g in groups:
            glob, loc, done = {}, {}, []
            for r in g.runs:
                s, clock = r.config["seed"], clocks[id(r)][charge]
                T = ends[s]
                pts = time_curve(r, clock)
                if T > pts[-1][0] + 1e-6 and r.summary["rounds"] < 8:   # not evaluated by T: unknown
                    done.append(f">{r.summary['rounds']}")
                    glob[s] = loc[s] = None
                    continue
                done.append(max(k for k in range(r.summary["rounds"] + 1) if clock.elapsed(k) <= T + 1e-6))
                if pts[-1][0] <= T:   # finished by T: its final accuracy
                    glob[s], loc[s] = r.metric("global_acc"), r.metric("local_acc")
                else:   # interpolated between its evaluations (None: none by T)
                    glob[s], loc[s] = acc_at(r, clock, T), acc_at(r, clock, T, "local_acc")
            if g.label == "hetlora":
                base = glob
            rows.append((g.label, done, glob, loc))
        for label, done, glob, loc in rows:
            def cell(d):
                v = [100 * x for x in d.values() if x is not None and math.isfinite(x)]
                return f"{np.mean(v):.1f} ± {np.std(v, ddof=1):.1f}" if len(v) > 1 else "—"
            diffs = [100 * (glob[s] - base[s]) for s in glob if s in base and glob[s] is not None
                     and math.isfinite(glob[s])]
            rounds = ", ".join(sorted(set(map(str, done))))
            if not diffs:
                print(f"| {label} | {rounds} | — | — | |")
                continue
            mean, _, p = paired_t(diffs)
            vs = "" if label == "hetlora" else f"{mean:+.2f} ({p:.3f})" if math.isfinite(p) else f"{mean:+.2f}"
            print(f"| {label} | {rounds} | {cell(glob)} | {cell(loc)} | {vs} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
