"""The network edge of a Flower deployment: nginx in front of the SuperLink, and nginx beside each SuperNode.

Flower 1.42 serves the Fleet, Control and Runtime APIs of a SuperLink on one HTTP port (uvicorn, HTTP/1.1) and
verifies no client certificate. So:

- the SuperLink listens on 127.0.0.1 only (its `flwr` Control API and the ServerApp's Runtime API stay there);
- the **front proxy** (`front_config`) listens where the nodes reach it, terminates TLS with the SuperLink
  host's certificate, admits only clients holding a certificate signed by the federation's CA (mutual TLS),
  and forwards only the Fleet API's routes (POST, the exact paths Flower's own Fleet router declares) to the
  SuperLink; every other path (`/v1/control/*`, `/v1/runtime/*`, `/docs`, `/openapi.json`) is a 404;
- each node's **sidecar** (`sidecar_config`) listens on the node's loopback with a throwaway self-signed
  certificate (the SuperNode trusts exactly it: Flower's SuperNode authenticates only over TLS) and opens the
  mutual-TLS connection to the front proxy with the node's client certificate, verifying the proxy with the CA.

`python -m fedlase.flower.proxy front|sidecar ...` writes the config into a folder of its own (config, pid,
logs, temp files) and runs nginx in the foreground as the current user; the system's nginx service is never
used. Without nginx: a one-line error saying how to install it (there is no open fallback)."""
from __future__ import annotations

import argparse
import grp
import ipaddress
import os
import pwd
import re
import shutil
import sys
from pathlib import Path

from ..errors import UserError
from ..util import split_host_port

INSTALL_HINT = ("the Flower deployment needs nginx (the mutual-TLS proxy in front of the SuperLink and beside each "
                "SuperNode): apt-get install nginx (Debian/Ubuntu; `make deploy-deps` installs it)")
SIDECAR_CERT, SIDECAR_KEY = "sidecar.crt", "sidecar.key"
# The largest request body the front proxy lets through (`client_max_body_size`; nginx answers 413 to a
# larger one before anything reaches the SuperLink). A SuperNode's largest legitimate request is one object
# of its reply (Flower pushes a message as objects, an array cut into chunks of at most
# FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE bytes), measured for the run's model by `largest_request`.
BODY_MARGIN = 2          # over the measured request: metrics, framing a Flower upgrade may add
BODY_FLOOR = 1 << 20     # the Fleet API's other requests (activate, heartbeat, a message's object tree): KBs
SIDECAR_BODY_LIMIT = "1g"   # the sidecar forwards its own node's requests; the front proxy is the bound


def nginx_binary() -> str:
    """The nginx executable (PATH, then /usr/sbin where Debian puts it), else a UserError saying how to install it."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if os.access(p, os.X_OK)), None)
    if found is None:
        raise UserError(INSTALL_HINT)
    return found


def fleet_routes() -> list[str]:
    """The Fleet API's HTTP paths: one per call of the Fleet service in Flower's wire protocol, named as the
    SuperLink serves them (`RegisterNode` -> /v1/fleet/register-node). So a Flower upgrade that adds a call is
    forwarded, and nothing else is; tests/test_structure.py checks these are exactly the SuperLink
    router's paths.

    Not a documented API: Flower publishes no list of the Fleet API's routes. The wire protocol's service
    (`flwr.proto`, the messages SuperNode and SuperLink exchange) is the stable part, where the SuperLink's own
    router (`flwr.superlink.routers...`) is server internals; the `/v1/fleet/` naming is what Flower
    1.42 serves (pyproject.toml pins the tested range, flwr>=1.42,<1.43)."""
    from flwr.proto import fleet_pb2  # not documented API: see the docstring
    calls = [m.name for m in fleet_pb2.DESCRIPTOR.services_by_name["Fleet"].methods]
    paths = sorted("/v1/fleet/" + re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower() for name in calls)
    if not paths:
        raise UserError("this Flower version's wire protocol has no Fleet service; fedlase's proxy cannot "
                        "forward its API (tested with flwr 1.42)")
    return paths


def split_address(address: str) -> tuple[str, int]:
    if (parsed := split_host_port(address)) is None:
        raise UserError(f"address {address!r}: expected host:port")
    return parsed


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


FRAMING = 512   # a request's bytes around one object: node and run ids, object and session ids, length prefixes
TREE_ENTRY = 80  # an object's entry in the object tree a `push-messages` request lists: its id and nesting


def _objects(obj):
    """`obj` and every object below it, as Flower sends a message: each pushed on its own."""
    yield obj
    for child in (obj.children or {}).values():
        yield from _objects(child)


def largest_request(shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of the largest request body a SuperNode sends for a reply whose update holds a float32 array of
    each of `shapes` (the whole model: at most what any client's reply holds), through Flower's own
    serialization: the reply message is split into objects (message, records, arrays, array chunks), each
    deflated and pushed in its own `push-object` request, after one `push-messages` request listing the
    object tree (Flower's public Message and record classes; the request framing is a fixed allowance)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, Metadata, MetricRecord, RecordDict
    big = 2**63 - 1   # the largest ids: the most bytes they take
    content = RecordDict({"delta": ArrayRecord({n: Array(np.zeros(s, np.float32)) for n, s in shapes.items()}),
                          "metrics": MetricRecord({"train-loss": 0.0, "partition-id": big, "round": big})})
    msg = Message(content, metadata=Metadata(big, "x" * 64, big, big, "x" * 64, "x" * 64, 0.0, 1e9, "train",
                                             big, big))
    objects = list(_objects(msg))
    return FRAMING + max(max(len(o.deflate()) for o in objects), TREE_ENTRY * len(objects))


def body_limit(cfg=None) -> int:
    """`client_max_body_size` in bytes for a run's model: BODY_MARGIN times its `largest_request` (every
    trainable parameter and buffer of the full model: a LoRA run's frozen base never travels), at least
    BODY_FLOOR. Without a config: the bound for any model whose arrays Flower chunks, measured on one 32 MiB
    array (larger than a chunk, so it travels as chunks)."""
    if cfg is None:
        shapes = {"array": (8 * 2**20,)}
    else:
        from ..registry import DATASETS, MODELS, load_dataset
        from ..resources import meta_model
        model = meta_model(MODELS.get(cfg.model).build, cfg, DATASETS.get(cfg.dataset))
        if model is None:   # a model that needs its data to be built (the text models): built for real, once
            from ..client import build_model_for
            model = build_model_for(cfg, load_dataset(cfg))
        from ..train import trainable
        shapes = {n: tuple(t.shape) for n, t in [*trainable(model).items(), *model.named_buffers()]}
    return max(BODY_FLOOR, BODY_MARGIN * largest_request(shapes))


def _frame(workdir: Path, body: str, body_limit: int | str) -> str:
    """One nginx process of its own: config, pid, logs and temp files in `workdir`, run by the current user."""
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # As root, nginx would hand its workers to `nobody`; keep them the current user (never the system service).
    user = ""
    if os.geteuid() == 0:
        pw = pwd.getpwuid(os.geteuid())
        user = f"user {pw.pw_name} {grp.getgrgid(pw.pw_gid).gr_name};\n"
    temps = "\n".join(f"    {k}_temp_path {tmp / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = workdir / "nginx.conf"
    return f"""# Written by fedlase (fedlase/flower/proxy.py); run: nginx -p {workdir} -c {conf} -e stderr
daemon off;
worker_processes 1;
pid {workdir / 'nginx.pid'};
error_log stderr warn;
{user}events {{ worker_connections 512; }}
http {{
    access_log {workdir / 'access.log'};
{temps}
    server_tokens off;
    client_max_body_size {body_limit};
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_request_buffering off;
    proxy_buffering off;
    proxy_read_timeout 600s;
    proxy_send_timeout 600s;
{body}}}
"""


def front_config(workdir: Path, listen: str, superlink: str, ca: Path, cert: Path, key: Path,
                 max_body: int | None = None) -> str:
    """nginx.conf of the front proxy: mutual TLS on `listen`, the Fleet routes (POST only) to the SuperLink's
    loopback address `superlink` (TLS, verified with the CA as `localhost`), a 404 for everything else; request
    bodies over `max_body` bytes (default: `body_limit()`, any model's bound) refused with 413."""
    link_host, link_port = split_address(superlink)
    if not _is_loopback(link_host):
        raise UserError(f"the SuperLink must listen on loopback behind the proxy, not {superlink}")
    names = "|".join(p.rsplit("/", 1)[1] for p in fleet_routes())
    return _frame(workdir, f"""    upstream superlink {{ server {link_host}:{link_port}; keepalive 16; }}
    server {{
        listen {listen} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_client_certificate {ca};     # mutual TLS: only clients with a certificate of the federation's CA
        ssl_verify_client on;
        ssl_verify_depth 1;
        # The Fleet API only, by exact path; the upstream sees the normalized path, never the client's raw one.
        location ~ ^/v1/fleet/({names})$ {{
            limit_except POST {{ deny all; }}
            proxy_pass https://superlink/v1/fleet/$1;
            proxy_ssl_trusted_certificate {ca};
            proxy_ssl_verify on;
            proxy_ssl_name localhost;
            proxy_ssl_session_reuse on;
        }}
        location / {{ return 404; }}
    }}
""", body_limit() if max_body is None else max_body)


def sidecar_config(workdir: Path, listen: str, proxy: str, ca: Path, cert: Path, key: Path) -> str:
    """nginx.conf of a node's sidecar: TLS on loopback `listen` with `workdir`/sidecar.crt (see `sidecar_files`),
    forwarding the Fleet API to the front proxy at `proxy` over mutual TLS with the node's client certificate
    `cert`/`key`, the proxy verified with the CA."""
    host, port = split_address(listen)
    if not _is_loopback(host):
        raise UserError(f"a sidecar listens on loopback only, not {listen}")
    proxy_host, proxy_port = split_address(proxy)
    # nginx checks the proxy's certificate against a DNS name; the federation's certificates always name
    # localhost, so a proxy reached by IP address is verified as localhost only on loopback.
    name = proxy_host if not _is_ip(proxy_host) else "localhost"
    if _is_ip(proxy_host) and not _is_loopback(proxy_host):
        raise UserError(f"give the proxy's DNS name (as in its certificate), not the IP address {proxy_host}")
    return _frame(workdir, f"""    upstream proxy {{ server {proxy_host}:{proxy_port}; keepalive 8; }}
    server {{
        listen {host}:{port} ssl;
        ssl_certificate {workdir / SIDECAR_CERT};
        ssl_certificate_key {workdir / SIDECAR_KEY};
        location /v1/fleet/ {{
            proxy_pass https://proxy;
            proxy_ssl_certificate {cert};
            proxy_ssl_certificate_key {key};
            proxy_ssl_trusted_certificate {ca};
            proxy_ssl_verify on;
            proxy_ssl_name {name};
            proxy_ssl_server_name on;
            proxy_ssl_session_reuse on;
        }}
        location / {{ return 404; }}
    }}
""", SIDECAR_BODY_LIMIT)


def sidecar_files(workdir: Path) -> Path:
    """The sidecar's loopback certificate and key in `workdir`, made once; returns the certificate (what the
    SuperNode passes as `--root-certificates`)."""
    from .security import self_signed
    cert = Path(workdir) / SIDECAR_CERT
    if not cert.exists():
        self_signed(cert, Path(workdir) / SIDECAR_KEY)
    return cert


def nginx_command(workdir: Path, config: str) -> list[str]:
    """Write `config` as `workdir`/nginx.conf, check it (`nginx -t`), return the command that runs it."""
    import subprocess
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    conf.write_text(config)
    cmd = [nginx_binary(), "-p", str(workdir), "-c", str(conf), "-e", "stderr"]
    res = subprocess.run([*cmd, "-t", "-q"], capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(f"nginx refused {conf}: {' '.join(res.stderr.split())[:400]}")
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedlase.flower.proxy",
                                 description="Run nginx as the mutual-TLS front proxy of a SuperLink or as a "
                                             "SuperNode's sidecar (foreground, current user, files in --workdir).")
    sub = ap.add_subparsers(dest="role", required=True)
    f = sub.add_parser("front", help="on the SuperLink's host: the nodes' only way in")
    f.add_argument("--listen", required=True, help="host:port the nodes reach, e.g. 0.0.0.0:9443")
    f.add_argument("--superlink", required=True, help="the SuperLink's loopback address, e.g. 127.0.0.1:9093")
    f.add_argument("--cert", required=True, help="the SuperLink host's certificate (superlink.crt)")
    f.add_argument("--key", required=True, help="its private key (superlink.key)")
    f.add_argument("--config", help="the run's config file (fedlase run's YAML): its model sets the largest "
                   "request body let through (default: the bound for any model, one Flower array chunk)")
    f.add_argument("--max-body", type=int, metavar="BYTES", help="the largest request body, instead of --config's")
    s = sub.add_parser("sidecar", help="on a node's machine: what its SuperNode connects to")
    s.add_argument("--listen", required=True, help="loopback host:port for the SuperNode, e.g. 127.0.0.1:9444")
    s.add_argument("--proxy", required=True, help="the front proxy's name:port (as in its certificate)")
    s.add_argument("--cert", required=True, help="this node's client certificate (node-<i>.crt)")
    s.add_argument("--key", required=True, help="its private key (node-<i>.tls.key)")
    for p in (f, s):
        p.add_argument("--ca", required=True, help="the federation's CA certificate (ca.crt)")
        p.add_argument("--workdir", required=True, help="folder for nginx.conf, pid, logs and temp files")
    a = ap.parse_args(argv)
    work = Path(a.workdir).resolve()
    files = [Path(x).resolve() for x in (a.ca, a.cert, a.key)]
    try:
        for p in files:
            if not os.access(p, os.R_OK):
                raise UserError(f"cannot read {p}")
        if a.role == "front":
            limit = a.max_body
            if limit is None and a.config:
                from ..catalog import load_builtins
                from ..config import load_config
                load_builtins()
                limit = body_limit(load_config(a.config))
            config = front_config(work, a.listen, a.superlink, *files, max_body=limit)
        else:
            work.mkdir(parents=True, exist_ok=True)
            root = sidecar_files(work)
            config = sidecar_config(work, a.listen, a.proxy, *files)
            print(f"sidecar: start the SuperNode with --superlink {a.listen} --root-certificates {root}",
                  file=sys.stderr, flush=True)
        cmd = nginx_command(work, config)
    except UserError as e:
        print(f"fedlase.flower.proxy: error: {e}", file=sys.stderr)
        return 2
    os.execv(cmd[0], cmd)   # nginx replaces this process: stopping it stops the proxy


if __name__ == "__main__":
    sys.exit(main())
