"""Starting a run on Flower: `engine=flower-sim` (the Simulation Engine, in this process, through Flower's
public `flwr.simulation.run_simulation`) and `engine=flower-deploy` (submitted with `flwr run` to a running
SuperLink, over TLS unless `insecure=true`, with each partition pinned to its node's key from `node_keys`).
The loopback deployment that tests and scripts/flower-deploy-local.py start is tools/flower_local.py.

Both go through a Flower app folder written into the run's `out` folder: a pyproject.toml naming the
ServerApp and ClientApp and carrying the whole fedlase config as the run config, so the server and every
node read the same config (a node's level in simulation: the system spec at its partition id)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from ..config import Config, tagged
from ..errors import ConfigError, UserError
from ..machine import usable_cpus
from ..util import run_folder

log = logging.getLogger("fedlase")

# Flower and Ray phone home and check for updates by default; a node must never install dependencies at
# run time (the SuperLink would `uv sync` a CUDA torch). Set in os.environ before Flower is imported.
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
             "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
             "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}   # actors keep seeing the GPU (device=cuda) at num_gpus=0


def quiet_env() -> None:
    os.environ.update(QUIET_ENV)


# The one Flower 1.42 polling interval a deployment may set: how often a SuperExec (one beside each SuperNode,
# one beside the SuperLink) asks its own process for a task to start (default 1 s; a request on loopback).
# The server's reply pull is fedlase's own (rounds.NodeRounds.POLL, 0.2 s). Fixed in Flower: a SuperNode with
# no work asks the SuperLink again after 3 s, and waits for its ClientApp's reply in steps of 0.5 s.
NODE_ENV = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}


# Files of the submitting machine: they mean nothing to the ServerApp and ClientApps on other machines.
LOCAL_FILES = tagged("submitter")   # tls_ca, tls_cert, tls_key, node_keys (their Options are tagged so)


def app_config(cfg: Config) -> dict:
    """The config the apps receive: the run's own, without the submitter's credential paths."""
    return {**cfg.to_dict(), **{k: None for k in LOCAL_FILES}}


def write_app(folder: Path, cfg: Config, resume: bool, progress: bool, pins: dict[int, str] | None = None,
              client_app: str = "fedlase.flower.client_app:app") -> Path:
    """A Flower app folder whose run config is this experiment's config (and `pins`: partition id -> the
    fingerprint of the node key that alone may serve it). `client_app`: another ClientApp for the nodes to run
    (tools/flower_profile.py times fedlase's)."""
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
clientapp = "{client_app}"

[tool.flwr.app.config]
fedlase-config = {json.dumps(json.dumps(app_config(cfg), default=str))}
resume = {str(bool(resume)).lower()}
progress = {str(bool(progress)).lower()}
partition-keys = {json.dumps(json.dumps({str(k): v for k, v in (pins or {}).items()}))}
"""
    (folder / "pyproject.toml").write_text(text)
    return folder


def require_tls(cfg: Config) -> None:
    """Secure by default: a deployment verifies its SuperLink with tls_ca and pins each partition to its node's
    key from node_keys, unless the user asked for insecure=true. Checked where a run is submitted, not in the
    config (the apps on other machines get the config without the submitter's file paths)."""
    if cfg.engine != "flower-deploy" or cfg.insecure:
        return
    if cfg.tls_ca is None:
        raise ConfigError("tls_ca", "engine=flower-deploy verifies the SuperLink with this CA certificate: give "
                                    "tls_ca=FILE (or insecure=true, loopback or a trusted network only)")
    if cfg.node_keys is None:
        raise ConfigError("node_keys", "engine=flower-deploy pins partition i to the node key node-<i>.key.pub: "
                                       "give node_keys=FOLDER (python -m fedlase.flower.security makes it)")


def partition_pins(cfg: Config) -> dict[int, str]:
    """Partition id -> fingerprint of the node key allowed to serve it (none with insecure=true)."""
    if cfg.insecure or cfg.node_keys is None:
        return {}
    from .security import partition_keys
    return partition_keys(Path(cfg.node_keys).expanduser(), cfg.num_clients)


def run_flower(cfg: Config, resume: bool = False, progress: bool = True) -> dict:
    """Run the experiment on Flower; return its summary (written to cfg.out as by the embedded engine)."""
    require_tls(cfg)
    quiet_env()
    for mod in ("flwr", "ray") if cfg.engine == "flower-sim" else ("flwr",):
        if importlib.util.find_spec(mod) is None:
            raise UserError(f"engine={cfg.engine} needs {mod}: pip install 'fedlase[flower]'")
    cfg = dataclasses.replace(cfg, out=str(Path(cfg.out).resolve()))   # the ServerApp may run in another folder
    out = run_folder(cfg.out, resume)
    pins = partition_pins(cfg) if cfg.engine == "flower-deploy" else {}
    app_dir = write_app(out / "flower-app", cfg, resume, progress and cfg.engine == "flower-sim", pins)
    if cfg.engine == "flower-sim":
        simulate(cfg, app_dir)
    else:
        submit(cfg, app_dir)
    summary = out / "summary.json"
    if not summary.exists():
        raise UserError(f"the Flower run ended without writing {summary}; see the log above")
    return json.loads(summary.read_text())


# ---- Simulation Engine ----------------------------------------------------------------------------------------
def _load(attr: str):
    """'package.module:name' -> that object."""
    module, _, name = attr.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_config(app_dir: Path) -> dict:
    """The app's run config ([tool.flwr.app.config]), as Flower gives it to the apps."""
    import tomllib
    return dict(tomllib.loads((Path(app_dir) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])


def configured_apps(server_app: str, client_app: str, run_config: dict):
    """A ServerApp and a ClientApp that hand the named apps a Context holding `run_config`. Flower's public
    `run_simulation` runs apps with an empty run config; these wrappers fill it, as a SuperLink would from the
    app's pyproject.toml. The ClientApp travels to the Ray workers by value: it names the real app and
    imports it there (once per worker), so a worker never unpickles a whole ClientApp."""
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    class ConfiguredServerApp(ServerApp):
        def __call__(self, grid, context):
            context.run_config = dict(run_config)
            return _load(server_app)(grid=grid, context=context)

    class ConfiguredClientApp(ClientApp):
        def __init__(self):
            super().__init__()
            self.inner = None

        def __getstate__(self):
            return {k: v for k, v in self.__dict__.items() if k != "inner"}

        def __setstate__(self, state):
            self.__dict__.update(state, inner=None)

        def __call__(self, message, context):
            if self.inner is None:
                self.inner = _load(client_app)
            # Flower refuses a node context whose run config changed: the app gets a copy that has one.
            inner = copy.copy(context)
            inner.run_config = dict(run_config)
            reply = self.inner(message, inner)
            context.state = inner.state
            return reply

    return ConfiguredServerApp(), ConfiguredClientApp()


class _DropDeprecation(logging.Filter):
    """fedlase calls `run_simulation` for the user: its deprecation notice (which says to use `flwr run`)
    is Flower talking to fedlase, not to them.

    Why the deprecated function stays: it is the only Python API of Flower 1.42 that runs a simulation in this
    process. Its replacement, `flwr run` on a simulation federation, starts a SuperLink process and runs the
    app from a built FAB, which would give up what `engine=flower-sim` is for: one process, the run's own Ray,
    nothing left running after it. pyproject.toml pins the tested range (flwr>=1.42,<1.43); a Flower that
    removes the function fails tests/test_flower.py."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation` function is deprecated" not in record.getMessage()


def simulation_backend(cfg: Config) -> dict:
    """A private Ray for this run, without its dashboard (an HTTP API that takes jobs, unneeded here): one CPU
    per actor, `sim_actors` of them (default: one per usable CPU, by affinity and CPU quota: a container's share,
    not the host's cores), each ClientApp one CPU (and, with device=cuda, an equal share of one GPU per client,
    at most 4 clients on it at once). With `ray_address`, the run joins that running cluster instead
    (fedlase/cluster.py), and the final `ray.shutdown()` only disconnects from it."""
    if cfg.ray_address is not None:
        from ..cluster import simulation_join
        return simulation_join(cfg)
    actors = cfg.sim_actors or usable_cpus()
    gpu = 0.0
    if cfg.device == "cuda" or (cfg.device == "auto" and _has_cuda()):
        gpu = 1.0 / max(1, min(actors, cfg.num_clients, 4))
    return {"client_resources": {"num_cpus": 1, "num_gpus": gpu},
            "init_args": {"address": "local", "num_cpus": actors, "logging_level": "ERROR", "log_to_driver": False,
                          "include_dashboard": False}}


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# Ray's own switch between a single-machine Ray (its default on macOS and Windows) and a cluster node. As a node,
# `ray.init(address="local")` binds its GCS, raylet and workers on every interface (measured with Ray 2.55: '::'),
# and Ray has no authentication: whoever reaches the machine could submit code to it. Off, all of them listen on
# 127.0.0.1 only. Ray reads it when it is imported; the processes it starts read it from the environment.
# The variable is Ray's documented switch (its docs on clusters under Windows and macOS); Ray offers no public
# API to set it after `import ray`, hence ray._private.ray_constants below (Ray 2.55.1, the version flwr 1.42
# pins; pyproject.toml pins flwr>=1.42,<1.43). tests/test_flower.py checks what it is for: the ports bound.
SINGLE_MACHINE_RAY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_ray():
    """While it is open, a Ray started by this process listens on loopback only (SINGLE_MACHINE_RAY)."""
    before = os.environ.get(SINGLE_MACHINE_RAY)
    os.environ[SINGLE_MACHINE_RAY] = "0"
    constants = sys.modules.get("ray._private.ray_constants")   # private: no public setter (see SINGLE_MACHINE_RAY)
    was = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    if constants is not None:   # Ray was imported before (a test, a notebook): it has read the switch already
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SINGLE_MACHINE_RAY, None)
        else:
            os.environ[SINGLE_MACHINE_RAY] = before
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = was


def simulate(cfg: Config, app_dir: Path) -> None:
    """Flower's Simulation Engine in this process (`flwr.simulation.run_simulation`): the ServerApp in a
    thread, the ClientApps in Ray actors, one virtual SuperNode per client. No SuperLink is started, so no
    process outlives the call."""
    # alembic (Flower's state database) logs "setup plugin ..." at INFO when it is imported: quiet before
    # the import; its warnings and errors still show
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from flwr.simulation import run_simulation  # deprecated, still the only in-process API (_DropDeprecation)
    logging.getLogger("flwr").setLevel(logging.WARNING)   # per-message chatter (after its import: it sets its own)
    srv, cli = configured_apps("fedlase.flower.server_app:app", "fedlase.flower.client_app:app", _run_config(app_dir))
    # Ray's raylet, gcs and workers are started below this process, but Flower shuts Ray down itself and
    # the orphaned workers then linger for tens of seconds: note them while they are ours, reap them after.
    me = psutil.Process()
    before, ray_procs, done = descendants(me.pid), set(), threading.Event()

    def watch():
        while not done.wait(0.5):
            for p in _children(me):
                if p.pid not in before and _is_ray(p):
                    ray_procs.add(p)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    quiet = _DropDeprecation()
    logging.getLogger("flwr").addFilter(quiet)
    private = loopback_ray() if cfg.ray_address is None else contextlib.nullcontext()   # a cluster is the user's
    try:
        with private:
            run_simulation(server_app=srv, client_app=cli, num_supernodes=cfg.num_clients,
                           backend_name="ray", backend_config=simulation_backend(cfg))
    finally:
        logging.getLogger("flwr").removeFilter(quiet)
        done.set()
        watcher.join()
        import ray
        ray.shutdown()
        reap(ray_procs)


# ---- processes ------------------------------------------------------------------------------------------------
def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def _is_ray(p: psutil.Process) -> bool:
    try:
        return "ray" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def descendants(root: int) -> set[psutil.Process]:
    """All live processes below `root` (psutil handles: a pid reused later is not mistaken for them)."""
    try:
        return set(_children(psutil.Process(root)))
    except psutil.Error:
        return set()


def reap(procs, grace: float = 15.0) -> None:
    """Wait up to `grace` seconds for these processes (psutil handles) to end, then SIGKILL what is left."""
    procs = [p for p in procs if isinstance(p, psutil.Process)]
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


# ---- Deployment Engine ----------------------------------------------------------------------------------------
def flwr_command(name: str = "flwr") -> str:
    """A Flower command of this environment (beside its python), else the PATH's."""
    exe = Path(sys.executable).with_name(name)
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        raise UserError(f"engine=flower-deploy needs the `{name}` command: pip install 'fedlase[flower]'")
    return found


def write_connection(home: Path, address: str, ca: str | None, insecure: bool) -> None:
    """A Flower config in `home` (FLWR_HOME) holding one SuperLink connection, `fedlase`, so the user's ~/.flwr
    is neither read nor changed."""
    lines = ['[superlink]', 'default = "fedlase"', '', '[superlink.fedlase]', f'address = "{address}"']
    if insecure:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = {json.dumps(str(Path(ca).expanduser().resolve()))}')
    (Path(home) / "config.toml").write_text("\n".join(lines) + "\n")


def submit(cfg: Config, app_dir: Path) -> None:
    """`flwr run` the app on the SuperLink at cfg.superlink, verified with cfg.tls_ca (or, with insecure=true,
    in plain text), and wait for the end."""
    from .security import INSECURE_WARNING
    flwr = flwr_command()
    require_tls(cfg)
    if cfg.insecure:
        log.warning(INSECURE_WARNING)
    with tempfile.TemporaryDirectory(prefix="fedlase-flwr-home-") as home:
        write_connection(Path(home), cfg.superlink, cfg.tls_ca, cfg.insecure)
        env = {**os.environ, **QUIET_ENV, "FLWR_HOME": home}
        res = subprocess.run([flwr, "run", str(app_dir), "fedlase", "--stream"], env=env)
    if res.returncode != 0:
        raise UserError(f"flwr run exited with status {res.returncode}; is a SuperLink running at {cfg.superlink}"
                        f"{'' if cfg.insecure else ' and does tls_ca hold the CA that signed its certificate'}?")
