"""Finished runs and their groups: the runs found by their summary.json under given folders, and the groups
of runs whose configs agree on every key except the seed (and keys that do not change results: out, threads,
device, checkpoint, evaluation and analysis settings). The tables, plots and simulated clocks of a report
(fedlase/report.py) are built from these."""
from __future__ import annotations

import functools
import json
import logging
import math
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
           "local_worst10": "worst-10% local accuracy", "global_ppl": "global perplexity",
           "local_ppl": "local perplexity"}   # the perplexities: task=lm runs (docs/llm.md)
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

    @functools.cached_property
    def _lines(self) -> tuple[dict, ...]:
        f = self.path / "metrics.jsonl"
        return tuple(json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()) if f.is_file() else ()

    def curve(self) -> list[dict]:
        """The run's metrics lines, read once per report (its tables, clocks and plots each walk them)."""
        return list(self._lines)

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


def fmt_value(v) -> str:
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
        parts = [f"{keys[i]}={fmt_value(cfg[keys[i]])}" for i in varying if keys[i] in cfg]
        g.label = ", ".join(parts) or fmt_value(cfg.get("method", "all runs"))
    return list(groups.values())


def levels_of(groups: list[Group]) -> list[str]:
    """Level names of all runs, smallest first (the papers' column order)."""
    names = {lvl for g in groups for r in g.runs for lvl in r.final.get("levels", {})}
    return sorted(names, key=lambda s: float(Fraction(s)))
