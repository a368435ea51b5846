"""The report: result tables (Markdown, CSV) and plots (PNG) from finished runs.

Runs are found by their summary.json under the given folders. Runs whose configs agree on every key except
the seed (and keys that do not change results: out, threads, device, checkpoint, evaluation and analysis
settings) form a group, reported as mean +- sample std (ddof=1) over its runs. The runs and groups are
fedlase/report_runs.py's, the tables report_tables.py's, the plots report_plots.py's, and the cost tables and
simulated clocks report_clocks.py's."""
from __future__ import annotations

import csv
import re
from fractions import Fraction
from pathlib import Path

from .report_clocks import equal_time_table, paired_at_time, run_clocks
from .report_plots import plot_accuracy, plot_magnitudes, plot_ratios, plot_time, plot_updates
from .report_runs import ALL, METRICS, Group, Run, find_runs, fmt_value, group_runs, levels_of
from .report_tables import (
    analysis_stats,
    curve_table,
    magnitude_table,
    main_table,
    markdown_table,
    mean_cell,
    metric_table,
    paired_table,
    privacy_table,
    robust_table,
)


def make_report(dirs: list[str], out: str | Path, group_by: list[str] | None = None,
                paired_against: str | None = None, cost: bool = True, targets: list[float] | None = None) -> Path:
    """Write report.md, results.csv, runs.csv and plots/ under `out`; return the path of report.md. `cost`: add
    each group's cost table and the runs' simulated time (from the runs' sim.json, or the group's parts rebuilt:
    data and a step; `run_clocks`). `targets`: the global accuracies (fractions) whose times to reach are
    tabulated (default: the median of the groups' final accuracies)."""
    runs = find_runs(dirs)
    groups = group_runs(runs, group_by)
    levels = levels_of(groups)
    out = Path(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    md = [f"# Results\n\n{len(runs)} runs in {len(groups)} groups; cells are mean ± std (sample std over the "
          "group's runs, i.e. seeds) in %, a single run shows its value. Levels are resource levels "
          "(fraction of the model a client holds); `global` = a level's submodel on the whole test set, "
          "`local` = the level's clients on their own test splits.\n"]
    md.append(markdown_table(["group", "runs", "seeds", "rounds", "method", "dataset", "system"],
                        [[g.label, str(len(g.runs)),
                          ", ".join(sorted({fmt_value(r.config.get("seed")) for r in g.runs})),
                          fmt_value(g.runs[0].config.get("rounds")), fmt_value(g.runs[0].config.get("method")),
                          fmt_value(g.runs[0].config.get("dataset")), fmt_value(g.runs[0].config.get("system"))]
                         for g in groups]))
    sections = [("Accuracy (%): local = mean over all clients, per-level and mean global accuracy",
                 main_table(groups, levels))]
    for name, overall in (("local_acc", "all clients"), ("global_acc", "mean"), ("local_std", "all clients"),
                          ("local_worst10", "all clients")):
        sections.append((f"{METRICS[name].capitalize()} per level (%)", metric_table(groups, levels, name, overall)))
    if any("global_ppl" in r.final for r in runs):   # task=lm: accuracy above is the next token's
        for name, overall in (("global_ppl", "mean"), ("local_ppl", "all clients")):
            sections.append((f"{METRICS[name].capitalize()} per level (task=lm; lower is better)",
                             metric_table(groups, levels, name, overall, scale=1)))
    if any("epsilon" in r.final for r in runs):   # dp (fedlase/privacy.py): the privacy each group spent
        sections.append(("Differential privacy: epsilon at delta after the rounds run (dp; a run that "
                         "dp.max_epsilon stopped counts as stopped)", privacy_table(groups)))
    if any(any(r.final.get("robust_totals", {}).values()) for r in runs):   # fedlase/server_step.py
        sections.append(("Server step: updates rejected, clipped and near zero over the run, per level (mean over "
                         "the group's runs)", robust_table(groups, levels)))
    over_rounds = curve_table(groups)
    if over_rounds is not None:
        sections.append(("Global accuracy over rounds (%, mean over the group's runs)", over_rounds))
    if any("ratio_std" in r.final for r in runs):
        ratio_levels = sorted({lvl for r in runs for lvl in r.final.get("ratio_std", {})},
                              key=lambda s: float(Fraction(s)))
        sections.append(("Extraction-ratio stability: ratio_std per level (mean over layers, x100)",
                         (["group", "runs", *ratio_levels],
                          [[g.label, str(len(g.runs)), *(mean_cell(*analysis_stats(g, ("ratio_std", lvl)), digits=3)
                                                         for lvl in ratio_levels)] for g in groups])))
    if any("updates" in r.final for r in runs):
        sections.append(("Cumulative update counts over all maskable coordinates",
                         (["group", "runs", "never trained (%)", "Gini", "mean count"],
                          [[g.label, str(len(g.runs)), mean_cell(*analysis_stats(g, ("updates", "never"))),
                            mean_cell(*analysis_stats(g, ("updates", "gini")), scale=1, digits=3),
                            mean_cell(*analysis_stats(g, ("updates", "mean")), scale=1, digits=1)] for g in groups])))
    for g in groups:
        table = magnitude_table(g)
        if table is not None:
            sections.append(("Per-layer parameter magnitudes (weights; first and last layers left out)", table))
    tables, clocks = run_clocks(groups) if cost else ({}, {})
    timed = equal_time_table(groups, clocks, targets)
    if timed is not None:
        what = ("the given global accuracies" if targets else "A, the median of the groups' final accuracies")
        sections.append((f"Accuracy at equal simulated time (fedlase/simtime.py; each run's device_model, unset: "
                         f"the defaults): global accuracy (mean over levels) and local accuracy (mean over clients) "
                         f"at the common budget T (the shortest group's time to finish), and the time to reach {what}; "
                         f"interpolated between evaluations: {timed[0]}", timed[1:]))
    if paired_against is not None:
        sections.append((f"Paired by seed against {paired_against} (difference in points, paired t-test)",
                         paired_table(groups, paired_against)))
        at_time = paired_at_time(groups, clocks, paired_against)
        if at_time is not None:
            sections.append((f"Paired by seed against {paired_against} at equal simulated time (global accuracy "
                             f"at T, difference in points, paired t-test): {at_time[0]}", at_time[1:]))
    for title, (header, rows) in sections:
        md += [f"\n## {title}\n", markdown_table(header, rows)]
    if tables:
        from .cost import format_cost_table
        md.append("\n## Cost per level (fedlase/cost.py: one local step of one batch, round 1's submodels of the "
                  "initial model; `fedlase cost CONFIG` also measures the peak memory)\n")
        for g in groups:
            if id(g) in tables:
                md += [f"\n### {g.label}\n", format_cost_table(tables[id(g)]).split("\n\n", 1)[1]]
        populated = [g for g in groups if id(g) in tables and g.runs[0].summary["config"].get("population")]
        if populated:   # the device population of each group (its first run's config)
            from .config import config_from_dict
            from .simtime import time_spread_table
            md.append("\n## Device populations (fedlase/population.py): each level's client times, dense charge, "
                      "simulated seconds a round\n")
            for g in populated:
                cfg = config_from_dict(dict(g.runs[0].summary["config"]))
                md += [f"\n### {g.label}\n", time_spread_table(cfg, tables[id(g)]).split("\n", 1)[1].lstrip()]

    plots = []
    for metric in ("global_acc", "local_acc"):
        if plot_accuracy(groups, levels, metric, out / "plots" / f"accuracy_{metric}.png"):
            plots.append((f"{METRICS[metric].capitalize()} over rounds", f"plots/accuracy_{metric}.png"))
    if plot_time(groups, clocks, out / "plots" / "accuracy_time.png"):
        plots.append(("Accuracy against rounds and simulated time", "plots/accuracy_time.png"))
    if plot_updates(groups, out / "plots" / "update_counts.png"):
        plots.append(("Cumulative update counts", "plots/update_counts.png"))
    tags: set[str] = set()
    for i, g in enumerate(groups, 1):
        tag = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", g.label.replace(", ", ","))[:80]
        tag = tag if tag not in tags else f"{tag}_{i}"   # labels are distinct, their file-safe forms may not be
        tags.add(tag)
        if plot_ratios(g, out / "plots" / f"ratios_{tag}.png"):
            plots.append((f"Extraction ratios: {g.label}", f"plots/ratios_{tag}.png"))
        if plot_magnitudes(g, out / "plots" / f"magnitudes_{tag}.png"):
            plots.append((f"Magnitudes: {g.label}", f"plots/magnitudes_{tag}.png"))
    if plots:
        md.append("\n## Plots\n")
        md += [f"![{title}]({p})\n" for title, p in plots]

    (out / "report.md").write_text("\n".join(md) + "\n")
    _write_csvs(out, runs, groups, levels)
    return out / "report.md"

def _write_csvs(out: Path, runs: list[Run], groups: list[Group], levels: list[str]) -> None:
    """results.csv: one row per (group, level, metric) with mean, std, n; runs.csv: one row per run."""
    rows = []
    for g in groups:
        for name in METRICS:
            for lvl in [*levels, ALL]:
                mean, std, n = g.stats(name, lvl)
                if n:
                    rows.append([g.label, lvl, name, mean, std, n])
    write_csv(out / "results.csv", ["group", "level", "metric", "mean", "std", "n"], rows)
    label = {id(r): g.label for g in groups for r in g.runs}
    header = ["run", "group", "seed", *(f"{m}[{lvl}]" for m in METRICS for lvl in [*levels, ALL]), "train_time"]
    write_csv(out / "runs.csv", header,
              [[str(r.path), label[id(r)], r.config.get("seed"),
                *(r.metric(m, lvl) for m in METRICS for lvl in [*levels, ALL]), r.summary.get("train_time")]
               for r in runs])


def write_csv(path: Path, header: list, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
