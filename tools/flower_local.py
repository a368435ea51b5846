"""A Flower deployment on loopback, laid out as a real one: for scripts/flower-deploy-local.py and the tests.

- the SuperLink listens on 127.0.0.1 only (TLS, node authentication on); `flwr` and `fedlase run
  engine=flower-deploy` reach its Control API there, as on the SuperLink's own host;
- the front proxy (nginx, `fedlase.flower.proxy.front_config`) is the one address node machines reach:
  mutual TLS with the federation's CA, the Fleet API's routes only;
- each SuperNode talks TLS to its own sidecar (nginx, `sidecar_config`) on loopback, which holds that node's
  client certificate and opens the mutual-TLS connection to the proxy;
- beside each SuperNode, its warm worker (fedlase/flower/worker.py) in a private folder of its own, named in the
  node's config (`worker-dir`) and watching the SuperNode's pid, so it dies with it (`workers=False`: none,
  every message trains in its ClientApp process);
- every Flower process polls as `launch.NODE_ENV` says (unless the environment sets it).

Every process is a process group of its own with its log in `<out>/flower-logs/`; `stop()` (or leaving the
`with` block) ends them all, and what they started. `<out>/deployment.json` says where everything is.
`insecure=True`: no TLS, no node authentication, no proxy (with a warning); never chosen for you."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from fedlase.errors import UserError
from fedlase.flower.launch import NODE_ENV, QUIET_ENV, flwr_command, write_connection
from fedlase.flower.processes import descendants, reap
from fedlase.flower.proxy import body_limit, front_config, nginx_binary, nginx_command, sidecar_config, sidecar_files
from fedlase.flower.security import INSECURE_WARNING, Credentials, fingerprint, make_credentials, node_cert
from fedlase.flower.worker import SOCKET, listening

log = logging.getLogger("fedlase")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFederation:
    """A SuperLink, its front proxy, and SuperNodes each behind its sidecar, all on loopback. `creds`: the
    federation's files (made in `<out>/flower-tls` when not given, with `nodes` nodes). `workers`: a warm worker
    beside each SuperNode."""

    def __init__(self, out: Path, creds: Credentials | None = None, insecure: bool = False, nodes: int = 0,
                 workers: bool = True):
        self.out = Path(out)
        self.logs = self.out / "flower-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.insecure = insecure
        if insecure:
            log.warning(INSECURE_WARNING)
        else:
            nginx_binary()   # fail now, in one line, rather than after the SuperLink started
        self.creds = None if insecure else creds or make_credentials(self.out / "flower-tls", nodes=nodes,
                                                                             force=True)   # throwaway ones
        self.bindir = str(Path(sys.executable).parent)   # flower-superlink, flower-supernode, flwr live beside python
        self.home = Path(tempfile.mkdtemp(prefix="fedlase-flwr-"))   # FLWR_HOME: connection, app bundles
        self.env = {**NODE_ENV, **os.environ, **QUIET_ENV, "FLWR_HOME": str(self.home),
                    "PATH": self.bindir + os.pathsep + os.environ.get("PATH", "")}
        self.workers = workers
        self.worker_dirs: dict[str, Path] = {}   # node name -> its worker's private folder
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"    # the SuperLink: Control and Runtime APIs, this host only
        self.proxy: str | None = None               # what node machines reach (None: insecure, no proxy)
        self.procs: dict[str, subprocess.Popen] = {}
        self.sidecars: dict[str, subprocess.Popen] = {}
        self.deployment = {"superlink": self.address, "proxy": None, "insecure": insecure,
                           "ca": self.creds and str(self.creds.ca), "nodes": {}}
        write_connection(self.home, self.address, self.creds and str(self.creds.ca), insecure)

    def __enter__(self) -> LocalFederation:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- processes -----------------------------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "a") as out:
            p = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[f"{name}#{p.pid}"] = p
        return p

    def _wait_listening(self, proc: subprocess.Popen, port: int, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise UserError(f"{name} exited with status {proc.returncode}; see {self.logs}/{name}.log")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise UserError(f"{name} did not listen on port {port} within {timeout:.0f} s")

    def _write_deployment(self) -> None:
        (self.out / "deployment.json").write_text(json.dumps(self.deployment, indent=1) + "\n")

    # ---- the SuperLink's host ------------------------------------------------------------------------------
    def start_superlink(self, timeout: float = 60.0, max_body: int | None = None) -> str:
        """The SuperLink on loopback and, unless insecure, the front proxy (request bodies up to `max_body`
        bytes: `fedlase.flower.proxy.body_limit`); returns the proxy's address (the SuperLink's without one)."""
        tls = ["--insecure"] if self.insecure else [
            "--ssl-ca-certfile", str(self.creds.ca), "--ssl-certfile", str(self.creds.cert),
            "--ssl-keyfile", str(self.creds.key), "--enable-supernode-auth"]
        link = self._start("superlink", [f"{self.bindir}/flower-superlink", *tls, "--host", "127.0.0.1",
                                         "--port", str(self.port), "--database", ":flwr-in-memory:",
                                         "--disable-runtime-dependency-installation"])
        self._wait_listening(link, self.port, "superlink", timeout)
        if not self.insecure:
            port = free_port()
            work = self.out / "flower-proxy" / "front"
            cmd = nginx_command(work, front_config(work.resolve(), f"127.0.0.1:{port}", self.address,
                                                   *(p.resolve() for p in (self.creds.ca, self.creds.cert,
                                                                           self.creds.key)), max_body=max_body))
            self._wait_listening(self._start("proxy", cmd), port, "proxy", timeout)
            self.proxy = f"127.0.0.1:{port}"
        self.deployment["proxy"] = self.proxy
        self._write_deployment()
        return self.proxy or self.address

    def flwr(self, *args: str, timeout: float = 60.0, env: dict | None = None) -> subprocess.CompletedProcess:
        """A `flwr` command against this SuperLink (connection `fedlase`, on the SuperLink's host)."""
        return subprocess.run([flwr_command(), *args], env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)

    def register(self, public_key: Path, tries: int = 10) -> None:
        """Admit the SuperNode holding this public key's private key (`flwr supernode register`)."""
        for _ in range(tries):   # the SuperLink's port may open before its Control API answers
            res = self.flwr("supernode", "register", str(public_key), "fedlase")
            if res.returncode == 0:
                return
            time.sleep(1.0)
        raise UserError(f"could not register {public_key}: {(res.stdout + res.stderr).strip()[-500:]}")

    # ---- a node's machine ----------------------------------------------------------------------------------
    def start_sidecar(self, name: str, cert: Path, key: Path, timeout: float = 60.0) -> tuple[str, Path]:
        """A node's sidecar holding client certificate `cert`/`key`; returns (its loopback address, the
        certificate the SuperNode trusts for it)."""
        port = free_port()
        work = (self.out / "flower-proxy" / name).resolve()
        work.mkdir(parents=True, exist_ok=True)
        root = sidecar_files(work)
        cmd = nginx_command(work, sidecar_config(work, f"127.0.0.1:{port}", self.proxy, self.creds.ca.resolve(),
                                                 Path(cert).resolve(), Path(key).resolve()))
        p = self._start(f"sidecar-{name}", cmd)
        self._wait_listening(p, port, f"sidecar-{name}", timeout)
        self.sidecars[name] = p
        return f"127.0.0.1:{port}", root

    def start_node(self, partition: int, level: str, key: Path | None = None, cert: tuple[Path, Path] | None = None,
                   name: str | None = None, worker: bool | None = None) -> subprocess.Popen:
        """A SuperNode declaring `partition` at `level`, behind a sidecar of its own, and its worker (`worker`:
        whether it gets one; default: as the federation says). `key`: its node private key, `cert`: its client
        certificate and key (default: the credentials' own for that partition)."""
        name = name or f"supernode-{partition}"
        node_config = f"partition-id={partition} level='{level}'"
        worker = self.workers if worker is None else worker
        if worker:   # short and private: a Unix socket path has at most 107 bytes
            self.worker_dirs[name] = Path(tempfile.mkdtemp(prefix="fedlase-node-"))
            node_config += f" worker-dir='{self.worker_dirs[name]}'"
        entry = {"partition": partition, "level": level}
        if self.insecure:
            auth, target = ["--insecure"], self.address
        else:
            key = Path(key or self.creds.nodes[partition])
            cert = cert or node_cert(self.creds.folder, partition)
            target, root = self.start_sidecar(name, *cert)
            auth = ["--root-certificates", str(root), "--auth-supernode-private-key", str(key)]
            entry.update(sidecar=target, sidecar_cert=str(root), client_cert=str(cert[0]),
                         public_key=f"{key}.pub", fingerprint=fingerprint(Path(f"{key}.pub").read_bytes()))
        node = self._start(name, [f"{self.bindir}/flower-supernode", *auth, "--superlink", target,
                                  "--port", str(free_port()), "--node-config", node_config])
        if worker:
            entry["worker"] = str(self.worker_dirs[name] / SOCKET)
            self.start_worker(name, partition, node.pid)
        self.deployment["nodes"][name] = entry
        self._write_deployment()
        return node

    def start_worker(self, name: str, partition: int, node_pid: int, timeout: float = 60.0) -> subprocess.Popen:
        """Node `name`'s warm worker, watching its SuperNode's pid; returns once its socket listens (it binds
        before it imports torch, so a message that comes early waits for it rather than finding none)."""
        folder = self.worker_dirs[name]
        w = self._start(f"worker-{name}", [sys.executable, "-P", "-m", "fedlase.flower.worker", "--dir", str(folder),
                                            "--partition-id", str(partition), "--watch-pid", str(node_pid)])
        deadline = time.monotonic() + timeout
        while not listening(folder):
            if w.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"the worker of {name} did not start; see {self.logs}/worker-{name}.log")
            time.sleep(0.05)
        return w

    def worker(self, name: str) -> subprocess.Popen | None:
        """The live worker process of node `name`, if any."""
        for key, p in self.procs.items():
            if key.startswith(f"worker-{name}#") and p.poll() is None:
                return p
        return None

    def start_all(self, cfg) -> dict[int, subprocess.Popen]:
        """The SuperLink and its proxy, every node key registered, one SuperNode per client of `cfg` declaring
        the level its system spec gives it; returns the SuperNodes by partition."""
        self.start_superlink(max_body=body_limit(cfg))   # the run's model sets the proxy's body limit
        if not self.insecure:
            for pid in range(cfg.num_clients):
                self.register(Path(f"{self.creds.nodes[pid]}.pub"))
        return {pid: self.start_node(pid, cfg.levels.level_of(pid).name) for pid in range(cfg.num_clients)}

    def run_args(self) -> list[str]:
        """The `fedlase run` settings that submit to this federation from the SuperLink's host."""
        security = (["insecure=true"] if self.insecure
                    else [f"tls_ca={self.creds.ca}", f"node_keys={self.creds.folder}"])
        return ["engine=flower-deploy", f"superlink={self.address}", *security]

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process and everything below it at once (a node dying with its ClientApps; its sidecar,
        another service on the machine, stays)."""
        tree = [*descendants(proc.pid)]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is still there after `grace` seconds, including the
        processes they started in other groups (the SuperLink's flwr-serverapp, nginx workers)."""
        procs = list(self.procs.values())
        tree = set().union(*(descendants(p.pid) for p in procs)) if procs else set()
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:   # the group too: a node's ClientApp processes may outlive it
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        reap(tree, grace=3.0)
        shutil.rmtree(self.home, ignore_errors=True)
        for folder in self.worker_dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
