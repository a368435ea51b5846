"""Experiment sweeps: a base config, a grid and/or a list of named variants, one folder per run.

    base: configs/fmnist.yaml        # a config mapping, or a path to a config YAML
    out: runs/ablation               # the sweep folder
    grid: {seed: [0, 1, 2], method_args.score: [mean, max]}   # cartesian product
    runs:                            # optional variants, each combined with every grid point
      - {name: fedlase}
      - {name: no-log, method_args.log: false}

Every run's config is built and validated before anything starts. A run is done when its folder holds
summary.json; an interrupted one resumes from its checkpoint; a run that fails is recorded (error.txt in
its folder, a line in sweep.jsonl) and the others go on."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import Config, config_from_dict, set_dotted
from .errors import ConfigError, UserError

log = logging.getLogger("fedlase")

# Keys that may change between a finished run and the sweep's config without changing its final result.
IGNORED_ON_RERUN = {"out", "threads", "device", "checkpoint_every", "eval_every"}
# Input shapes (channels, image size) per dataset, to build a model for validating method options
# without loading the data.
_SHAPES = {"fashion_mnist": (1, 28), "digits": (1, 8), "cifar10": (3, 32), "cifar100": (3, 32)}
_SAFE = re.compile(r"[^A-Za-z0-9._+-]")


@dataclass
class PlannedRun:
    name: str           # folder name under the sweep's out
    settings: dict      # dotted key -> value: what distinguishes this run
    cfg: Config
    status: str = "new"   # new | resume | retry (failed before) | done

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
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{what}: {path} is not valid YAML ({str(e).splitlines()[0]})") from None
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


def _check_method(cfg: Config) -> None:
    """Build the model and the method once, so that bad method_args fail now, not hours into the sweep."""
    from .methods import build_method
    from .models import build_model
    from .config import NUM_CLASSES
    channels, size = _SHAPES[cfg.dataset]
    model = build_model(cfg.model, channels, NUM_CLASSES[cfg.dataset], cfg.width, cfg.bn, size)
    build_method(cfg.method, model, dict(cfg.method_args), sorted({lvl for lvl, _ in cfg.levels}, reverse=True))


def _comparable(d: dict) -> dict:
    d = json.loads(json.dumps(d, default=str))
    return {k: v for k, v in d.items() if k not in IGNORED_ON_RERUN}


def plan_sweep(path: str | Path) -> tuple[Path, list[PlannedRun]]:
    """Read a sweep file; build, validate and name every run, and find which are done or can resume.
    Raises UserError naming the run and the key on the first bad value."""
    from .analysis import check_analysis
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
                cfg = config_from_dict(raw)
                check_analysis(cfg.analysis)
                _check_method(cfg)
            except UserError as e:
                raise UserError(f"sweep: run {name}: {e}") from None
            except Exception as e:   # a value the config accepts but the model/method cannot use
                raise UserError(f"sweep: run {name}: {type(e).__name__}: {e}") from None
            if name in seen:
                raise UserError(f"sweep: two runs get the same folder {name!r}; give the runs distinct names")
            seen[name] = i
            planned.append(PlannedRun(name, {**({"name": vname} if vname else variant), **settings}, cfg))
    for run in planned:
        run.status = _status(run)
    return out, planned


def _status(run: PlannedRun) -> str:
    """done / resume / retry / new; UserError when the folder holds a run with other settings."""
    from .engine import RESUMABLE_CHANGES
    want = _comparable(run.cfg.to_dict())
    defaults = _comparable(Config().to_dict())
    for f, key in ((run.out / "summary.json", "config"), (run.out / "config.json", None)):
        try:
            data = json.loads(f.read_text())
            have = _comparable(data[key] if key else data)
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            continue
        # a key newer than the stored run counts as equal when the sweep leaves it at its default
        diff = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k, defaults.get(k)))
        if set(diff) - RESUMABLE_CHANGES:
            raise UserError(f"sweep: run {run.name}: {run.out} holds a run with other settings "
                            f"({', '.join(sorted(set(diff) - RESUMABLE_CHANGES))}); use another sweep out or "
                            "remove that folder")
        if key and not diff:
            return "done"
    if (run.out / "error.txt").is_file():
        return "retry"   # failed last time; resumes from its checkpoint if it has one
    return "resume" if (run.out / "checkpoint.pt").is_file() else "new"


def _record(out: Path, entry: dict) -> None:
    with open(out / "sweep.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def run_sweep(path: str | Path, progress: bool = True) -> dict:
    """Run every run of a sweep that is not done; return {'done', 'skipped', 'failed': [names]}."""
    from .engine import run_experiment
    out, planned = plan_sweep(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.yaml").write_text(Path(path).read_text())   # the spec next to its results
    todo = [r for r in planned if r.status != "done"]
    result = {"done": [], "skipped": [r.name for r in planned if r.status == "done"], "failed": []}
    spent, rounds_done = 0.0, 0
    with contextlib.ExitStack() as stack:
        bar = None
        if progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            stack.enter_context(logging_redirect_tqdm())   # log lines go above the bars, not through them
            bar = stack.enter_context(tqdm(total=len(planned), initial=len(result["skipped"]), unit="run",
                                           desc="sweep", dynamic_ncols=True,
                                           bar_format="{desc}: {n}/{total} runs |{bar}| {elapsed}{postfix}"))
        for i, run in enumerate(todo):
            if bar is not None:
                eta = ""
                if rounds_done:   # from the time per round of the runs finished in this invocation
                    eta = f"eta {_fmt_time(spent / rounds_done * sum(r.cfg.rounds for r in todo[i:]))}, "
                bar.set_postfix_str(f"{eta}now {run.name}")
            t0 = time.perf_counter()
            err = run.out / "error.txt"
            try:
                run_experiment(run.cfg, resume=True, progress=progress)
            except Exception as e:   # one failed run must not stop the sweep: record it and go on
                run.out.mkdir(parents=True, exist_ok=True)
                err.write_text(traceback.format_exc())
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.error("sweep: run %s failed: %s (details in %s)", run.name, msg, err)
                result["failed"].append(run.name)
                _record(out, {"run": run.name, "status": "failed", "error": msg, "time": time.perf_counter() - t0})
            else:
                err.unlink(missing_ok=True)
                spent += time.perf_counter() - t0
                rounds_done += run.cfg.rounds
                result["done"].append(run.name)
                _record(out, {"run": run.name, "status": "done", "time": time.perf_counter() - t0})
            if bar is not None:
                bar.update(1)
    return result


def describe_plan(out: Path, planned: list[PlannedRun]) -> str:
    """The --dry-run listing: one line per run with its status and folder."""
    width = max(len(r.status) for r in planned)
    count = {s: sum(r.status == s for r in planned) for s in ("done", "resume", "new", "retry")}
    lines = [f"sweep {out}: {len(planned)} runs ({count['done']} done, {count['resume']} to resume, "
             f"{count['new']} new, {count['retry']} failed before)"]
    lines += [f"  {r.status:<{width}}  {r.name}" for r in planned]
    return "\n".join(lines)
