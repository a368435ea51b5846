"""Starting a run on Flower: `engine=flower-sim` (the Simulation Engine, in this process, through Flower's
public `flwr.simulation.run_simulation`: fedlase/flower/sim_engine.py) and `engine=flower-deploy` (submitted
with `flwr run` to a running SuperLink, over TLS unless `insecure=true`, with each partition pinned to its node's
key from `node_keys`; below).
The loopback deployment that tests and scripts/flower-deploy-local.py start is tools/flower_local.py.

Both go through a Flower app folder written into the run's `out` folder: a pyproject.toml naming the
ServerApp and ClientApp and carrying the whole fedlase config as the run config, so the server and every
node read the same config (a node's level in simulation: the system spec at its partition id)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..config import Config, tagged
from ..errors import ConfigError, UserError
from ..util import run_folder
from .sim_engine import simulate

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
    if resume and cfg.schedule != "sync":   # fedlase/flower/buffered.py
        raise UserError(f"--resume: a schedule={cfg.schedule} run on Flower cannot resume: the messages it had in "
                        "flight were the SuperLink's; start it again in another out folder")
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
