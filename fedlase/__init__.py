"""fedlase: system-heterogeneous federated learning by submodel extraction."""
__version__ = "0.1.0"
