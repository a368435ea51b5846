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

INSTALL_HINT = ("the Flower deployment needs nginx (the mutual-TLS proxy in front of the SuperLink and beside each "
                "SuperNode): apt-get install nginx (Debian/Ubuntu; `make deploy-deps` installs it)")
SIDECAR_CERT, SIDECAR_KEY = "sidecar.crt", "sidecar.key"
BODY_LIMIT = "1g"   # a message's arrays travel as objects; a large model's must pass whole


def nginx_binary() -> str:
    """The nginx executable (PATH, then /usr/sbin where Debian puts it), else a UserError saying how to install it."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if os.access(p, os.X_OK)), None)
    if found is None:
        raise UserError(INSTALL_HINT)
    return found


def fleet_routes() -> list[str]:
    """The Fleet API's paths, as Flower's own Fleet router declares them (so a Flower upgrade that adds one is
    forwarded, and nothing else is)."""
    from flwr.superlink.routers.fleet.router import router
    paths = sorted({r.path for r in router.routes})
    bad = [p for p in paths if not re.fullmatch(r"/v1/fleet/[a-z-]+", p)]
    if bad or not paths:
        raise UserError(f"unexpected Fleet API routes in this Flower version: {bad or 'none'}; "
                        "fedlase's proxy forwards only /v1/fleet/<name>")
    return paths


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    return host == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def _frame(workdir: Path, body: str) -> str:
    """One nginx process of its own: config, pid, logs and temp files in `workdir`, run by the current user."""
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    # As root, nginx would hand its workers to `nobody`; keep them the current user (never the system service).
    user = ""
    if os.geteuid() == 0:
        pw = pwd.getpwuid(os.geteuid())
        user = f"user {pw.pw_name} {grp.getgrgid(pw.pw_gid).gr_name};\n"
    temps = "\n".join(f"    {k}_temp_path {tmp / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""# Written by fedlase (fedlase/flower/proxy.py); run: nginx -p {workdir} -c {workdir / 'nginx.conf'} -e stderr
daemon off;
worker_processes 1;
pid {workdir / 'nginx.pid'};
error_log stderr warn;
{user}events {{ worker_connections 512; }}
http {{
    access_log {workdir / 'access.log'};
{temps}
    server_tokens off;
    client_max_body_size {BODY_LIMIT};
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_request_buffering off;
    proxy_buffering off;
    proxy_read_timeout 600s;
    proxy_send_timeout 600s;
{body}}}
"""


def front_config(workdir: Path, listen: str, superlink: str, ca: Path, cert: Path, key: Path) -> str:
    """nginx.conf of the front proxy: mutual TLS on `listen`, the Fleet routes (POST only) to the SuperLink's
    loopback address `superlink` (TLS, verified with the CA as `localhost`), a 404 for everything else."""
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
""")


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
""")


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
            config = front_config(work, a.listen, a.superlink, *files)
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
