"""Credentials of a Flower deployment: making them, and reading which node may serve which partition.

- Checked elsewhere: the config's `check_deployment` (fedlase/deploy_config.py, low in the import graph; `validate`
  calls it) checks only the files a config names: tls_ca, tls_cert and tls_key readable PEM files, tls_cert and
  tls_key together and with tls_ca, node_keys a readable folder, and none of them with `insecure=true`. That
  `engine=flower-deploy` has tls_ca and node_keys unless `insecure=true` is checked where a run is submitted
  (`require_tls`, fedlase/flower/launch.py): the apps on other machines get the config without those paths.
- `make_credentials(folder, hosts, nodes)`: a CA, a certificate for the SuperLink's host signed by it (valid
  for `hosts`; the TLS proxy in front of the SuperLink and the SuperLink itself serve it), and for each
  SuperNode a key pair (Flower's node authentication) and a client certificate with its key (the node's
  sidecar presents it to the proxy: mutual TLS). `python -m fedlase.flower.security FOLDER --host NAME
  --nodes N` runs it once, on a trusted machine; docs/flower.md says which file goes where.
- `partition_keys(folder, n)`: which node key serves which partition (the public key node-<i>.key.pub serves
  partition i), as SHA-256 fingerprints; the ServerApp refuses any other node for that partition.
- `check_node_keys(folder, partitions)`: every partition's key pair and client certificate can be read (for the
  loopback deployment script, which plays every node).

Flower 1.42 serves the Fleet, Control and Runtime APIs of a SuperLink on one HTTPS port and verifies no client
certificate, so the SuperLink listens on loopback only and nginx in front forwards the Fleet API alone to
nodes holding a client certificate of this CA (fedlase/flower/proxy.py). With `--enable-supernode-auth` only
nodes whose public key was registered (`flwr supernode register KEY.pub`) may activate, each signing its
requests with its private key (`--auth-supernode-private-key`, an EC key in OpenSSH format)."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, UserError

log = logging.getLogger("fedlase")

INSECURE_WARNING = ("insecure=true: the SuperLink is reached without TLS and any machine that can reach it may "
                    "join as a node, read the global model and send updates; use it on loopback or a trusted "
                    "network only")

# File names inside a credentials folder (make_credentials writes them, the deployment script reads them).
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "superlink.crt", "superlink.key"


def node_key(folder: Path | str, partition: int) -> Path:
    """The private key of the SuperNode for `partition` in a credentials folder (its public key: + .pub)."""
    return Path(folder) / f"node-{partition}.key"


def node_cert(folder: Path | str, partition: int) -> tuple[Path, Path]:
    """The client certificate of partition `partition`'s node and its private key (for the node's sidecar)."""
    return Path(folder) / f"node-{partition}.crt", Path(folder) / f"node-{partition}.tls.key"


def fingerprint(public_key: bytes) -> str:
    """'sha256:<hex>' of an EC public key, given in OpenSSH form (a .pub file) or as PEM (as Flower's
    `NodeInfo.public_key` holds it): the same key gives the same fingerprint in both forms."""
    from cryptography.hazmat.primitives import serialization
    data = public_key.strip()
    key = (serialization.load_pem_public_key(data) if data.startswith(b"-----")
           else serialization.load_ssh_public_key(data))
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def partition_keys(folder: Path | str, partitions: int) -> dict[int, str]:
    """Partition id -> fingerprint of the one node key allowed to serve it (node-<i>.key.pub serves i). Needs
    only the public keys, so the SuperLink's host never holds a node's private key."""
    out = {}
    for pid in range(partitions):
        pub = Path(f"{node_key(folder, pid)}.pub")
        try:
            out[pid] = fingerprint(pub.read_bytes())
        except OSError as e:
            raise ConfigError("node_keys", f"cannot read {str(pub)!r}: {e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError("node_keys", f"{str(pub)!r} is not an OpenSSH public key: {e}") from None
    return out


def check_node_keys(folder: Path | str, partitions: range) -> None:
    """Each partition has a readable key pair and client certificate in the node_keys folder (for the loopback
    deployment script, which plays every node)."""
    for pid in partitions:
        for p in (node_key(folder, pid), node_key(folder, pid).with_suffix(".key.pub"), *node_cert(folder, pid)):
            try:
                p.read_bytes()
            except OSError as e:
                raise ConfigError("node_keys", f"cannot read {str(p)!r}: {e.strerror or e}") from None


# ---- making credentials -----------------------------------------------------------------------------------------
@dataclass
class Credentials:
    folder: Path
    ca: Path
    cert: Path
    key: Path
    nodes: list[Path]        # private keys; public ones beside them (+ ".pub"), client certificates too

    def client_cert(self, partition: int) -> tuple[Path, Path]:
        return node_cert(self.folder, partition)


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write `path` whole or not at all, never through a symlink and with exactly its mode (0600 private, 0644
    public) whatever the file there had: the bytes go into a new file of this folder (O_EXCL: never an
    existing file or link), which then replaces the name (a link at `path` is replaced, its target untouched)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if private else 0o644
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)   # the umask may have taken bits away; a public file needs its 0644
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def existing(folder: Path | str, nodes: int) -> list[Path]:
    """The files of a credentials folder for `nodes` nodes that are already there (links included, even a
    dangling one): make_credentials replaces none of them unless asked."""
    folder = Path(folder)
    names = [CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY]
    for i in range(nodes):
        names += [node_key(folder, i).name, f"{node_key(folder, i).name}.pub", *(p.name for p in node_cert(folder, i))]
    return [folder / n for n in names if os.path.lexists(folder / n)]


def make_node_key(path: Path, comment: str = "") -> None:
    """An EC P-384 key pair for SuperNode authentication: `path` (OpenSSH private key) and `path`.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP384R1())
    _write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), private=True)
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    _write(Path(f"{path}.pub"), pub + (f" {comment}".encode() if comment else b"") + b"\n", private=False)


def make_credentials(folder: Path | str, hosts: list[str] = ("127.0.0.1", "localhost"), nodes: int = 0,
                     days: int = 365, force: bool = False) -> Credentials:
    """Write a CA (ca.crt, ca.key), a SuperLink certificate for `hosts` (superlink.crt, superlink.key; IP
    addresses and DNS names) signed by it, and for each of `nodes` SuperNodes a key pair (node-<i>.key,
    node-<i>.key.pub) and a client certificate with its key (node-<i>.crt, node-<i>.tls.key). Private keys
    are 0600, and no file is written through a symlink (`_write`). If any of these files exists, nothing is
    written (UserError) unless `force`: a federation's keys are never replaced by accident."""
    there = existing(folder, nodes)
    if there and not force:
        raise UserError(f"{there[0]} exists ({len(there)} of the credentials' files are there); nothing was "
                        "written: pass --force (force=True) to replace them")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlase federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA384()))

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv = (x509.CertificateBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
           .issuer_name(ca_name).public_key(srv_key.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
           .add_extension(x509.SubjectAlternativeName(names), critical=False)
           .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
           .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
           .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
           .sign(ca_key, hashes.SHA384()))

    creds = Credentials(folder, folder / CA_CERT, folder / SERVER_CERT, folder / SERVER_KEY,
                        [node_key(folder, i) for i in range(nodes)])
    _write(creds.ca, ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(folder / CA_KEY, pem_key(ca_key), private=True)
    _write(creds.cert, srv.public_bytes(serialization.Encoding.PEM), private=False)
    _write(creds.key, pem_key(srv_key), private=True)
    for i, path in enumerate(creds.nodes):
        make_node_key(path, comment=f"fedlase-node-{i}")
        # The node's client certificate: what its sidecar shows the proxy (clientAuth only, so it cannot
        # pose as the SuperLink).
        key = ec.generate_private_key(ec.SECP384R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fedlase-node-{i}")]))
                .issuer_name(ca_name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA384()))
        crt, crt_key = node_cert(folder, i)
        _write(crt, cert.public_bytes(serialization.Encoding.PEM), private=False)
        _write(crt_key, pem_key(key), private=True)
    return creds


def self_signed(cert_path: Path, key_path: Path, host: str = "127.0.0.1", days: int = 30) -> None:
    """A certificate for `host` that is its own trust anchor: a node's sidecar serves it on loopback and the
    node's SuperNode trusts exactly it (Flower's SuperNode speaks only TLS when it authenticates)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fedlase sidecar {host}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA384()))
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()), private=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedlase.flower.security",
                                 description="Make the credentials of a Flower federation: a CA, the SuperLink's "
                                             "certificate, and per SuperNode a key pair and a client "
                                             "certificate.")
    ap.add_argument("folder", help="where to write them (created; existing credentials are kept unless --force)")
    ap.add_argument("--force", action="store_true", help="replace credentials already in the folder (a symlink "
                    "is replaced by a new file, its target left alone)")
    ap.add_argument("--host", action="append", default=[],
                    help="a name or IP address the nodes use to reach the SuperLink (repeatable; "
                         "127.0.0.1 and localhost are always added)")
    ap.add_argument("--nodes", type=int, default=0,
                    help="how many SuperNodes: node-<i>.key(.pub) and node-<i>.crt/.tls.key serve partition i")
    ap.add_argument("--days", type=int, default=365, help="validity of the certificates in days")
    a = ap.parse_args(argv)
    hosts = list(dict.fromkeys([*a.host, "127.0.0.1", "localhost"]))
    try:
        c = make_credentials(a.folder, hosts, a.nodes, a.days, force=a.force)
    except (UserError, OSError) as e:
        print(f"python -m fedlase.flower.security: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {c.ca} (every machine), {c.cert} and {c.key} (the SuperLink's host only), "
          f"{c.folder / CA_KEY} (keep offline), and for each of {a.nodes} nodes node-<i>.key, node-<i>.crt, "
          f"node-<i>.tls.key (node i only) and node-<i>.key.pub (node i and the SuperLink's host) in {c.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
