"""Experiment sweeps: a base config, a grid and/or a list of named variants, one folder per run.

    base: configs/reference.yaml     # a config mapping, or a path to a config YAML
    out: runs/ablation               # the sweep folder
    grid: {seed: [0, 1, 2], method_args.score: [mean, max]}   # cartesian product
    runs:                            # optional variants, each combined with every grid point
      - {name: fedlase}
      - {name: no-log, method_args.log: false}

Every run's config is built and validated before anything starts. A run is done when its folder holds
summary.json; an interrupted one resumes from its checkpoint; a run that fails is recorded (error.txt in
its folder, a line in sweep.jsonl) and the others go on.

`run_sweep(path, jobs=N)` (`fedlase sweep FILE --jobs N`) runs N runs at once, each in its own subprocess
(its output in `<run folder>/sweep.log`), with torch's CPU threads split between them: a run gets
`threads = max(1, cores // N)` unless the sweep sets `threads` itself. Results do not depend on N. On Ctrl-C
the children are stopped and nothing is recorded for them; rerunning the sweep resumes them.

`run_sweep(path, ray=ADDRESS)` (`fedlase sweep FILE --ray ADDRESS`) runs each unfinished run as a Ray task on
a running cluster, where it asks for its `threads` CPUs and, with device=cuda, a GPU (fedlase/cluster.py);
each run's line in sweep.jsonl names the node that ran it."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

from .config import Config, config_from_dict, set_dotted
from .errors import ConfigError, UserError
from .resources import passive_openmp, usable_cpus

log = logging.getLogger("fedlase")

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


def _check_method(cfg: Config, data: dict) -> None:
    """Build the model and the method as the run will, so that a method that cannot work on the model (say a
    level too small for what it keeps whole) fails now, not hours into the sweep. `data` caches the loaded
    datasets; one that cannot be loaded is left to the run, which records the failure when it starts."""
    import torch

    from .registry import DATASETS, METHODS, MODELS
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str) if DATASETS.get(cfg.dataset).kind != "image" \
        else (cfg.dataset, cfg.data_dir)   # an image dataset depends only on these; others: on the whole config
    if key not in data:
        try:
            data[key] = DATASETS.get(cfg.dataset).load(cfg)
        except Exception:
            data[key] = None
    if data[key] is not None:
        with torch.random.fork_rng(devices=[]):   # the sweep's own process: leave torch's stream as it was
            model = MODELS.get(cfg.model).build(cfg, data[key])
        METHODS.get(cfg.method)(model, cfg.levels, run_seed=cfg.seed, **cfg.method_args)


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


def _record(out: Path, entry: dict) -> None:
    with open(out / "sweep.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def run_sweep(path: str | Path, progress: bool = True, jobs: int = 1, ray: str | None = None) -> dict:
    """Run every run of a sweep that is not done, `jobs` at a time (or, with `ray`, as tasks on the Ray cluster
    at that address); return {'done', 'skipped', 'failed': [names]} (done and failed in the order the runs
    finished)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UserError(f"sweep: --jobs must be a whole number >= 1, got {jobs!r}")
    if ray is not None and jobs != 1:
        raise UserError("sweep: --jobs and --ray do not go together: on a cluster, its CPUs decide how many "
                        "runs go at once")
    if ray is not None:
        from .cluster import check_address
        check_address(ray, "sweep: --ray")   # seconds, before the plan builds every run
    out, planned = plan_sweep(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.yaml").write_text(Path(path).read_text())   # the spec next to its results
    todo = [r for r in planned if r.status != "done"]
    result = {"done": [], "skipped": [r.name for r in planned if r.status == "done"], "failed": []}
    with contextlib.ExitStack() as stack:
        bar = None
        if progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm
            stack.enter_context(logging_redirect_tqdm())   # log lines go above the bars, not through them
            bar = stack.enter_context(tqdm(total=len(planned), initial=len(result["skipped"]), unit="run",
                                           desc="sweep", dynamic_ncols=True,
                                           bar_format="{desc}: {n}/{total} runs |{bar}| {elapsed}{postfix}"))
        if ray is not None:
            _run_on_cluster(ray, out, todo, result, bar)
        elif jobs == 1:
            _run_in_process(out, todo, result, bar, progress)
        else:
            _run_in_subprocesses(out, todo, result, bar, jobs)
    return result


def _finished(out: Path, run: PlannedRun, result: dict, seconds: float, error: str | None,
              where: dict | None = None) -> None:
    """Record a run that ended: a line in sweep.jsonl (with `where`: the Ray node that ran it) and its name in
    the result."""
    if error is None:
        result["done"].append(run.name)
        _record(out, {"run": run.name, "status": "done", "time": seconds, **(where or {})})
    else:
        log.error("sweep: run %s failed: %s (details in %s)", run.name, error, run.out / "error.txt")
        result["failed"].append(run.name)
        _record(out, {"run": run.name, "status": "failed", "error": error, "time": seconds, **(where or {})})


def _account(out: Path, run: PlannedRun, result: dict, seconds: float, error, pace: list, bar,
             where: dict | None = None) -> None:
    """Record a finished run; a successful one adds its time and rounds to `pace` ([seconds, rounds]), the
    basis of the ETA."""
    if error is None:
        pace[0] += seconds
        pace[1] += run.cfg.rounds
    _finished(out, run, result, seconds, error, where)
    if bar is not None:
        bar.update(1)


def _run_in_process(out: Path, todo: list[PlannedRun], result: dict, bar, progress: bool) -> None:
    pace = [0.0, 0]   # seconds and rounds of the runs finished in this invocation
    for i, run in enumerate(todo):
        if bar is not None:
            eta = ""
            if pace[1]:
                eta = f"eta {_fmt_time(pace[0] / pace[1] * sum(r.cfg.rounds for r in todo[i:]))}, "
            bar.set_postfix_str(f"{eta}now {run.name}")
        t0 = time.perf_counter()
        error = _run_one(run, progress)
        _account(out, run, result, time.perf_counter() - t0, error, pace, bar)


def _run_one(run: PlannedRun, progress: bool) -> str | None:
    """Run (or resume) one run in this process on its engine; None, or the first line of its error (then in
    error.txt)."""
    from .runner import run_config
    err = run.out / "error.txt"
    try:
        run_config(run.cfg, resume=True, progress=progress)
    except Exception as e:   # one failed run must not stop the sweep: record it and go on
        run.out.mkdir(parents=True, exist_ok=True)
        err.write_text(traceback.format_exc())
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    err.unlink(missing_ok=True)
    return None


def run_from_dict(name: str, config: dict) -> str | None:
    """`_run_one` in a fresh process that has only the run's name and config (a Ray task): registers the
    built-ins first. A config that does not hold there (a data_dir missing on that node) raises UserError."""
    from .catalog import load_builtins
    load_builtins()
    return _run_one(PlannedRun(name, {}, config_from_dict(config)), progress=False)


_CHILD = "import sys; from fedlase.sweep import _child_main; sys.exit(_child_main())"


def _child_main() -> int:
    """A subprocess of a parallel sweep: read one run's config (JSON) from stdin, run it, and print one JSON
    line {"error": null or the first line of the error} to stdout. Exits when the sweep process goes away."""
    from .catalog import load_builtins
    from .config import config_from_dict
    parent = int(os.environ.get("FEDLASE_SWEEP_PARENT", os.getppid()))

    def watch():   # a killed sweep must not leave its runs going on
        while True:
            if os.getppid() != parent:
                os._exit(143)
            time.sleep(1.0)
    threading.Thread(target=watch, daemon=True).start()
    report = os.fdopen(os.dup(1), "w")   # the result line goes here; whatever the run prints goes to the log
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = json.loads(sys.stdin.read())
    load_builtins()   # a fresh process: register the built-in choices before the config is checked
    run = PlannedRun(spec["name"], {}, config_from_dict(spec["config"]))
    error = _run_one(run, progress=False)
    report.write(json.dumps({"error": error}) + "\n")
    report.close()
    return 0 if error is None else 1


def _start(run: PlannedRun, threads: int) -> tuple[subprocess.Popen, object]:
    config = run.cfg.to_dict()
    if not run.sets_threads:
        config["threads"] = threads
    run.out.mkdir(parents=True, exist_ok=True)
    logf = open(run.out / "sweep.log", "a")
    root = str(Path(__file__).resolve().parents[1])   # the child imports this very package
    passive_openmp()   # the child's OpenMP waits without spinning unless the user chose otherwise (inherited)
    env = {**os.environ, "FEDLASE_SWEEP_PARENT": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    # its own session: a Ctrl-C at the terminal reaches only the sweep, which then stops the children itself
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=logf, env=env, start_new_session=True, text=True)
    proc.stdin.write(json.dumps({"name": run.name, "config": config}, default=str))
    proc.stdin.close()
    return proc, logf


def _child_error(run: PlannedRun, proc: subprocess.Popen) -> str | None:
    """The outcome a finished child reported; a child that died without reporting is a failure, recorded here."""
    text = proc.stdout.read() if proc.stdout else ""
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)["error"]
        except (ValueError, KeyError, TypeError):
            continue
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    error = f"the run's process ended without a result ({how}); see {run.out / 'sweep.log'}"
    (run.out / "error.txt").write_text(error + "\n")
    return error


def _stop(procs: dict) -> None:
    """Stop every child (SIGTERM, then SIGKILL after 10 s) and wait for them."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for _, (_, _, logf) in procs.items():
        logf.close()


def _run_in_subprocesses(out: Path, todo: list[PlannedRun], result: dict, bar, jobs: int) -> None:
    threads = max(1, usable_cpus() // jobs)
    queue, procs = list(todo), {}   # proc -> (run, start time, log file)
    pace = [0.0, 0]   # seconds and rounds of the runs finished so far

    def show():
        if bar is None:
            return
        eta = ""
        if pace[1]:   # from the time per round of the runs finished so far, `jobs` of them at a time
            per_round, now = pace[0] / pace[1], time.perf_counter()
            running = [max(0.0, per_round * r.cfg.rounds - (now - t0)) for r, t0, _ in procs.values()]
            left = sum(running) + per_round * sum(r.cfg.rounds for r in queue)
            eta = f"eta {_fmt_time(max([left / jobs, *running]))}, "
        bar.set_postfix_str(f"{eta}now {', '.join(r.name for r, _, _ in procs.values())}")

    try:
        while queue or procs:
            while queue and len(procs) < jobs:
                run = queue.pop(0)
                proc, logf = _start(run, threads)
                procs[proc] = (run, time.perf_counter(), logf)
                show()
            time.sleep(0.1)
            for proc in [p for p in procs if p.poll() is not None]:
                run, t0, logf = procs.pop(proc)
                logf.close()
                _account(out, run, result, time.perf_counter() - t0, _child_error(run, proc), pace, bar)
                show()
    except BaseException:   # Ctrl-C (or any error here): no run goes on without the sweep
        _stop(procs)
        raise


def _run_on_cluster(address: str, out: Path, todo: list[PlannedRun], result: dict, bar) -> None:
    from .cluster import run_on_ray
    pace = [0.0, 0]   # seconds and rounds of the runs finished so far
    most = [1]        # the most runs seen going at once: the cluster's width for these runs

    def show(running: list, queued: list) -> None:
        if bar is None:
            return
        most[0] = max(most[0], len(running))
        eta = ""
        if pace[1]:   # as for --jobs, with the cluster's observed width in place of N
            per_round = pace[0] / pace[1]
            left = [max(0.0, per_round * r.cfg.rounds - s) for r, s in running]
            total = sum(left) + per_round * sum(r.cfg.rounds for r in queued)
            eta = f"eta {_fmt_time(max([total / most[0], *left]))}, "
        bar.set_postfix_str(f"{eta}{len(running)} running, {len(queued)} queued")

    run_on_ray(address, out, todo, lambda run, seconds, error, where:
               _account(out, run, result, seconds, error, pace, bar, where), show, run_from_dict)


def describe_plan(out: Path, planned: list[PlannedRun]) -> str:
    """The --dry-run listing: one line per run with its status and folder."""
    width = max(len(r.status) for r in planned)
    count = {s: sum(r.status == s for r in planned) for s in ("done", "resume", "new", "retry")}
    lines = [f"sweep {out}: {len(planned)} runs ({count['done']} done, {count['resume']} to resume, "
             f"{count['new']} new, {count['retry']} failed before)"]
    lines += [f"  {r.status:<{width}}  {r.name}" for r in planned]
    return "\n".join(lines)
