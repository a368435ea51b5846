"""The report's plots (PNG): accuracy over rounds and over simulated time, extraction ratios, update counts and
per-layer magnitudes. matplotlib is imported only when a plot is drawn."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .report_clocks import CHARGES, time_curve
from .report_runs import ALL, METRICS, Group
from .report_tables import short_layer


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
    levels, rounds, layers = z["levels"], z["rounds"], [short_layer(str(s)) for s in z["layers"]]
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
def plot_magnitudes(g: Group, path: Path, max_rounds: int = 4) -> bool:
    zs = [z for z in (r.npz("magnitudes") for r in g.runs) if z is not None]
    if not zs:
        return False
    z = zs[0]
    same = [x for x in zs if np.array_equal(x["rounds"], z["rounds"])]
    rounds, layers = z["rounds"], [short_layer(str(s)) for s in z["layers"]]
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

def plot_time(groups: list[Group], clocks: dict, path: Path) -> bool:
    """Global accuracy (mean over levels) against rounds, and against simulated time under each charge."""
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    if not timed:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8 + 0.22 * len(timed)), sharey=True)
    for i, g in enumerate(timed):
        for ax, c in zip(axes, (None, *CHARGES)):   # a group's colour is its own in every panel, drawn there or not
            xs, ys = [], []
            for r in g.runs:
                pts = ([(ln["round"], ln["global_acc"]) for ln in r.curve() if ln.get("global_acc") is not None]
                       if c is None else time_curve(r, clocks[id(r)][c]))
                xs.append([p[0] for p in pts])
                ys.append([100 * p[1] for p in pts])
            n = min(len(y) for y in ys)
            if n == 0:
                continue
            ax.plot(np.mean([x[:n] for x in xs], axis=0), np.mean([y[:n] for y in ys], axis=0), marker=".",
                    color=f"C{i % 10}", label=g.label if c is None else None)
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
