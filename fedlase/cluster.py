"""Running on a Ray cluster that someone else started (`ray start` on each machine; docs/cluster.md).

- `fedlase sweep FILE --ray ADDRESS`: every unfinished run of the sweep becomes one Ray task that asks for
  `threads` CPUs (and, with `device=cuda`, a quarter of a GPU: fedlase/placement.py); Ray places it on a node
  with room. The task calls `run_config`, as every other run path does. Runs write straight into the sweep's
  `out`, which must be a folder every node shares (checked on every node before anything starts): the
  checkpoint a run writes is what lets it resume when its worker or node dies, so it has to outlive that node.
- `engine=flower-sim ray_address=ADDRESS`: Flower's Simulation Engine joins the cluster instead of starting a
  private Ray (`simulation_join`); the cluster's resources decide how many ClientApps run at once.

fedlase never stops a cluster it joined: the driver only disconnects (`ray.shutdown()`), which ends the
sweep's own tasks and nothing else."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

from .config import tagged
from .errors import UserError
from .placement import RAY_GPU_SHARE
from .util import split_host_port

log = logging.getLogger("fedlase")

# For this driver only (each node's `ray start` environment decides for its workers): no usage reports, and
# no notice about a change of Ray's GPU visibility default (a run here asks for a GPU or uses none).
_QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
STARTED = "worker.json"   # written into a run's folder when its task starts: node, host, pid
RETRIES = 2               # a run whose worker or node dies is started again (it resumes from its checkpoint)


def _ray(what: str):
    try:
        import ray
    except ImportError:
        raise UserError(f"{what} needs ray: pip install 'fedlase[flower]'") from None
    return ray


def check_address(address: str, what: str) -> None:
    """A one-line UserError, within seconds, when no Ray head answers at host:port: Ray itself would retry
    for minutes. `auto` is left to Ray (RAY_ADDRESS, else the cluster last started on this machine)."""
    if address == "auto":
        return
    if (parsed := split_host_port(address)) is None:
        raise UserError(f"{what}: {address!r} is not host:port of a Ray cluster's head (or auto)")
    host, port = parsed
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise UserError(f"{what}: no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                        f"`ray start --head` (docs/cluster.md)") from None
    try:
        import grpc  # comes with ray
    except ImportError:
        return
    # Something listens there: ask it for the cluster id, the first thing a Ray driver asks the head for.
    # Not a documented API: Ray has no public call that tells a head from another server without retrying for
    # minutes (`ray.init` waits for the GCS; `ray health-check` is hidden and says it is not public). This is
    # the head's wire protocol, one call with an empty request, of Ray 2.55.1 (the version flwr 1.42 pins;
    # pyproject.toml pins flwr>=1.42,<1.43); tests/test_cluster.py checks a head passes and a non-Ray port fails.
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(b"", timeout=5)   # see above
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.DEADLINE_EXCEEDED):   # other codes (say, a token): Ray's to judge
                raise UserError(f"{what}: {address} answers but is not a Ray cluster's head (the port "
                                f"`ray start --head` printed?)") from None


def connect(address: str, what: str = "sweep: --ray"):
    """Join the running cluster at `address` as a driver; returns the ray module."""
    check_address(address, what)
    os.environ.update(_QUIET)
    ray = _ray(what)
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise UserError(f"{what}: cannot join the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
    return ray


def simulation_join(cfg) -> dict:
    """The Simulation Engine's backend config for joining the cluster at cfg.ray_address: Ray is not started
    or sized here (the cluster has its resources); each ClientApp takes one CPU and, with device=cuda, a
    quarter of a GPU (at most 4 clients share one); device=auto asks for no GPU."""
    check_address(cfg.ray_address, "ray_address")
    gpu = 1.0 / max(1, min(cfg.num_clients, 4)) if cfg.device == "cuda" else 0.0
    return {"client_resources": {"num_cpus": 1, "num_gpus": gpu},
            "init_args": {"address": cfg.ray_address, "logging_level": "ERROR", "log_to_driver": False}}


# ---- sweeps ---------------------------------------------------------------------------------------------------
def task_config(run) -> tuple[dict, dict]:
    """(the config a run's task gets, the resources it asks Ray for). Paths become absolute (a worker's working
    directory is not the driver's); a run the sweep leaves at threads=0 gets 1 thread, so that what it asks
    for is what it uses; device=auto means CPU (the driver cannot know which nodes have a GPU)."""
    config = run.cfg.to_dict()
    for key in tagged("path"):   # out, data_dir, model_path, ...: every path Option
        if config[key] is not None:
            config[key] = str(Path(config[key]).expanduser().resolve())
    config["threads"] = max(1, config["threads"]) if run.sets_threads else 1
    if config["device"] == "auto":
        config["device"] = "cpu"
    return config, {"num_cpus": config["threads"], "num_gpus": RAY_GPU_SHARE if config["device"] == "cuda" else 0}


def _check_fits(ray, runs: list) -> None:
    """A run no node can hold would wait forever: refuse it now."""
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    for run in runs:
        _, need = task_config(run)
        if not any(n.get("CPU", 0) >= need["num_cpus"] and n.get("GPU", 0) >= need["num_gpus"] for n in nodes):
            most = max((n.get("CPU", 0) for n in nodes), default=0)
            gpus = max((n.get("GPU", 0) for n in nodes), default=0)
            raise UserError(f"sweep: run {run.name} asks for {need['num_cpus']:g} CPU(s) (threads) and "
                            f"{need['num_gpus']:g} GPU(s) (device=cuda), but the cluster's largest node has "
                            f"{most:g} CPUs and {gpus:g} GPUs")


def _probe(folder: str, token: str) -> dict:
    """On one node: can it read the driver's marker in the sweep folder and write beside it?"""
    import ray
    ctx = {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    marker = Path(folder) / f".fedlase-probe-{token}"
    try:
        if marker.read_text() != token:
            return {**ctx, "why": "sees another file there"}
        mine = marker.with_name(f"{marker.name}-{ctx['node'][:12]}")
        mine.write_text(token)
        mine.unlink()
    except OSError as e:
        return {**ctx, "why": e.strerror or str(e)}
    return {**ctx, "why": None}


def check_shared(ray, out: Path) -> int:
    """Every alive node must see the sweep folder the driver sees (a shared filesystem); returns the node
    count, or raises a one-line UserError naming the first node that cannot."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    token = uuid.uuid4().hex
    marker = out.resolve() / f".fedlase-probe-{token}"
    marker.write_text(token)
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                .remote(str(out.resolve()), token) for n in nodes]
        try:
            seen = ray.get(refs, timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise UserError("sweep: --ray: the cluster's nodes did not answer within 2 minutes") from None
    finally:
        marker.unlink(missing_ok=True)
    for s in seen:
        if s["why"]:
            raise UserError(f"sweep: --ray: node {s['host']} ({s['node'][:12]}) cannot use the sweep folder "
                            f"{out.resolve()} ({s['why']}); `out` must be on a filesystem every node shares "
                            f"(docs/cluster.md)")
    return len(nodes)


def _task(run_one, name: str, config: dict) -> dict:
    """One run as a Ray task, on whatever node Ray chose: run (or resume) it through the sweep's own path,
    `run_one(name, config)` (fedlase.sweep.run_from_dict, handed in so that this module needs no sweep); its log
    goes to `<run>/sweep.log`. Returns its outcome, where it ran and how long it took."""
    import ray

    t0 = time.perf_counter()
    where = {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    out = Path(config["out"])
    if not out.parent.is_dir():   # a node that joined after the start-up check, without the shared folder
        return {**where, "error": f"node {where['host']} cannot see the sweep folder {out.parent}", "seconds": 0.0}
    out.mkdir(exist_ok=True)
    (out / STARTED).write_text(json.dumps({**where, "pid": os.getpid()}) + "\n")
    handler = logging.FileHandler(out / "sweep.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logging.getLogger("fedlase").addHandler(handler)
    logging.getLogger("fedlase").setLevel(logging.INFO)
    try:
        log.info("sweep: run %s on node %s (%s), pid %d", name, where["node"], where["host"], os.getpid())
        try:
            error = run_one(name, config)
        except UserError as e:   # the config does not hold on this node, e.g. its data_dir is missing here
            return {**where, "error": str(e), "seconds": time.perf_counter() - t0}
    finally:
        logging.getLogger("fedlase").removeHandler(handler)
        handler.close()
    return {**where, "error": error, "seconds": time.perf_counter() - t0}


@contextlib.contextmanager
def _ctrl_c_flag():
    """While open, Ctrl-C only sets the flag it yields; the wait loop checks it twice a second. A KeyboardInterrupt
    raised wherever the signal lands can arrive inside Ray's own calls: a sweep on a loaded machine once went on
    running for over a minute after Ctrl-C. Installed after Ray is imported (importing Ray resets SIGINT)."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():   # only the main thread may set handlers
        yield flag
        return
    before = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, before)


def run_on_ray(address: str, out: Path, todo: list, account, show, run_one) -> None:
    """Run the sweep's unfinished runs as Ray tasks on the cluster at `address`, each through
    `run_one(name, config dict)` on its worker.

    `account(run, seconds, error, where)` records a run that ended; `show(running, queued)` refreshes the
    progress line (`running`: [(run, seconds since it started)]). On Ctrl-C (or any error here) every task is
    cancelled (its worker killed) and nothing is recorded for it: its checkpoint is where the next sweep
    resumes it."""
    if not todo:
        return
    for run in todo:
        if run.cfg.engine != "embedded":
            raise UserError(f"sweep: run {run.name}: --ray runs each run as one Ray task on engine=embedded; "
                            f"for engine={run.cfg.engine} on a cluster run it with ray_address=ADDRESS")
    ray = connect(address)
    try:
        _check_fits(ray, todo)
        nodes = check_shared(ray, out)
        log.info("sweep: %d run(s) on the Ray cluster at %s (%d nodes, %g CPUs, %g GPUs)", len(todo), address,
                 nodes, ray.cluster_resources().get("CPU", 0), ray.cluster_resources().get("GPU", 0))
        task = ray.remote(_task)
        pending = {}   # ObjectRef -> run
        for run in todo:
            config, need = task_config(run)
            (run.out / STARTED).unlink(missing_ok=True)   # present again once this attempt has started
            ref = task.options(**need, max_retries=RETRIES, retry_exceptions=False).remote(run_one, run.name, config)
            pending[ref] = run
        started: dict = {}   # run name -> driver time when its task was first seen running
        try:
            with _ctrl_c_flag() as ctrl_c:
                _wait_all(ray, pending, started, ctrl_c, account, show)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
    finally:
        ray.shutdown()   # disconnects this driver; the cluster goes on


def _wait_all(ray, pending: dict, started: dict, ctrl_c: threading.Event, account, show) -> None:
    """Record each task as it ends and refresh the progress line, until none is left; KeyboardInterrupt on Ctrl-C.
    `pending` (ObjectRef -> run) loses each task that ended, so what is left on an exception is what to cancel."""
    while pending:
        if ctrl_c.is_set():
            raise KeyboardInterrupt
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            run = pending.pop(ref)
            t_start = started.pop(run.name, None)
            try:
                res = ray.get(ref)
                seconds, error, where = res["seconds"], res["error"], {"node": res["node"],
                                                                       "host": res["host"]}
            except ray.exceptions.RayError as e:   # its worker or node died more than RETRIES times
                seconds = time.perf_counter() - t_start if t_start else 0.0
                error = f"its Ray task failed: {str(e).strip().splitlines()[0]}"
                where = _where(run)
                run.out.mkdir(parents=True, exist_ok=True)
                (run.out / "error.txt").write_text(f"{e}\n")
            if error and not (run.out / "error.txt").is_file():   # failed before the run began
                run.out.mkdir(parents=True, exist_ok=True)
                (run.out / "error.txt").write_text(f"{error}\n")
            account(run, seconds, error, where)
        now = time.perf_counter()
        for run in pending.values():
            if run.name not in started and (run.out / STARTED).is_file():
                started[run.name] = now
        show([(r, now - started[r.name]) for r in pending.values() if r.name in started],
             [r for r in pending.values() if r.name not in started])


def _where(run) -> dict:
    try:
        data = json.loads((run.out / STARTED).read_text())
        return {"node": data["node"], "host": data["host"]}
    except (OSError, ValueError, KeyError):
        return {"node": None, "host": None}
