"""Running a sweep (its file and its plan: fedlase/sweep_plan.py): each run whose folder holds no finished run,
resumed from its checkpoint where it has one. A run that fails is recorded (error.txt in its folder, a line in
sweep.jsonl) and the others go on.

`run_sweep(path, jobs=N)` (`fedlase sweep FILE --jobs N`) runs N runs at once, each in its own subprocess
(its output in `<run folder>/sweep.log`), with torch's CPU threads split between them: a run gets
`threads = max(1, cores // N)` unless the sweep sets `threads` itself, and a run that uses CUDA goes to a GPU by
free memory, several to a GPU where they fit (fedlase/placement.py). Results do not depend on N. On Ctrl-C
the children are stopped and nothing is recorded for them; rerunning the sweep resumes them.

`run_sweep(path, ray=ADDRESS)` (`fedlase sweep FILE --ray ADDRESS`) runs each unfinished run as a Ray task on
a running cluster, where it asks for its `threads` CPUs and, with device=cuda, a quarter of a GPU
(fedlase/cluster.py); each run's line in sweep.jsonl names the node that ran it."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from .config import config_from_dict
from .errors import UserError
from .machine import usable_cpus
from .placement import GpuPlan, gpu_env, gpu_need, read_free, wants_gpu
from .sweep_plan import PlannedRun, plan_sweep

log = logging.getLogger("fedlase")


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
    from .dispatch import run_config
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
    try:
        run = PlannedRun(spec["name"], {}, config_from_dict(spec["config"]))
    except UserError as e:   # refused before anything ran: the sweep records its one line
        error = str(e).splitlines()[0]
    else:
        error = _run_one(run, progress=False)
    report.write(json.dumps({"error": error}) + "\n")
    report.close()
    return 0 if error is None else 1


def _start(run: PlannedRun, threads: int, gpu: int | None = None) -> tuple[subprocess.Popen, object]:
    config = run.cfg.to_dict()
    if not run.sets_threads:
        config["threads"] = threads
    run.out.mkdir(parents=True, exist_ok=True)
    logf = open(run.out / "sweep.log", "a")
    root = str(Path(__file__).resolve().parents[1])   # the child imports this very package
    env = {**os.environ, "FEDLASE_SWEEP_PARENT": str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
           **(gpu_env(gpu) if gpu is not None else {})}
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
    # runs that use CUDA go to the GPUs by free memory, several to one where they fit (fedlase/placement.py)
    plan = GpuPlan(read_free() if any(wants_gpu(r.cfg) for r in todo) else [])
    placed, needs = {}, {}   # proc -> (gpu, booked bytes); run name -> its estimated need
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
                gpu = need = None
                if plan.free and wants_gpu(queue[0].cfg):
                    need = needs.setdefault(queue[0].name, gpu_need(queue[0].cfg))
                    if (gpu := plan.place(need)) is None:
                        break   # it fits on no GPU now: wait for a run to end
                run = queue.pop(0)
                proc, logf = _start(run, threads, gpu)
                procs[proc] = (run, time.perf_counter(), logf)
                if gpu is not None:
                    placed[proc] = (gpu, need)
                    log.info("sweep: run %s on GPU %d (about %.1f GiB)", run.name, gpu, need / 2**30)
                show()
            time.sleep(0.1)
            for proc in [p for p in procs if p.poll() is not None]:
                run, t0, logf = procs.pop(proc)
                logf.close()
                if proc in placed:
                    plan.release(*placed.pop(proc))
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


