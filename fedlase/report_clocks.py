"""Cost tables and simulated clocks rebuilt for finished runs (fedlase/cost.py, fedlase/simtime.py): from the
runs' sim.json or their parts rebuilt, the asynchronous runs' recorded times, and the table of accuracy at equal
simulated time."""
from __future__ import annotations

import json
import logging
import math

import numpy as np

from .report_runs import Group, Run
from .report_tables import mean_cell
from .sim_config import CHARGES

log = logging.getLogger("fedlase")




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
    from .registry import METHODS
    for g in groups:
        methods = {r.summary["config"].get("method") for r in g.runs}
        if any(m in METHODS and not METHODS.get(m).clocked for m in methods):   # recipfl (Method.clocked)
            log.info("report: no cost table or simulated time for %s (its method has none)", g.label)
            continue
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


def time_curve(r: Run, clock, metric: str = "global_acc") -> list[tuple[float, float]]:
    """(simulated seconds at the end of the round, metric) at each evaluated round of a run."""
    pts = [(clock.elapsed(ln["round"]), ln[metric]) for ln in r.curve() if ln.get(metric) is not None]
    return [(t, v) for t, v in pts if math.isfinite(t)]   # an asynchronous run has no time under the other charge


def budget(groups: list[Group], clocks: dict, charge: str) -> float:
    """The common simulated-time budget T of timed groups under a charge: the shortest group's mean simulated time
    to its last round (NaN when no group has a time under it)."""
    ends = [float(np.mean([clocks[id(r)][charge].elapsed(r.summary["rounds"]) for r in g.runs])) for g in groups]
    finite = [v for v in ends if math.isfinite(v)]
    return min(finite) if finite else math.nan


def acc_at(r: Run, clock, T: float, metric: str = "global_acc") -> float | None:
    """A run's accuracy (`metric`: global_acc, the mean over levels, or local_acc, the mean over clients) at
    simulated time T, linearly interpolated between the two evaluations around it (None: no evaluation by T, or
    none of this metric: a personalized method may leave global accuracy out, NaN)."""
    pts = time_curve(r, clock, metric)
    if not pts or pts[0][0] > T:
        return None
    a = float(np.interp(T, [t for t, _ in pts], [a for _, a in pts]))
    return a if math.isfinite(a) else None


def equal_time_table(groups: list[Group], clocks: dict, targets: list[float] | None = None
                     ) -> tuple[str, list, list] | None:
    """(budgets, header, rows): per charge, the common budget T (`budget`) and each group's global accuracy (mean
    over levels) and local accuracy (mean over clients) at T (`acc_at`: each run's, then the mean over its runs);
    each group's time to finish; and the time to reach each global accuracy of `targets` (fractions), or else A,
    the median of the groups' final global accuracies."""
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    if not timed:
        return None
    header, rows, budgets = ["group", "runs"], {id(g): [g.label, str(len(g.runs))] for g in timed}, []
    for c in CHARGES:
        ends = {id(g): float(np.mean([clocks[id(r)][c].elapsed(r.summary["rounds"]) for r in g.runs])) for g in timed}
        T = budget(timed, clocks, c)
        budgets.append(f"T = {T:.4g} s under the {c} charge")
        header += [f"time to finish, {c} (s)", f"acc at T, {c} (%)", f"local acc at T, {c} (%)"]
        for g in timed:
            rows[id(g)].append(f"{ends[id(g)]:.4g}" if math.isfinite(ends[id(g)]) else "—")
            for metric in ("global_acc", "local_acc"):
                accs = [a for r in g.runs if (a := acc_at(r, clocks[id(r)][c], T, metric)) is not None]
                rows[id(g)].append(mean_cell(float(np.mean(accs)), float(np.std(accs, ddof=1)) if len(accs) > 1
                                             else 0.0, len(accs)) if accs else "—")
    # time to accuracy: the simulated time a group's runs need to first reach A, by default the median of the
    # groups' final accuracies (the lowest would let one weak group set an easy target), interpolated between
    # evaluations (mean over the runs that reach it; how many did when not all)
    finals = [np.mean([r.metric("global_acc") for r in g.runs]) for g in timed]
    targets = targets or [float(np.median([a for a in finals if math.isfinite(a)] or [math.nan]))]
    for A in targets:
        name = "A" if len(targets) == 1 else f"{100 * A:.4g}%"
        if len(targets) == 1:
            budgets.append(f"A = {100 * A:.2f}%")
        for c in CHARGES:
            header.append(f"time to {name}, {c} (s)")
            for g in timed:
                hits = [_time_to(time_curve(r, clocks[id(r)][c]), A) for r in g.runs]
                got = [h for h in hits if h is not None]
                rows[id(g)].append(f"{np.mean(got):.4g}" + ("" if len(got) == len(hits) else
                                                            f" ({len(got)}/{len(hits)})") if got else "not reached")
    return "; ".join(budgets), header, list(rows.values())


def paired_at_time(groups: list[Group], clocks: dict, baseline: str) -> tuple[str, list, list] | None:
    """(budgets, header, rows): every timed group against the baseline group at the common budget T of each
    charge, paired by seed: the mean difference of global accuracy at T (points), t and p (None: nothing timed,
    or the baseline is not)."""
    from .report_tables import paired_t
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    base = next((g for g in timed if g.label == baseline), None)
    if base is None:
        return None
    header, rows, budgets = ["group", "seeds paired"], {id(g): [g.label, ""] for g in timed if g is not base}, []
    for c in CHARGES:
        T = budget(timed, clocks, c)
        budgets.append(f"T = {T:.4g} s under the {c} charge")
        header += [f"Δ acc at T, {c}", "t", "p"]
        b_acc = {r.config.get("seed"): acc_at(r, clocks[id(r)][c], T) for r in base.runs}
        for g in timed:
            if g is base:
                continue
            diffs = [100 * (a - b_acc[r.config.get("seed")]) for r in g.runs
                     if b_acc.get(r.config.get("seed")) is not None
                     and (a := acc_at(r, clocks[id(r)][c], T)) is not None]
            mean, t, p = paired_t(diffs) if diffs else (math.nan, math.nan, math.nan)
            rows[id(g)][1] = str(max(len(diffs), int(rows[id(g)][1] or 0)))
            rows[id(g)] += ["—" if math.isnan(mean) else f"{mean:+.2f}", "—" if math.isnan(t) else f"{t:.2f}",
                            "—" if math.isnan(p) else f"{p:.3f}"]
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
