"""Shared fixtures for the core tests: a tiny, fast experiment on the bundled digits data."""
import pytest

from fedlase.config import load_config

# A run that takes well under a second a round on one CPU thread: digits (8x8), a quarter-width CNN,
# 4 clients at two levels, 2 sampled per round, 2 local steps.
TINY = ["dataset=digits", "model=cnn", "width=0.25", "system={1,1/4}_{2,2}", "participation=0.5",
        "local_steps=2", "batch_size=16", "lr=0.05", "rounds=2", "eval_every=1", "threads=1",
        "checkpoint_every=1", "device=cpu"]


@pytest.fixture
def tiny_cfg(tmp_path):
    """tiny_cfg(key=value, ...) -> a validated Config of the tiny run writing into a fresh tmp folder."""
    def make(*overrides: str, out: str | None = None):
        return load_config(None, [*TINY, f"out={out or tmp_path / 'run'}", *overrides])
    return make
