"""Sweep plans: a base config, a grid and/or a list of named variants, one folder per run.

    base: configs/reference.yaml     # a config mapping, or a path to a config YAML
    out: runs/ablation               # the sweep folder
    grid: {seed: [0, 1, 2], method_args.score: [mean, max]}   # cartesian product
    runs:                            # optional variants, each combined with every grid point
      - {name: fedlase}
      - {name: no-log, method_args.log: false}

`plan_sweep` builds and validates every run's config (and its model and method) before anything starts, names
its folder (`run_name`) and finds its status: done when its folder holds summary.json, resume when it holds a
checkpoint, retry when it failed before, else new. fedlase/sweep.py runs the plan."""
from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import Config, config_from_dict, set_dotted
from .errors import ConfigError, UserError
from .util import yaml_problem

_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


@dataclass
class PlannedRun:
    name: str           # folder name under the sweep's out
    settings: dict      # dotted key -> value: what distinguishes this run
    cfg: Config
    status: str = "new"   # new | resume | retry (failed before) | done
    sets_threads: bool = False   # the sweep file sets `threads` for this run (then --jobs leaves it alone)

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (str, int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _safe(text: str) -> str:
    return re.sub(r"_+", "_", _SAFE.sub("_", text)).strip("_") or "_"


def run_name(settings: dict, name: str | None = None, max_len: int = 120) -> str:
    """A folder name from a run's settings: `name,key=value,...`, deterministic and filesystem-safe.

    In names and values, characters outside [A-Za-z0-9._+-] become '_'; when that loses information (or the
    name is long) a short hash of the exact settings is appended after '~' (which plain names never
    contain), so two different runs never share a folder and a run's folder never depends on the others."""
    raw = [str(name)] if name else []
    raw += [f"{k}={_text(v)}" for k, v in settings.items()]
    safe = [_safe(str(name))] if name else []
    safe += [f"{_safe(str(k))}={_safe(_text(v))}" for k, v in settings.items()]
    text = ",".join(safe) or "base"
    if safe != raw or len(text) > max_len:
        text = f"{text[:max_len]}~{hashlib.sha1(chr(0).join(raw).encode()).hexdigest()[:8]}"
    return text


def _load_yaml(path: Path, what: str) -> dict:
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{what}: {yaml_problem(path, text, e)}") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {path} must hold a mapping")
    return data


def _base(spec: dict, folder: Path) -> dict:
    base = spec.get("base", {})
    if isinstance(base, dict):
        return json.loads(json.dumps(base))   # a deep copy
    if not isinstance(base, str):
        raise UserError(f"sweep: base must be a config mapping or a path to a config YAML, got {base!r}")
    for p in (folder / base, Path(base)):   # next to the sweep file first, then the working directory
        if p.is_file():
            return _load_yaml(p, "sweep: base")
    raise UserError(f"sweep: base config {base!r} not found (looked in {folder} and the working directory)")


def _check_method(cfg: Config, data: dict) -> None:
    """Build the model and the method as the run will, so that a method that cannot work on the model (say a
    level too small for what it keeps whole) fails now, not hours into the sweep. `data` caches the loaded
    datasets; one that cannot be loaded is left to the run, which records the failure when it starts."""
    import torch

    from .registry import DATASETS, METHODS, load_dataset
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str) if DATASETS.get(cfg.dataset).kind != "image" \
        else (cfg.dataset, cfg.data_dir)   # an image dataset depends only on these; others: on the whole config
    if key not in data:
        try:
            data[key] = load_dataset(cfg)
        except Exception:
            data[key] = None
    if data[key] is not None:
        from .client import build_model_for
        from .model_facts import ModelFacts
        with torch.random.fork_rng(devices=[]):   # the sweep's own process: leave torch's stream as it was
            model = build_model_for(cfg, data[key])
        METHODS.get(cfg.method).build(model, cfg.levels, ModelFacts.of(model, data[key]), run_seed=cfg.seed,
                                      **cfg.method_args)


def _plain(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def plan_sweep(path: str | Path) -> tuple[Path, list[PlannedRun]]:
    """Read a sweep file; build, validate and name every run, and find which are done or can resume.
    Raises UserError naming the run and the key on the first bad value."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep: file {str(path)!r} does not exist")
    spec = _load_yaml(path, "sweep")
    unknown = set(spec) - {"base", "grid", "runs", "out"}
    if unknown:
        raise UserError(f"sweep: unknown key {sorted(unknown)[0]!r}; a sweep has base, grid, runs and out")
    base = _base(spec, path.parent)
    out = Path(spec.get("out") or f"runs/{path.stem}")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict):
        raise UserError("sweep: grid must map keys to lists of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise UserError(f"sweep: grid.{key} must be a non-empty list of values, got {values!r}")
        if key == "out":
            raise UserError("sweep: grid.out: the sweep names each run's folder itself")
    variants = spec.get("runs") or [{}]
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        raise UserError("sweep: runs must be a list of mappings of overrides (each optionally with name:)")

    planned: list[PlannedRun] = []
    seen: dict[str, int] = {}
    datasets: dict = {}
    for i, variant in enumerate(variants):
        variant = dict(variant)
        vname = variant.pop("name", None)
        if "out" in variant:
            raise UserError(f"sweep: runs[{i}].out: the sweep names each run's folder itself")
        for point in itertools.product(*grid.values()):
            settings = dict(zip(grid, point))
            clash = set(settings) & set(variant)
            if clash:
                raise UserError(f"sweep: runs[{i}] and grid both set {sorted(clash)[0]}; set it in one place")
            name = run_name({**({} if vname else variant), **settings}, str(vname) if vname else None)
            raw = json.loads(json.dumps(base))
            for key, value in {**variant, **settings}.items():
                try:
                    set_dotted(raw, str(key), json.loads(json.dumps(value)))
                except ConfigError as e:
                    raise UserError(f"sweep: run {name}: {e}") from None
            raw["out"] = str(out / name)
            try:
                cfg = config_from_dict(raw)   # checks every key, method_args and analysis included
                _check_method(cfg, datasets)
            except UserError as e:
                raise UserError(f"sweep: run {name}: {e}") from None
            except Exception as e:   # a value the config accepts but the model/method cannot use
                raise UserError(f"sweep: run {name}: {type(e).__name__}: {e}") from None
            if name in seen:
                raise UserError(f"sweep: two runs get the same folder {name!r}; give the runs distinct names")
            seen[name] = i
            planned.append(PlannedRun(name, {**({"name": vname} if vname else variant), **settings}, cfg,
                                      sets_threads="threads" in raw))
    for run in planned:
        run.status = _status(run)
    return out, planned


def _status(run: PlannedRun) -> str:
    """done / resume / retry / new; UserError when the folder holds a run with other settings."""
    from .config import result_keys
    want, defaults = _plain(run.cfg.to_dict()), _plain(Config().to_dict())
    for f, key in ((run.out / "summary.json", "config"), (run.out / "config.json", None)):
        try:
            data = json.loads(f.read_text())
            have = _plain(data[key] if key else data)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
        # only keys that change the result matter (out, threads, device, eval_every ... do not); a key newer
        # than the stored run counts as equal when the sweep leaves it at its default
        diff = sorted(k for k in result_keys() if want.get(k) != have.get(k, defaults.get(k)))
        if diff:
            raise UserError(f"sweep: run {run.name}: {run.out} holds a run with other settings "
                            f"({', '.join(diff)}); use another sweep out or remove that folder")
        if key and have.get("rounds") == want["rounds"]:
            return "done"
    if (run.out / "error.txt").is_file():
        return "retry"   # failed last time; resumes from its checkpoint if it has one
    return "resume" if (run.out / "checkpoint.pt").is_file() else "new"


def describe_plan(out: Path, planned: list[PlannedRun]) -> str:
    """The --dry-run listing: one line per run with its status and folder."""
    width = max(len(r.status) for r in planned)
    count = {s: sum(r.status == s for r in planned) for s in ("done", "resume", "new", "retry")}
    lines = [f"sweep {out}: {len(planned)} runs ({count['done']} done, {count['resume']} to resume, "
             f"{count['new']} new, {count['retry']} failed before)"]
    lines += [f"  {r.status:<{width}}  {r.name}" for r in planned]
    return "\n".join(lines)
