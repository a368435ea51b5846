#!/usr/bin/env python
"""Run one fedlase experiment on Flower's Deployment Engine, all on loopback, and stop everything after.

    python scripts/flower-deploy-local.py [CONFIG] key=value ... [--no-worker]   (the arguments of `fedlase run`)

Laid out as a real federation (tools/flower_local.py): the SuperLink listens on 127.0.0.1 only (TLS, only
registered SuperNodes); nginx in front of it is the one address nodes reach (mutual TLS with the federation's
CA, the Fleet API only); each SuperNode reaches it through its own nginx sidecar holding the node's client
certificate. Unless the config names its own files (`tls_ca`, `tls_cert`, `tls_key`, `node_keys`), a throwaway
CA, SuperLink certificate and, per client, a key pair and a client certificate are made in <out>/flower-tls/.
Each node's public key is registered (`flwr supernode register`), one SuperNode per client starts with
`--node-config "partition-id=<i> level='<its level>'"`, and the run is submitted on the SuperLink's host with
`fedlase run engine=flower-deploy tls_ca=... node_keys=...` (partition i pinned to node-<i>.key.pub). Beside
each SuperNode runs its warm worker (fedlase/flower/worker.py: torch, the partition and the model kept across
messages, on a private Unix socket; it dies with its SuperNode); `--no-worker` starts none, and every message
then trains in the process Flower starts for it.
<out>/deployment.json says where the proxy, the SuperLink and each node's sidecar listen. Without nginx: a
one-line error. `insecure=true` turns TLS, authentication and the proxy off (with a warning).
Whatever happens, every process started here is stopped (each in its own process group). Logs go to
<out>/flower-logs/."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tools/ beside fedlase/

from fedlase.catalog import load_builtins  # noqa: E402
from fedlase.config import load_config  # noqa: E402
from fedlase.errors import UserError  # noqa: E402
from fedlase.flower.security import Credentials, check_node_keys, node_key  # noqa: E402
from tools.flower_local import LocalFederation  # noqa: E402


def credentials(cfg) -> Credentials | None:
    """The config's own TLS files and node keys, or None (LocalFederation then makes throwaway ones)."""
    if cfg.insecure or (cfg.tls_cert is None and cfg.node_keys is None):
        return None
    if cfg.tls_cert is None or cfg.node_keys is None:
        raise UserError("give both the SuperLink's files (tls_ca, tls_cert, tls_key) and node_keys, or neither")
    check_node_keys(cfg.node_keys, range(cfg.num_clients))
    return Credentials(Path(cfg.node_keys), Path(cfg.tls_ca), Path(cfg.tls_cert), Path(cfg.tls_key),
                       [node_key(cfg.node_keys, i) for i in range(cfg.num_clients)])


def main(argv: list[str]) -> int:
    # SIGTERM (e.g. a test's timeout) must still stop the SuperLink and SuperNodes: exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workers = "--no-worker" not in argv
    args = [a for a in argv if a not in ("--quiet", "--no-worker")]
    config = args.pop(0) if args and "=" not in args[0] else None
    try:
        load_builtins()
        cfg = load_config(config, args)
        creds = credentials(cfg)
        out = Path(cfg.out).resolve()
        with LocalFederation(out, creds, insecure=cfg.insecure, nodes=cfg.num_clients, workers=workers) as fed:
            fed.start_all(cfg)
            cmd = [sys.executable, "-m", "fedlase", "run", *([config] if config else []), *args, *fed.run_args(),
                   "--quiet"]
            return subprocess.run(cmd, env=fed.env).returncode
    except UserError as e:
        print(f"flower-deploy-local: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
