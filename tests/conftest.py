"""Shared fixtures and helpers for the core tests: a tiny, fast experiment on the bundled digits data, and tiny
Fashion-MNIST IDX files. Test modules import the helpers with `from conftest import ...` (pytest puts tests/
on sys.path)."""
import contextlib
import gzip
import os
import sys
from pathlib import Path

# One OpenMP thread per process of the suite, unless the caller chose: its pytest processes (two xdist workers and
# the Ray-cluster module under `make test`) and the runs they start share the cores, where intra-op threads only
# add contention (docs/benchmarks.md, "A shared CPU"); the quick tests took 11-14 % less CPU so. Set before torch
# is imported here, and inherited by every process a test starts; a test or run that sets `threads` gets those.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fedlase.catalog import load_builtins  # noqa: E402
from fedlase.config import load_config  # noqa: E402

load_builtins()   # the tests build configs directly, as a program's start-up would after registering these

# A run that takes well under a second a round on one CPU thread: digits (8x8), a quarter-width CNN,
# 4 clients at two levels, 2 sampled per round, 2 local steps.
TINY = ["dataset=digits", "model=cnn", "width=0.25", "system={1,1/4}_{2,2}", "participation=0.5",
        "local_steps=2", "batch_size=16", "lr=0.05", "rounds=2", "eval_every=1", "threads=1",
        "checkpoint_every=1", "device=cpu"]


def digits_test_size() -> int:
    """The test samples of `dataset=digits` (what TINY's global accuracies are counted over)."""
    from fedlase.data.sources import load_dataset
    return len(load_dataset("digits", None).y_test)


def counted_over(acc: float, n: int) -> bool:
    """Whether `acc` is k/n for a whole k: an accuracy counted over n predictions (as the global accuracy is over
    the test set), not a mean of per-client accuracies nor one over a part of the set."""
    return abs(acc * n - round(acc * n)) < 1e-4 * n


@contextlib.contextmanager
def host_reads():
    """Counts the tensor-to-Python reads made inside the block (float(), int(), bool(), .item(), .tolist()): on a
    GPU each is a wait for the device. Yields the list of the reads' names."""
    import torch
    reads = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("__float__", "__int__", "__index__", "__bool__", "item", "tolist"):
            real = getattr(torch.Tensor, name)
            mp.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name:
                       (reads.append(_name), _real(self, *a))[1])
        yield reads


def assert_sparse_flops_sound(costs):
    """Each level's sparse FLOPs positive, at most its dense FLOPs, and falling with the level (largest first)."""
    sparse = [c.sparse_flops for c in costs]
    assert all(0 < c.sparse_flops <= c.step_flops for c in costs), [(c.step_flops, c.sparse_flops) for c in costs]
    assert sparse == sorted(sparse, reverse=True) and sparse[0] == costs[0].step_flops


@pytest.fixture
def tiny_cfg(tmp_path):
    """tiny_cfg(key=value, ...) -> a validated Config of the tiny run writing into a fresh tmp folder."""
    def make(*overrides: str, out: str | None = None):
        return load_config(None, [*TINY, f"out={out or tmp_path / 'run'}", *overrides])
    return make


# ---- IDX files (the Fashion-MNIST format), for the loader and CLI tests --------------------------------------
FMNIST_STEMS = {"x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
                "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte"}


from fedlase.data.sources import idx_bytes  # noqa: E402  (the one IDX writer)


def write_fmnist(folder: Path, n_train: int = 12, n_test: int = 5, size: int = 6, gz: bool = True,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """The four Fashion-MNIST files, tiny: random pixels, labels 0..9 repeating. Returns {file stem: array}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        FMNIST_STEMS["x_train"]: (rng.integers(0, 256, (n_train, size, size)), 2051),
        FMNIST_STEMS["y_train"]: (np.arange(n_train) % 10, 2049),
        FMNIST_STEMS["x_test"]: (rng.integers(0, 256, (n_test, size, size)), 2051),
        FMNIST_STEMS["y_test"]: (np.arange(n_test) % 10, 2049),
    }
    for stem, (arr, magic) in data.items():
        raw = idx_bytes(arr, magic)
        if gz:
            (folder / (stem + ".gz")).write_bytes(gzip.compress(raw))
        else:
            (folder / stem).write_bytes(raw)
    return {k: v[0] for k, v in data.items()}


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: the tiny models run fastest so, and the cores are shared."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- numerics: tests that compare floats computed in different ways ------------------------------------------
# (stored results, sliced against masked, batched against sequential, an algorithm against its hand computation).
# Each such file declares it (`pytestmark = pytest.mark.numerics`, or the mark on a test); .ci/run runs them a
# second time under ATEN_CPU_CAPABILITY=default, so a bound that holds only on the CI machine's CPU features fails
# there too. `pytest -m numerics` selects them.


# ---- order: the tests that start Flower or Ray processes first -------------------------------------------------
# They are the long ones and mostly wait on their processes; begun first, two xdist workers (`make test`) finish
# them while the quick tests fill the gaps, instead of one worker ending with a 2-minute test alone. The marks are
# the files' own (`flower`, `ray`); the sort is stable, so every other test keeps its order.
# ---- integration: the multi-node deployments, in `make test-integration` --------------------------------------
# A test that stands up a federation of several nodes (a Flower deployment behind its proxy, or the two-node Ray
# cluster) is an integration test: it costs minutes of CPU in processes that mostly wait. `make test` leaves them to
# `make test-integration`; .ci/run runs both. Marked here by the fixtures that start those federations, so a new
# test on one of them is routed without a mark of its own.
FEDERATION_FIXTURES = {"dep", "faulty_run", "faults", "buffered_fed", "cluster"}


@pytest.hookimpl(tryfirst=True)   # before -m selects
def pytest_collection_modifyitems(items):
    for item in items:
        if FEDERATION_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: item.get_closest_marker("flower") is None and item.get_closest_marker("ray") is None)


# ---- groups: the tests sharing one federation run on one xdist worker ----------------------------------------
# Under `--dist loadgroup` pytest-xdist appends "@<group>" to the id of each test marked `xdist_group` and sends a
# group to one worker. With pytest 9.2 the suffix no longer took (pyproject.toml pins pytest below it), and the
# groups were split without a word: each worker started its own federation. So a worker stops at once if it sees
# a marked test without its suffix.
def pytest_collection_finish(session):
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:   # said on stderr too: pytest-xdist reports a worker's collection error as an INTERNALERROR only
        why = (f"--dist loadgroup did not tag {lost[0]} with its xdist_group (pytest {pytest.__version__}): the "
               f"groups would be split; install the pytest that pyproject.toml pins")
        print(why, file=sys.stderr)
        raise pytest.UsageError(why)
