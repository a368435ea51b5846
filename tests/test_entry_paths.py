"""An invalid Config cannot run by any path (issue 56, item 1): a Config that `validate` did not make (built with
`Config(...)`, or changed with `dataclasses.replace`) is checked where every run starts (fedlase.config.checked),
so each entry path refuses it in one line before anything trains or any run folder is written. The invalid
config of each test is the one the issue reproduced: dp under schedule=fedbuff."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fedlase
from fedlase.config import Config, checked, config_from_dict
from fedlase.errors import ConfigError

DP = ["dp.clip=0.5", "dp.noise_multiplier=1"]


@pytest.fixture
def dp_fedbuff(tiny_cfg):
    """A checked dp config made invalid the way docs/library.md makes a variant: dataclasses.replace."""
    return dataclasses.replace(tiny_cfg(*DP), schedule="fedbuff")


def refused(call, out) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and "schedule" in message, message
    assert not out.exists(), "nothing may be written before the config is checked"
    return message


def test_validate_marks_its_result_and_replace_drops_the_mark(tiny_cfg):
    cfg = tiny_cfg()
    assert checked(cfg) is cfg   # a validated config is not checked twice
    variant = dataclasses.replace(cfg, lr=0.1)
    again = checked(variant)
    assert again is not variant and again.lr == 0.1 and checked(again) is again
    assert "_fedlase_validated" not in cfg.to_dict()   # the mark is no setting: it is never written or sent


def test_api_run_refuses_a_replaced_config(dp_fedbuff):
    refused(lambda: fedlase.run(dp_fedbuff), Path(dp_fedbuff.out))


def test_api_run_refuses_a_bare_config(tmp_path):
    out = tmp_path / "bare"
    bare = Config(dataset="digits", system="{1,1/4}_{2,2}", rounds=1, threads=1, out=str(out), schedule="fedbuff",
                  dp={"clip": 0.5, "noise_multiplier": 1.0})
    refused(lambda: fedlase.run(bare), out)


def test_a_bare_config_that_is_valid_runs_with_its_values_coerced(tmp_path):
    out = tmp_path / "ok"
    bare = Config(dataset="digits", system="{1,1/4}_{2,2}", participation=0.5, local_steps=1, rounds="1",
                  threads=1, out=str(out), checkpoint_every=0, device="cpu")
    summary = fedlase.run(bare)
    assert summary["config"]["rounds"] == 1 and (out / "summary.json").is_file()


@pytest.mark.parametrize("variant", [{"eval_finetune": 1.0}, {"bn": "static"}, {"dp": {"clip": 0.5, "delta": 0.5,
                                                                                      "noise_multiplier": 1.0}}])
def test_the_issues_other_variants_are_refused_too(tiny_cfg, variant):
    cfg = dataclasses.replace(tiny_cfg(*DP), **variant)
    with pytest.raises(ConfigError) as e:
        fedlase.run(cfg)
    assert "\n" not in str(e.value)


def test_the_engine_refuses_it_without_dispatch(dp_fedbuff):
    from fedlase.engine import Experiment, build_parts, run_experiment
    out = Path(dp_fedbuff.out)
    refused(lambda: run_experiment(dp_fedbuff, progress=False), out)
    refused(lambda: Experiment.from_config(dp_fedbuff), out)
    refused(lambda: build_parts(dp_fedbuff), out)


def test_a_sweep_child_refuses_it(dp_fedbuff):
    """The child of `fedlase sweep --jobs N` gets the run's config as JSON on stdin and reports the first line."""
    from fedlase.sweep import _CHILD
    spec = {"name": "bad", "config": dp_fedbuff.to_dict()}
    res = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(spec), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 1, res.stderr
    error = json.loads(res.stdout.strip().splitlines()[-1])["error"]
    assert "schedule" in error and "dp" in error
    assert not Path(dp_fedbuff.out).exists()


def test_a_ray_task_refuses_it(dp_fedbuff):
    """What a Ray task of a cluster sweep runs (fedlase.sweep.run_from_dict), called here in process."""
    from fedlase.sweep import run_from_dict
    refused(lambda: run_from_dict("bad", dp_fedbuff.to_dict()), Path(dp_fedbuff.out))


def test_the_server_app_refuses_it(dp_fedbuff):
    """Flower's ServerApp reads the config the submitter wrote into its run config, and checks it before it asks the
    grid for anything."""
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from fedlase.flower.server_app import main

    class NoGrid:   # any use of the grid would mean the ServerApp started a round
        def __getattr__(self, name):
            raise AssertionError(f"the ServerApp used the grid ({name}) before checking its config")

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"fedlase-config": json.dumps(dp_fedbuff.to_dict(), default=str)})
    refused(lambda: main(NoGrid(), context), Path(dp_fedbuff.out))


def test_config_from_dict_refuses_it(dp_fedbuff):
    with pytest.raises(ConfigError):
        config_from_dict(dp_fedbuff.to_dict())


@pytest.mark.parametrize("override,key", [("robust_args.iterations=1e9", "robust_args.iterations"),
                                          ("local_steps=1e12", "local_steps"), ("rounds=1e30", "rounds")])
def test_counts_with_no_meaning_are_refused_in_one_line(tiny_cfg, override, key):
    """Issue 56, item 3: a count past its meaning (centered clipping's iterations) or a run whose local steps in
    all exceed fedlase's stated limit (fedlase.resources.MAX_LOCAL_STEPS) is refused, naming the key."""
    extra = ["robust=centered_clip"] if key.startswith("robust_args") else []
    with pytest.raises(ConfigError) as e:
        tiny_cfg(*extra, override)
    assert e.value.key == key and "\n" not in str(e.value)


def test_epochs_are_counted_in_steps_once_the_data_is_loaded(tiny_cfg):
    """digits learns its size when loaded: local_epochs is checked then, before anything trains."""
    from fedlase.engine import build_parts
    cfg = tiny_cfg("local_epochs=1e9")
    with pytest.raises(ConfigError) as e:
        build_parts(cfg)
    assert e.value.key == "local_epochs"


def test_the_work_limit_leaves_long_real_runs_alone(tiny_cfg):
    from fedlase.resources import MAX_LOCAL_STEPS
    cfg = tiny_cfg("rounds=100000", "local_steps=1000")   # 1e5 rounds x 2 clients x 1e3 steps = 2e8
    assert cfg.rounds * 2 * cfg.local_steps < MAX_LOCAL_STEPS


@pytest.mark.parametrize("settings", [
    [], ["dp.clip=0.5", "dp.noise_multiplier=1"], ["robust=centered_clip"], ["attack=scale", "attack_args.clients=[1]"],
    ["schedule=fedbuff"], ["dataset=bbc_news", "model=minilm", "lora.r=4", "method=heterofl"],
    ["dataset=bbc_news", "model=minilm", "lora.r=4", "method=hetlora"]])
def test_validation_is_idempotent(tiny_cfg, settings):
    """A validated config's dict validates again to the same config: what a sweep child, a Ray task, the ServerApp
    and `fedlase evaluate` (from the checkpoint's config) rebuild. A default that validation fills in (dp.delta,
    lora.ranks) must pass its own check."""
    if any(s.startswith(("lora", "dataset=bbc")) for s in settings):
        pytest.importorskip("peft")
    cfg = tiny_cfg(*settings)
    assert config_from_dict(cfg.to_dict()) == cfg
