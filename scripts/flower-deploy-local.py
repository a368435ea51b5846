#!/usr/bin/env python
"""Run one fedlase experiment on Flower's Deployment Engine, all on loopback, and stop everything after.

    python scripts/flower-deploy-local.py [CONFIG] key=value ...       (the same arguments as `fedlase run`)

Starts a SuperLink (insecure, 127.0.0.1, a free port) and one SuperNode per client of the config, each with
`--node-config "partition-id=<i> level='<its level>'"`, submits the run with `fedlase run engine=flower-deploy`
and, whatever happens, stops every process it started (each in its own process group). Logs go to
<out>/flower-logs/. Every node process imports torch: expect tens of seconds a round on a small machine."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedlase.config import load_config
from fedlase.engine import level_name
from fedlase.errors import UserError
from fedlase.flower.launch import QUIET_ENV, descendants, reap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with status {proc.returncode}; see its log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the SuperLink did not listen on port {port} within {timeout:.0f} s")


def stop(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM each process group, then SIGKILL what is still there after `grace` seconds, including the
    processes they started in other groups (the SuperLink's flwr-serverapp)."""
    tree = set().union(*(descendants(p.pid) for p in procs))
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:   # the group too: a node's ClientApp processes may outlive it
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    reap(tree, grace=5.0)


def main(argv: list[str]) -> int:
    # SIGTERM (e.g. a test's timeout) must still stop the SuperLink and SuperNodes: exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = [a for a in argv if a != "--quiet"]
    config = args.pop(0) if args and "=" not in args[0] else None
    try:
        cfg = load_config(config, args)
    except UserError as e:
        print(f"flower-deploy-local: error: {e}", file=sys.stderr)
        return 2
    logs = Path(cfg.out).resolve() / "flower-logs"
    logs.mkdir(parents=True, exist_ok=True)
    bindir = str(Path(sys.executable).parent)   # flower-superlink, flower-supernode, flwr live beside python
    home = tempfile.mkdtemp(prefix="fedlase-flwr-")   # FLWR_HOME: where the nodes install the app bundle
    env = {**os.environ, **QUIET_ENV, "FLWR_HOME": home, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    port, procs = free_port(), []

    def start(name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(logs / f"{name}.log", "w")
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        link = start("superlink", [f"{bindir}/flower-superlink", "--insecure", "--host", "127.0.0.1",
                                   "--port", str(port), "--database", ":flwr-in-memory:",
                                   "--disable-runtime-dependency-installation"])
        wait_for_port(port, link)
        for pid, lvl in enumerate(cfg.client_levels):
            start(f"supernode-{pid}", [f"{bindir}/flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                                       "--port", str(free_port()),
                                       "--node-config", f"partition-id={pid} level='{level_name(lvl)}'"])
        cmd = [sys.executable, "-m", "fedlase", "run", *([config] if config else []), *args, "engine=flower-deploy",
               f"superlink=127.0.0.1:{port}", "--quiet"]
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        stop(procs)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
