"""Tools beside the library, run from a checkout: `python -m tools.bench` (where a run's time and memory go)
and the loopback Flower federation harness (`tools/flower_local.py`). They use fedlase's public API only."""
