"""Result tables (Markdown, CSV) and plots (PNG) from finished runs.

Runs are found by their summary.json under the given folders. Runs whose configs agree on every key except
the seed (and keys that do not change results: out, threads, device, checkpoint, evaluation and analysis
settings) form a group, reported as mean +- sample std (ddof=1) over its runs."""
from __future__ import annotations

import csv
import json
import logging
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

from .errors import UserError

log = logging.getLogger("fedlase")



def not_grouped() -> set[str]:
    """Keys never used to tell groups apart by default: the seed (a group's runs are its seeds) and the keys
    declared not to change a result (fedlase/options.py), except rounds (a run's length is part of its result)."""
    from .config import options
    return ({"seed"} | {k for k, o in options().items() if not o.affects_result}) - {"rounds"}
METRICS = {"global_acc": "global accuracy", "local_acc": "local accuracy", "local_std": "std of local accuracies",
           "local_worst10": "worst-10% local accuracy"}
ALL = "all"   # the row/column of a metric over all levels (mean over levels / over all clients)


@dataclass
class Run:
    path: Path
    summary: dict
    config: dict        # flattened: dotted keys

    @property
    def final(self) -> dict:
        return self.summary["final"]

    def metric(self, name: str, level: str = ALL) -> float:
        src = self.final if level == ALL else self.final["levels"].get(level, {})
        return float(src.get(name, math.nan))

    def curve(self) -> list[dict]:
        f = self.path / "metrics.jsonl"
        return [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()] if f.is_file() else []

    def npz(self, name: str):
        f = self.path / "analysis" / f"{name}.npz"
        return np.load(f, allow_pickle=False) if f.is_file() else None   # arrays only: a run folder is data


@dataclass
class Group:
    label: str
    key: tuple
    runs: list[Run] = field(default_factory=list)

    def stats(self, name: str, level: str = ALL) -> tuple[float, float, int]:
        """(mean, sample std, n) over the group's runs that have the value."""
        vals = [v for v in (r.metric(name, level) for r in self.runs) if not math.isnan(v)]
        if not vals:
            return math.nan, math.nan, 0
        return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):   # an empty mapping adds no key: method_args {} is "no options set"
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def key_defaults() -> dict:
    """Every top-level config key's default (mappings such as method_args have none to fill)."""
    from .config import options
    return {k: o.default for k, o in options().items() if not isinstance(o.default, dict)}


def find_runs(dirs: list[str]) -> list[Run]:
    runs, seen = [], set()
    defaults = key_defaults()   # a key added after a run was made is read as its default (the old behaviour)
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            raise UserError(f"report: {d} is not a folder")
        found = sorted(p.rglob("summary.json"))
        if not found:
            raise UserError(f"report: no finished run (summary.json) under {d}")
        for f in found:
            if f.resolve() in seen:
                continue
            seen.add(f.resolve())
            try:
                summary = json.loads(f.read_text())
                runs.append(Run(f.parent, summary, {**defaults, **flatten(summary["config"])}))
            except (json.JSONDecodeError, KeyError) as e:
                log.warning("report: skipping %s (unreadable: %s)", f, e)
    if not runs:
        raise UserError("report: no readable summary.json found")
    return runs


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    return "null" if v is None else str(v)


def group_runs(runs: list[Run], group_by: list[str] | None = None) -> list[Group]:
    """Groups in first-seen order; labels name only the keys whose values differ between groups."""
    if group_by:
        keys = list(group_by)
    else:
        skip = not_grouped()
        keys = sorted({k for r in runs for k in r.config
                       if k not in skip and not k.startswith("analysis.") and k != "analysis"})
    groups: dict[tuple, Group] = {}
    for r in runs:
        key = tuple(json.dumps(r.config.get(k), sort_keys=True, default=str) for k in keys)
        groups.setdefault(key, Group("", key)).runs.append(r)
    varying = [i for i, k in enumerate(keys) if len({g.key[i] for g in groups.values()}) > 1]
    # the method first: it is what tables compare
    varying.sort(key=lambda i: (keys[i] != "method", keys[i]))
    for g in groups.values():
        cfg = g.runs[0].config
        parts = [f"{keys[i]}={_fmt(cfg[keys[i]])}" for i in varying if keys[i] in cfg]
        g.label = ", ".join(parts) or _fmt(cfg.get("method", "all runs"))
    return list(groups.values())


def levels_of(groups: list[Group]) -> list[str]:
    """Level names of all runs, smallest first (the papers' column order)."""
    names = {lvl for g in groups for r in g.runs for lvl in r.final.get("levels", {})}
    return sorted(names, key=lambda s: float(Fraction(s)))


# ---- tables ----------------------------------------------------------------------------------------------------
def _cell(mean: float, std: float, n: int, scale: float = 100, digits: int = 2) -> str:
    if n == 0:
        return "—"
    return f"{scale * mean:.{digits}f}" + (f" ± {scale * std:.{digits}f}" if n > 1 else "")


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A Markdown table (report and bench)."""
    esc = lambda s: str(s).replace("|", "\\|")   # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    return "\n".join(lines)


def metric_table(groups: list[Group], levels: list[str], name: str, overall: str) -> tuple[list, list]:
    header = ["group", "runs", *levels, overall]
    rows = [[g.label, str(len(g.runs)), *(_cell(*g.stats(name, lvl)) for lvl in [*levels, ALL])] for g in groups]
    return header, rows


def main_table(groups: list[Group], levels: list[str]) -> tuple[list, list]:
    """The papers' layout: local (mean over clients) | global accuracy of each level | global (mean over levels)."""
    header = ["group", "runs", "local", *levels, "global"]
    rows = [[g.label, str(len(g.runs)), _cell(*g.stats("local_acc")),
             *(_cell(*g.stats("global_acc", lvl)) for lvl in levels), _cell(*g.stats("global_acc"))] for g in groups]
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


def _analysis_stats(g: Group, path: tuple) -> tuple[float, float, int]:
    vals = [v for v in (_analysis_value(r, path) for r in g.runs) if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, 0
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def write_csv(path: Path, header: list, rows: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


# ---- plots -----------------------------------------------------------------------------------------------------
def _short(layer: str) -> str:
    return layer[: -len(".weight")] if layer.endswith(".weight") else layer


def _plt():
    import matplotlib
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    return plt



def plot_accuracy(groups: list[Group], levels: list[str], metric: str, path: Path) -> bool:
    """One panel per level (+ the overall mean); a line per group: mean over runs, band = +- std."""
    curves = {id(g): [r.curve() for r in g.runs] for g in groups}
    if not any(c for cs in curves.values() for c in cs):
        return False
    plt = _plt()
    panels = [*levels, ALL]
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows + 0.4 + 0.25 * len(groups)),
                             squeeze=False, sharey=True)
    for ax, lvl in zip(axes.flat, panels):
        for g in groups:
            series = []
            for c in curves[id(g)]:
                pts = {ln["round"]: (ln if lvl == ALL else ln["levels"].get(lvl, {})).get(metric) for ln in c}
                series.append({k: v for k, v in pts.items() if v is not None})
            common = sorted(set.intersection(*(set(s) for s in series))) if series else []
            if not common:
                continue
            vals = np.array([[s[rnd] for rnd in common] for s in series]) * 100
            mean = vals.mean(axis=0)
            line, = ax.plot(common, mean, label=g.label, marker="." if len(common) < 30 else None)
            if len(series) > 1:
                sd = vals.std(axis=0, ddof=1)
                ax.fill_between(common, mean - sd, mean + sd, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title("mean over levels" if lvl == ALL and metric == "global_acc" else
                     "all clients" if lvl == ALL else f"level {lvl}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_ylabel(f"{METRICS[metric]} (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.suptitle(f"{METRICS[metric].capitalize()} over rounds (mean ± std over seeds)")
    fig.legend(handles, labels, loc="lower center", ncol=1 if len(groups) > 3 else len(groups), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.03 + 0.055 * (len(groups) if len(groups) > 3 else 1) / rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _mean_npz(g: Group, name: str, key: str):
    """The group's array `key` of analysis `name`, averaged over its runs (runs whose shape differs are left out)."""
    arrays = [(z[key], z) for z in (r.npz(name) for r in g.runs) if z is not None]
    if not arrays:
        return None, None
    first, z = arrays[0]
    same = [a for a, _ in arrays if a.shape == first.shape]
    return np.mean(same, axis=0), z


def plot_ratios(g: Group, path: Path) -> bool:
    ratios, z = _mean_npz(g, "ratios", "ratios")
    if ratios is None:
        return False
    plt = _plt()
    levels, rounds, layers = z["levels"], z["rounds"], [_short(str(s)) for s in z["layers"]]
    from .levels import level_name
    n = len(levels)
    height = max(2.5, 0.22 * len(layers) + 1.2)
    fig, axes = plt.subplots(1, n, figsize=(3.4 * n + 1.8, height + 0.6), squeeze=False, sharey=True,
                             layout="constrained")
    order = np.argsort(levels)   # smallest level first, as in the tables
    for ax, i in zip(axes[0], order):
        im = ax.imshow(ratios[i].T, aspect="auto", interpolation="nearest", vmin=0, vmax=1, cmap="viridis",
                       extent=(rounds[0] - 0.5, rounds[-1] + 0.5, len(layers) - 0.5, -0.5))
        ax.set_title(f"level {level_name(float(levels[i]))}")
        ax.set_xlabel("round")
        if len(rounds) <= 10:
            ax.set_xticks(rounds)
        else:
            ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=7)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="extraction ratio (kept / size)", fraction=0.03, pad=0.02)
    fig.suptitle(f"Per-layer extraction ratio over rounds: {g.label}", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_updates(groups: list[Group], path: Path, bins: int = 60) -> bool:
    """Distribution of per-coordinate update counts (all maskable layers), one line per group."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for g in groups:
        zs = [z for z in (r.npz("updates") for r in g.runs) if z is not None]
        if not zs:
            continue
        width = max(z["hist"].shape[1] for z in zs)   # pool the runs' histograms
        hist = sum(np.pad(z["hist"].sum(axis=0), (0, width - z["hist"].shape[1])) for z in zs)
        step = max(1, math.ceil(width / bins))   # counts reach rounds x clients: bin them for a readable curve
        hist = np.add.reduceat(hist, np.arange(0, width, step))
        ax.step(np.arange(len(hist)) * step + (step - 1) / 2, hist / hist.sum(), where="mid", label=g.label)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_yscale("log")
    ax.set_xlabel("times a coordinate was trained (cumulative update count)")
    ax.set_ylabel("share of maskable coordinates")
    ax.set_title("Cumulative update counts of maskable parameters")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


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
    header = [f"{g.label}, round {int(z['rounds'][-1])}", *(_short(names[i]) for i in cols)]
    rows = [[f"{stat} |θ|", *(f"{float(z[stat][-1][i]):.4f}" for i in cols)] for stat in ("max", "mean")]
    return header, rows


def plot_magnitudes(g: Group, path: Path, max_rounds: int = 4) -> bool:
    zs = [z for z in (r.npz("magnitudes") for r in g.runs) if z is not None]
    if not zs:
        return False
    z = zs[0]
    same = [x for x in zs if np.array_equal(x["rounds"], z["rounds"])]
    rounds, layers = z["rounds"], [_short(str(s)) for s in z["layers"]]
    pick = sorted(set(np.linspace(0, len(rounds) - 1, min(max_rounds, len(rounds))).round().astype(int)))
    plt = _plt()
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.45 * len(layers) * len(pick) ** 0.5 + 2), 6.5), sharex=True,
                             layout="constrained")
    x = np.arange(len(layers))
    w = 0.8 / len(pick)
    for ax, stat in zip(axes, ("max", "mean")):
        vals = np.mean([s[stat] for s in same], axis=0)
        for j, i in enumerate(pick):
            ax.bar(x + (j - (len(pick) - 1) / 2) * w, vals[i], w, label=f"round {int(rounds[i])}")
        ax.set_ylabel(f"{stat} |θ|")
        ax.set_title(f"{stat.capitalize()} |θ| per layer", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, ncol=len(pick))
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    axes[1].set_xlabel("layer")
    fig.suptitle(f"Parameter magnitudes of the global model: {g.label}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- cost and simulated time (fedlase/cost.py, fedlase/simtime.py) -------------------------------------------
CHARGES = ("dense", "sparse")


def run_clocks(groups: list[Group]) -> tuple[dict, dict]:
    """({group id: its cost table}, {run id: {charge: SimClock}}), recomputed from each run's config without
    training: the cost table of the group's first run (its initial model, round 1's submodels; no memory
    measurement) and each run's own sampling. A run that had a clock (device_model or deadline) recorded its
    cost table and clients' steps in sim.json: a group whose runs all did loads no data; the others build the
    first run's parts (its data). A group whose config cannot be rebuilt here (its data absent) is left out,
    with a warning."""
    from .checkpoint import check_plugins
    from .config import config_from_dict
    from .simtime import SimClock, recorded_clock
    tables, clocks = {}, {}
    for g in groups:
        try:
            for r in g.runs:   # a run folder's `plugins` are not imported (fedlase/checkpoint.py)
                check_plugins(r.path / "summary.json", r.summary["config"].get("plugins", []),
                              "install them as an entry point, or import them and call fedlase.report.make_report")
            records = [(r.path / "sim.json") for r in g.runs]
            if all(r.summary["config"].get("schedule", "sync") != "sync" for r in g.runs):
                for r in g.runs:   # event-driven: its time is what it recorded, under the charge it ran with
                    charge = r.summary["config"].get("sim_charge", CHARGES[0])
                    clocks[id(r)] = {c: RecordedTimes(r, c == charge) for c in CHARGES}
                if records[0].is_file():
                    cfg = config_from_dict(dict(g.runs[0].summary["config"]))
                    tables[id(g)] = recorded_clock(cfg, json.loads(records[0].read_text())).costs
                continue
            if all(f.is_file() for f in records):
                records = [json.loads(f.read_text()) for f in records]
                for r, rec in zip(g.runs, records):
                    cfg = config_from_dict(dict(r.summary["config"]))
                    clocks[id(r)] = {c: recorded_clock(cfg, rec, c) for c in CHARGES}
                tables[id(g)] = clocks[id(g.runs[0])][CHARGES[0]].costs
                continue
            costs, steps = _costs_and_steps(g.runs[0].summary["config"])
            tables[id(g)] = costs
            for r in g.runs:
                cfg = config_from_dict(dict(r.summary["config"]))
                run_steps = steps if cfg.local_epochs is None else _costs_and_steps(r.summary["config"], False)[1]
                clocks[id(r)] = {c: SimClock(cfg, costs, run_steps, c) for c in CHARGES}
        except Exception as e:   # a report without these sections beats no report
            log.warning("report: no cost table or simulated time for %s (%s)", g.label, e)
    return tables, clocks


class RecordedTimes:
    """The simulated time an asynchronous run (schedule fedbuff/fedasync) recorded at each evaluated step: its
    events depend on every client's time, so it cannot be recomputed under the other charge (NaN there)."""

    def __init__(self, run: Run, valid: bool):
        self.times = {ln["round"]: ln["sim_time"] if valid else math.nan for ln in run.curve() if "sim_time" in ln}

    def elapsed(self, rnd: int) -> float:
        return self.times.get(rnd, math.nan)


def _costs_and_steps(raw: dict, cost: bool = True) -> tuple[list | None, dict]:
    """(the cost table, each client's local steps) of a run's config, from its parts (its data loaded)."""
    from .config import config_from_dict
    from .cost import level_costs
    from .engine import build_parts
    from .simtime import client_steps
    p = build_parts(config_from_dict(dict(raw)))
    costs = level_costs(p.model, p.method, p.trainer, p.levels, p.level_clients) if cost else None
    return costs, client_steps(p.trainer)


def _time_curve(r: Run, clock, metric: str = "global_acc") -> list[tuple[float, float]]:
    """(simulated seconds at the end of the round, metric) at each evaluated round of a run."""
    pts = [(clock.elapsed(ln["round"]), ln[metric]) for ln in r.curve() if ln.get(metric) is not None]
    return [(t, v) for t, v in pts if math.isfinite(t)]   # an asynchronous run has no time under the other charge


def equal_time_table(groups: list[Group], clocks: dict) -> tuple[str, list, list] | None:
    """(budgets, header, rows): per charge, the common budget T (the shortest group's mean simulated time to its
    last round) and each group's global accuracy (mean over levels) at T, linearly interpolated between the two
    evaluations around it (each run's, then the mean over its runs); and each group's time to finish."""
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    if not timed:
        return None
    header, rows, budgets = ["group", "runs"], {id(g): [g.label, str(len(g.runs))] for g in timed}, []
    for c in CHARGES:
        ends = {id(g): float(np.mean([clocks[id(r)][c].elapsed(r.summary["rounds"]) for r in g.runs])) for g in timed}
        finite = [v for v in ends.values() if math.isfinite(v)]
        T = min(finite) if finite else math.nan
        budgets.append(f"T = {T:.4g} s under the {c} charge")
        header += [f"time to finish, {c} (s)", f"acc at T, {c} (%)"]
        for g in timed:
            accs = []
            for r in g.runs:
                pts = _time_curve(r, clocks[id(r)][c])
                if pts and pts[0][0] <= T:
                    accs.append(float(np.interp(T, [t for t, _ in pts], [a for _, a in pts])))
            cell = _cell(float(np.mean(accs)), float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0, len(accs)) \
                if accs else "—"
            rows[id(g)] += [f"{ends[id(g)]:.4g}" if math.isfinite(ends[id(g)]) else "—", cell]
    # time to accuracy: the simulated time a group's runs need to first reach A, the median of the groups' final
    # accuracies (the lowest would let one weak group set an easy target), interpolated between evaluations
    # (mean over the runs that reach it; how many did when not all)
    A = float(np.median([np.mean([r.metric("global_acc") for r in g.runs]) for g in timed]))
    budgets.append(f"A = {100 * A:.2f}%")
    for c in CHARGES:
        header.append(f"time to A, {c} (s)")
        for g in timed:
            hits = [_time_to(_time_curve(r, clocks[id(r)][c]), A) for r in g.runs]
            got = [h for h in hits if h is not None]
            rows[id(g)].append(f"{np.mean(got):.4g}" + ("" if len(got) == len(hits) else f" ({len(got)}/{len(hits)})")
                               if got else "not reached")
    return "; ".join(budgets), header, list(rows.values())


def _time_to(pts: list[tuple[float, float]], target: float) -> float | None:
    """The first time a curve reaches `target`, linearly interpolated from the evaluation before (None: never)."""
    for i, (t, a) in enumerate(pts):
        if a >= target:
            if i == 0:
                return t
            t0, a0 = pts[i - 1]
            return t0 + (t - t0) * (target - a0) / (a - a0)
    return None


def plot_time(groups: list[Group], clocks: dict, path: Path) -> bool:
    """Global accuracy (mean over levels) against rounds, and against simulated time under each charge."""
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    if not timed:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8 + 0.22 * len(timed)), sharey=True)
    for g in timed:
        for ax, c in zip(axes, (None, *CHARGES)):
            xs, ys = [], []
            for r in g.runs:
                pts = ([(ln["round"], ln["global_acc"]) for ln in r.curve() if ln.get("global_acc") is not None]
                       if c is None else _time_curve(r, clocks[id(r)][c]))
                xs.append([p[0] for p in pts])
                ys.append([100 * p[1] for p in pts])
            n = min(len(y) for y in ys)
            if n == 0:
                continue
            ax.plot(np.mean([x[:n] for x in xs], axis=0), np.mean([y[:n] for y in ys], axis=0), marker=".",
                    label=g.label if c is None else None)
    for ax, title in zip(axes, ("rounds", "simulated time, dense charge (s)", "simulated time, sparse charge (s)")):
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("global accuracy, mean over levels (%)")
    fig.suptitle("Accuracy against rounds and against simulated time (mean over seeds)")
    fig.legend(loc="lower center", ncol=min(3, len(timed)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.05 * math.ceil(len(timed) / 3), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the report ------------------------------------------------------------------------------------------------
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


def make_report(dirs: list[str], out: str | Path, group_by: list[str] | None = None,
                paired_against: str | None = None, cost: bool = True) -> Path:
    """Write report.md, results.csv, runs.csv and plots/ under `out`; return the path of report.md. `cost`: add
    each group's cost table and the runs' simulated time (from the runs' sim.json, or the group's parts rebuilt:
    data and a step; `run_clocks`)."""
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
                        [[g.label, str(len(g.runs)), ", ".join(sorted({_fmt(r.config.get("seed")) for r in g.runs})),
                          _fmt(g.runs[0].config.get("rounds")), _fmt(g.runs[0].config.get("method")),
                          _fmt(g.runs[0].config.get("dataset")), _fmt(g.runs[0].config.get("system"))]
                         for g in groups]))
    sections = [("Accuracy (%): local = mean over all clients, per-level and mean global accuracy",
                 main_table(groups, levels))]
    for name, overall in (("local_acc", "all clients"), ("global_acc", "mean"), ("local_std", "all clients"),
                          ("local_worst10", "all clients")):
        sections.append((f"{METRICS[name].capitalize()} per level (%)", metric_table(groups, levels, name, overall)))
    if any("epsilon" in r.final for r in runs):   # dp (fedlase/privacy.py): the privacy each group spent
        sections.append(("Differential privacy: epsilon at delta after the rounds run (dp; a run that "
                         "dp.max_epsilon stopped counts as stopped)", privacy_table(groups)))
    over_rounds = curve_table(groups)
    if over_rounds is not None:
        sections.append(("Global accuracy over rounds (%, mean over the group's runs)", over_rounds))
    if any("ratio_std" in r.final for r in runs):
        ratio_levels = sorted({lvl for r in runs for lvl in r.final.get("ratio_std", {})},
                              key=lambda s: float(Fraction(s)))
        sections.append(("Extraction-ratio stability: ratio_std per level (mean over layers, x100)",
                         (["group", "runs", *ratio_levels],
                          [[g.label, str(len(g.runs)), *(_cell(*_analysis_stats(g, ("ratio_std", lvl)), digits=3)
                                                         for lvl in ratio_levels)] for g in groups])))
    if any("updates" in r.final for r in runs):
        sections.append(("Cumulative update counts over all maskable coordinates",
                         (["group", "runs", "never trained (%)", "Gini", "mean count"],
                          [[g.label, str(len(g.runs)), _cell(*_analysis_stats(g, ("updates", "never"))),
                            _cell(*_analysis_stats(g, ("updates", "gini")), scale=1, digits=3),
                            _cell(*_analysis_stats(g, ("updates", "mean")), scale=1, digits=1)] for g in groups])))
    for g in groups:
        table = magnitude_table(g)
        if table is not None:
            sections.append(("Per-layer parameter magnitudes (weights; first and last layers left out)", table))
    tables, clocks = run_clocks(groups) if cost else ({}, {})
    timed = equal_time_table(groups, clocks)
    if timed is not None:
        sections.append((f"Accuracy at equal simulated time (fedlase/simtime.py; each run's device_model, unset: "
                         f"the defaults): global accuracy, mean over levels, at the common budget T (the shortest "
                         f"group's time to finish), and the time to reach A (the median of the groups' final "
                         f"accuracies); interpolated between evaluations: {timed[0]}", timed[1:]))
    if paired_against is not None:
        sections.append((f"Paired by seed against {paired_against} (difference in points, paired t-test)",
                         paired_table(groups, paired_against)))
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
