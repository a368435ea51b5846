"""What a config may say of running beyond one process: a Flower deployment's TLS files and node keys, and the
Ray cluster a Flower simulation joins. Only files are read here (never flwr or ray), so validating a config stays
cheap (fedlase/config.py); the deployment itself is fedlase/flower/security.py's."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError
from .util import split_host_port


def ray_address_rule(value: str) -> str | None:
    """`ray_address`: host:port of a Ray head (as `ray start --head` prints it), or auto."""
    if value == "auto" or split_host_port(value) is not None:
        return None
    return f"expected host:port of a running Ray cluster's head, or auto; got {value!r}"


def _readable(key: str, path: str, what: str) -> Path:
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise ConfigError(key, f"cannot read the {what} {str(p)!r}: {e.strerror or e}") from None
    if b"-----BEGIN" not in head:
        raise ConfigError(key, f"{str(p)!r} is not a PEM file (the {what})")
    return p


def check_deployment(cfg, submitter_keys) -> None:
    """Check the Flower security keys and the Ray keys of a config; raise ConfigError(key, one line) on the first
    problem. `submitter_keys`: the files a submitter names (the config keys tagged "submitter")."""
    if cfg.tls_ca is not None:
        _readable("tls_ca", cfg.tls_ca, "CA certificate")
    if cfg.tls_cert is not None:
        _readable("tls_cert", cfg.tls_cert, "SuperLink certificate")
    if cfg.tls_key is not None:
        _readable("tls_key", cfg.tls_key, "SuperLink private key")
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        missing = "tls_key" if cfg.tls_key is None else "tls_cert"
        raise ConfigError(missing, "tls_cert and tls_key go together (the SuperLink's certificate and its key)")
    if cfg.tls_cert is not None and cfg.tls_ca is None:
        raise ConfigError("tls_ca", "needed with tls_cert: the CA certificate that signed it")
    if cfg.node_keys is not None:
        folder = Path(cfg.node_keys).expanduser()
        if not folder.is_dir():
            raise ConfigError("node_keys", f"folder {str(folder)!r} does not exist")
        if not os.access(folder, os.R_OK | os.X_OK):
            raise ConfigError("node_keys", f"folder {str(folder)!r} cannot be read")
    if cfg.insecure and any(getattr(cfg, k) is not None for k in submitter_keys):
        raise ConfigError("insecure", "insecure=true turns TLS and node authentication off; drop it or the "
                                      "tls_*/node_keys files")
    if cfg.ray_address is not None and cfg.engine != "flower-sim":
        raise ConfigError("ray_address", f"joins a Ray cluster for engine=flower-sim, got engine={cfg.engine} "
                          "(a sweep's runs go to a cluster with `fedlase sweep --ray`)")
    if cfg.ray_address is not None and cfg.sim_actors is not None:
        raise ConfigError("sim_actors", "sizes the run's private Ray; with ray_address the cluster's CPUs decide "
                          "how many clients train at once")
