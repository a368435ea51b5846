"""fedlase: system-heterogeneous federated learning by submodel extraction.

The Python API (docs/library.md): `make_config`, `run`, `read_summary`, `read_metrics`, and `register_method`,
`register_dataset`, `register_model`, `register_rule` with the base classes `Method`/`ThresholdMethod`, `Rule`
and `Submodel`.
`fedlase.ConfigError`, `fedlase.UserError` and the module `fedlase.errors` are there after `import fedlase`.
Everything else is loaded on first use: `import fedlase` imports no torch. It sets OMP_WAIT_POLICY=PASSIVE unless
the user set it, so torch's idle OpenMP threads sleep instead of spinning (fedlase.openmp.passive_openmp): that
takes effect when fedlase is imported before torch; `fedlase.run` warns once when it could not (fedlase/openmp.py)."""
__version__ = "0.1.0"

from . import errors  # noqa: E402  (light: the one module a caller needs to catch fedlase's errors)
from .errors import ConfigError, DataError, UserError  # noqa: E402
from .openmp import passive_openmp_on_import  # noqa: E402  (os and sys only: fedlase/openmp.py says why)

passive_openmp_on_import()   # before torch loads its OpenMP, where the program has not imported torch already

_API = {
    "make_config": "api", "run": "api", "read_summary": "api", "read_metrics": "api",
    "register_method": "registry", "register_dataset": "registry", "register_model": "registry",
    "register_partition": "registry", "register_rule": "registry", "register_attack": "registry",
    "Rule": "server_step", "Attack": "server_step", "load_builtins": "catalog", "Method": "methods.base",
    "ThresholdMethod": "methods.base",
    "Option": "options", "Submodel": "masks", "Dataset": "data.sources", "Config": "config",
}
__all__ = sorted([*_API, "ConfigError", "DataError", "UserError", "errors"])


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'fedlase' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"fedlase.{_API[name]}"), name)
