"""fedlase: system-heterogeneous federated learning by submodel extraction.

The Python API (docs/library.md): `make_config`, `run`, `read_summary`, `read_metrics`, and `register_method`,
`register_dataset`, `register_model` with the base classes `Method`/`ThresholdMethod` and `Submodel`.
Names are loaded on first use, so `import fedlase` stays cheap for the CLI and for Flower's ClientApps."""
__version__ = "0.1.0"

_API = {
    "make_config": "api", "run": "api", "read_summary": "api", "read_metrics": "api",
    "register_method": "registry", "register_dataset": "registry", "register_model": "registry",
    "register_partition": "registry", "Method": "methods.base", "ThresholdMethod": "methods.base",
    "Option": "options", "Submodel": "masks", "Dataset": "data.sources", "Config": "config",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'fedlase' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"fedlase.{_API[name]}"), name)
