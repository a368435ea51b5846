"""Starting a run on Flower: `engine=flower-sim` (the Simulation Engine, in this process) and
`engine=flower-deploy` (submitted with `flwr run` to a running SuperLink).

Both go through a Flower app folder written into the run's `out` folder: a pyproject.toml naming the
ServerApp and ClientApp and carrying the whole fedlase config as the run config, so the server and every
node read the same config (a node's level in simulation: the system spec at its partition id)."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..config import Config
from ..errors import UserError

log = logging.getLogger("fedlase")

# Flower and Ray phone home and check for updates by default; a node must never install dependencies at
# run time (the SuperLink would `uv sync` a CUDA torch). Set in os.environ before Flower is imported.
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
             "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
             "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}   # actors keep seeing the GPU (device=cuda) at num_gpus=0


def quiet_env() -> None:
    os.environ.update(QUIET_ENV)


def write_app(folder: Path, cfg: Config, resume: bool, progress: bool) -> Path:
    """A Flower app folder whose run config is this experiment's config."""
    folder.mkdir(parents=True, exist_ok=True)
    text = f"""# Written by fedlase for one run; `flwr run {folder} <superlink>` submits it.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedlase-flower"
version = "1.0.0"
description = "fedlase on Flower"
# fedlase, torch and flwr come from the environment of the SuperLink and SuperNodes: runtime dependency
# installation stays disabled.
dependencies = []

[tool.flwr.app]
publisher = "fedlase"

[tool.flwr.app.components]
serverapp = "fedlase.flower.server_app:app"
clientapp = "fedlase.flower.client_app:app"

[tool.flwr.app.config]
fedlase-config = {json.dumps(json.dumps(cfg.to_dict(), default=str))}
resume = {str(bool(resume)).lower()}
progress = {str(bool(progress)).lower()}
"""
    (folder / "pyproject.toml").write_text(text)
    return folder


def _check_out(cfg: Config, resume: bool) -> Path:
    out = Path(cfg.out)
    if not resume and ((out / "checkpoint.pt").exists() or (out / "summary.json").exists()):
        raise UserError(f"out: {out} already holds a run; pass --resume to continue it or choose another out")
    return out


def run_flower(cfg: Config, resume: bool = False, progress: bool = True) -> dict:
    """Run the experiment on Flower; return its summary (written to cfg.out as by the embedded engine)."""
    quiet_env()
    for mod in ("flwr", "ray") if cfg.engine == "flower-sim" else ("flwr",):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"engine={cfg.engine} needs {mod}: pip install 'fedlase[flower]'")
    cfg.out = str(Path(cfg.out).resolve())   # the ServerApp may run in another working directory
    out = _check_out(cfg, resume)
    app_dir = write_app(out / "flower-app", cfg, resume, progress and cfg.engine == "flower-sim")
    if cfg.engine == "flower-sim":
        simulate(cfg, app_dir)
    else:
        submit(cfg, app_dir)
    summary = out / "summary.json"
    if not summary.exists():
        raise UserError(f"the Flower run ended without writing {summary}; see the log above")
    return json.loads(summary.read_text())


def simulate(cfg: Config, app_dir: Path, client_app: str = "fedlase.flower.client_app:app") -> None:
    """Flower's Simulation Engine in this process: the ServerApp in a thread, the ClientApps in Ray actors
    (one CPU each), one virtual SuperNode per client. This is what `flwr-simulation` does once a SuperLink
    has handed it the app, minus the SuperLink, so no process outlives the call. `client_app` lets tests
    run a ClientApp that misbehaves."""
    for name in ("flwr", "alembic"):   # Flower's per-message and state-database chatter (some at import)
        logging.getLogger(name).setLevel(logging.WARNING)
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType
    # The server's run config is given here; each node reads the same from app_dir.
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                      run_config=get_fused_config_from_dir(app_dir, {}))
    cpus = max(1, os.cpu_count() or 1)
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "logging_level": "ERROR", "log_to_driver": False}}
    # Ray's raylet, gcs and workers are started below this process, but Flower shuts Ray down itself and
    # the orphaned workers then linger for tens of seconds: note them while they are ours, reap them after.
    before, ray_procs, done = descendants(os.getpid()), set(), threading.Event()

    def watch():
        while not done.wait(0.5):
            ray_procs.update(p for p in descendants(os.getpid()) - before if b"ray" in _read(f"/proc/{p}/cmdline"))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _run_simulation(num_supernodes=cfg.num_clients, exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                        server_app_attr="fedlase.flower.server_app:app",
                        client_app_attr=client_app, backend_name="ray",
                        backend_config=backend, app_dir=str(app_dir), server_app_context=context,
                        is_app=True)
    finally:
        done.set()
        watcher.join()
        import ray
        ray.shutdown()
        reap(ray_procs)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]; [] if it is gone."""
    text = _read(f"/proc/{pid}/stat").decode(errors="replace")
    return text.rsplit(")", 1)[1].split() if ")" in text else []


def descendants(root: int) -> set[int]:
    """Pids of all live processes below `root` (Linux /proc; empty elsewhere)."""
    parent = {}
    for d in Path("/proc").glob("[0-9]*"):
        f = _stat(int(d.name))
        if len(f) > 1 and f[0] != "Z":
            parent[int(d.name)] = int(f[1])
    out, todo = set(), [root]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[-1]]
        todo.pop()
        out.update(kids)
        todo += kids
    return out


def reap(pids: set[int], grace: float = 15.0) -> None:
    """Wait for these processes to end, then SIGKILL what is left."""
    alive = lambda p: (f := _stat(p)) and f[0] != "Z"   # noqa: E731
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    for p in pids:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def submit(cfg: Config, app_dir: Path) -> None:
    """`flwr run` the app on the SuperLink at cfg.superlink (insecure, e.g. loopback) and wait for the end."""
    flwr = Path(sys.executable).with_name("flwr")   # the one of this environment, else the PATH's
    flwr = str(flwr) if flwr.exists() else shutil.which("flwr")
    if flwr is None:
        raise UserError("engine=flower-deploy needs the `flwr` command: pip install 'fedlase[flower]'")
    with tempfile.TemporaryDirectory(prefix="fedlase-flwr-home-") as home:
        # A private Flower config holding one connection, so the user's ~/.flwr is neither read nor changed.
        (Path(home) / "config.toml").write_text(
            f'[superlink]\ndefault = "fedlase"\n\n[superlink.fedlase]\naddress = "{cfg.superlink}"\ninsecure = true\n')
        env = {**os.environ, **QUIET_ENV, "FLWR_HOME": home}
        res = subprocess.run([flwr, "run", str(app_dir), "fedlase", "--stream"], env=env)
    if res.returncode != 0:
        raise UserError(f"flwr run exited with status {res.returncode}; is a SuperLink running at {cfg.superlink}?")
