"""`engine=flower-sim`: Flower's Simulation Engine in this process (`flwr.simulation.run_simulation`), with the
app's run config handed to the apps, a private Ray for the run that listens on loopback only, and the Ray
processes it leaves behind reaped (fedlase/flower/processes.py). fedlase/flower/launch.py writes the app folder
and calls `simulate`."""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import sys
import threading
from pathlib import Path

import psutil

from ..config import Config
from ..machine import usable_cpus
from .processes import children, descendants, is_ray, reap


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
            for p in children(me):
                if p.pid not in before and is_ray(p):
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
