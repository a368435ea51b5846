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

log = logging.getLogger("fedlase")


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


def time_curve(r: Run, clock, metric: str = "global_acc") -> list[tuple[float, float]]:
    """(simulated seconds at the end of the round, metric) at each evaluated round of a run."""
    pts = [(clock.elapsed(ln["round"]), ln[metric]) for ln in r.curve() if ln.get(metric) is not None]
    return [(t, v) for t, v in pts if math.isfinite(t)]   # an asynchronous run has no time under the other charge


def equal_time_table(groups: list[Group], clocks: dict) -> tuple[str, list, list] | None:
    """(budgets, header, rows): per charge, the common budget T (the shortest group's mean simulated time to its
    last round) and each group's global accuracy (mean over levels) and local accuracy (mean over clients) at T,
    linearly interpolated between the two evaluations around it (each run's, then the mean over its runs); and
    each group's time to finish."""
    timed = [g for g in groups if all(id(r) in clocks for r in g.runs)]
    if not timed:
        return None
    header, rows, budgets = ["group", "runs"], {id(g): [g.label, str(len(g.runs))] for g in timed}, []
    for c in CHARGES:
        ends = {id(g): float(np.mean([clocks[id(r)][c].elapsed(r.summary["rounds"]) for r in g.runs])) for g in timed}
        finite = [v for v in ends.values() if math.isfinite(v)]
        T = min(finite) if finite else math.nan
        budgets.append(f"T = {T:.4g} s under the {c} charge")
        header += [f"time to finish, {c} (s)", f"acc at T, {c} (%)", f"local acc at T, {c} (%)"]
        for g in timed:
            rows[id(g)].append(f"{ends[id(g)]:.4g}" if math.isfinite(ends[id(g)]) else "—")
            for metric in ("global_acc", "local_acc"):
                accs = []
                for r in g.runs:
                    pts = time_curve(r, clocks[id(r)][c], metric)
                    if pts and pts[0][0] <= T:
                        accs.append(float(np.interp(T, [t for t, _ in pts], [a for _, a in pts])))
                accs = [a for a in accs if math.isfinite(a)]   # a personalized method may leave global out (NaN)
                rows[id(g)].append(mean_cell(float(np.mean(accs)), float(np.std(accs, ddof=1)) if len(accs) > 1
                                             else 0.0, len(accs)) if accs else "—")
    # time to accuracy: the simulated time a group's runs need to first reach A, the median of the groups' final
    # accuracies (the lowest would let one weak group set an easy target), interpolated between evaluations
    # (mean over the runs that reach it; how many did when not all)
    finals = [np.mean([r.metric("global_acc") for r in g.runs]) for g in timed]
    A = float(np.median([a for a in finals if math.isfinite(a)] or [math.nan]))
    budgets.append(f"A = {100 * A:.2f}%")
    for c in CHARGES:
        header.append(f"time to A, {c} (s)")
        for g in timed:
            hits = [_time_to(time_curve(r, clocks[id(r)][c]), A) for r in g.runs]
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
