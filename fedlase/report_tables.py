"""The report's tables, as (header, rows) of strings, and Markdown from them: accuracy per level, privacy,
accuracy over rounds, the server step's totals, analysis summaries, per-layer magnitudes and the paired
comparison by seed."""
from __future__ import annotations

import math

import numpy as np

from .errors import UserError
from .report_runs import ALL, Group, Run


def mean_cell(mean: float, std: float, n: int, scale: float = 100, digits: int = 2) -> str:
    if n == 0:
        return "—"
    return f"{scale * mean:.{digits}f}" + (f" ± {scale * std:.{digits}f}" if n > 1 else "")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (report and bench)."""
    esc = lambda s: str(s).replace("|", "\\|")   # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    return "\n".join(lines)


def metric_table(groups: list[Group], levels: list[str], name: str, overall: str,
                 scale: float = 100) -> tuple[list, list]:
    header = ["group", "runs", *levels, overall]
    rows = [[g.label, str(len(g.runs)), *(mean_cell(*g.stats(name, lvl), scale=scale) for lvl in [*levels, ALL])]
            for g in groups]
    return header, rows


def main_table(groups: list[Group], levels: list[str]) -> tuple[list, list]:
    """The papers' layout: local (mean over clients) | global accuracy of each level | global (mean over levels)."""
    header = ["group", "runs", "local", *levels, "global"]
    rows = [[g.label, str(len(g.runs)), mean_cell(*g.stats("local_acc")),
             *(mean_cell(*g.stats("global_acc", lvl)) for lvl in levels), mean_cell(*g.stats("global_acc"))]
            for g in groups]
    return header, rows


def privacy_table(groups: list[Group]) -> tuple[list, list]:
    """Per group: rounds run, delta, noise multiplier, epsilon (mean over its runs; the runs of a group share
    the dp settings, so they differ only where `max_epsilon` stopped them at other rounds) and how many stopped."""
    rows = []
    for g in groups:
        dp = [r for r in g.runs if "epsilon" in r.final]
        if not dp:
            rows.append([g.label, str(len(g.runs)), "", "", "", "off", ""])
            continue
        eps = [r.final["epsilon"] for r in dp]
        last = dp[0].final.get("dp", {})
        rows.append([g.label, str(len(g.runs)), ", ".join(sorted({str(r.final["round"]) for r in dp})),
                     f"{last.get('delta', math.nan):.3g}", f"{last.get('noise_multiplier', math.nan):.4g}",
                     f"{sum(eps) / len(eps):.4g}", str(sum("stopped" in r.summary for r in dp))])
    return ["group", "runs", "rounds run", "delta", "z", "epsilon", "stopped"], rows


def robust_table(groups: list[Group], levels: list[str]) -> tuple[list, list]:
    """Per group and level: the updates the server step rejected, clipped and found near zero over the whole run
    (the last line's `robust_totals`, fedlase/server_step.py), mean over the group's runs."""
    kinds = ("rejected", "clipped", "near_zero")
    header = ["group", "runs", *(f"{k} {lvl}" for k in kinds for lvl in levels)]
    rows = []
    for g in groups:
        totals = [r.final.get("robust_totals", {}) for r in g.runs]
        rows.append([g.label, str(len(g.runs)), *(f"{np.mean([t.get(k, {}).get(lvl, 0) for t in totals]):.1f}"
                                                  for k in kinds for lvl in levels)])
    return header, rows


def curve_table(groups: list[Group], metric: str = "global_acc", columns: int = 8) -> tuple[list, list] | None:
    """Mean over a group's runs of `metric` (all levels) at up to `columns` evaluated rounds, evenly spread and
    ending at the last; a run's value at a round it did not evaluate is left out of that cell."""
    curves = {id(r): {ln["round"]: ln.get(metric) for ln in r.curve() if ln.get(metric) is not None}
              for g in groups for r in g.runs}
    rounds = sorted({rnd for c in curves.values() for rnd in c})
    if len(rounds) < 2:
        return None
    pick = [rounds[i] for i in sorted(set(np.linspace(0, len(rounds) - 1, min(columns, len(rounds)))
                                          .round().astype(int)))]
    rows = []
    for g in groups:
        cells = []
        for rnd in pick:
            vals = [curves[id(r)][rnd] for r in g.runs if rnd in curves[id(r)]]
            cells.append(f"{100 * np.mean(vals):.1f}" if vals else "")
        rows.append([g.label, str(len(g.runs)), *cells])
    return ["group", "runs", *(f"round {rnd}" for rnd in pick)], rows


def _analysis_value(run: Run, path: tuple) -> float:
    v = run.final
    for p in path:
        if not isinstance(v, dict) or p not in v:
            return math.nan
        v = v[p]
    return float(v)


def analysis_stats(g: Group, path: tuple) -> tuple[float, float, int]:
    vals = [v for v in (_analysis_value(r, path) for r in g.runs) if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, 0
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def short_layer(layer: str) -> str:
    return layer[: -len(".weight")] if layer.endswith(".weight") else layer

def magnitude_table(g: Group) -> tuple[list, list] | None:
    """The rebuttal's layout: per-layer max and mean |w| of the global model at the last recorded round, weights
    only, the first and last layers left out (the group's first run that recorded magnitudes)."""
    z = next((z for z in (r.npz("magnitudes") for r in g.runs) if z is not None), None)
    if z is None:
        return None
    names = [str(s) for s in z["layers"]]
    cols = [i for i, n in enumerate(names) if n.endswith("weight")][1:-1]
    if not cols:
        return None
    header = [f"{g.label}, round {int(z['rounds'][-1])}", *(short_layer(names[i]) for i in cols)]
    rows = [[f"{stat} |θ|", *(f"{float(z[stat][-1][i]):.4f}" for i in cols)] for stat in ("max", "mean")]
    return header, rows

def paired_t(diffs: list[float]) -> tuple[float, float, float]:
    """(mean difference, t, two-sided p) of a paired t-test on per-seed differences (scipy's one-sample t-test
    of the differences against 0); t and p are nan for fewer than two pairs or differences without spread."""
    n = len(diffs)
    mean = float(np.mean(diffs)) if n else math.nan
    if n < 2 or float(np.std(diffs)) == 0:
        return mean, math.nan, math.nan
    from scipy import stats  # imported here: ~0.3 s that only a paired report pays
    res = stats.ttest_1samp(diffs, 0.0)
    return mean, float(res.statistic), float(res.pvalue)


def paired_table(groups: list[Group], baseline: str) -> tuple[list, list]:
    """Every group against the baseline group, paired by seed: mean difference (points), t and p."""
    base = next((g for g in groups if g.label == baseline), None)
    if base is None:
        raise UserError(f"report: --paired-against {baseline!r} names no group; groups: "
                        + "; ".join(g.label for g in groups))
    by_seed = {r.config.get("seed"): r for r in base.runs}
    rows = []
    for g in groups:
        if g is base:
            continue
        cells = [g.label]
        pairs = [(r, by_seed[r.config.get("seed")]) for r in g.runs if r.config.get("seed") in by_seed]
        for name in ("global_acc", "local_acc"):
            mean, t, p = paired_t([100 * (r.metric(name) - b.metric(name)) for r, b in pairs])
            cells += [f"{mean:+.2f}", "—" if math.isnan(t) else f"{t:.2f}", "—" if math.isnan(p) else f"{p:.3f}"]
        rows.append([*cells[:1], str(len(pairs)), *cells[1:]])
    return (["group", "seeds paired", "global Δ", "t", "p", "local Δ", "t", "p"], rows)
