"""Bad input, generated from the options themselves: for every config key, every `method_args.*` option of
every registered method and every `analysis.*` option, bad values are derived from what the option declares
(its type, range, choices; empty; non-finite), and `fedlase run` must exit 2 with exactly one line on stderr
that names the key, and no traceback. A new option is covered without anyone writing a test for it.

Bounds a type and a range cannot say are derived from declarations too: an option checked against the CPUs
(`threads_rule`, `sim_actors_rule`) gets counts beyond them; a folder a run writes (`writable_folder`) gets
/proc, /sys and a path under a file; every method gets every runner (engine, batched_clients) its `runs_on`
leaves out; and the data's size bounds `batch_size` and the client count.

The cases go through the real command line, `fedlase.cli.main`, in this process (the whole file takes
seconds); a few of them also in real subprocesses, which is what a user runs."""
from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from fedlase.cli import main
from fedlase.config import ENGINES, load_config, options
from fedlase.errors import ConfigError
from fedlase.machine import sim_actors_rule, threads_rule, usable_cpus, writable_folder
from fedlase.methods.base import TRAIN_PATHS
from fedlase.options import Option
from fedlase.registry import METHODS, TRACKERS
from fedlase.robust_config import DP

# A base run that is valid and tiny: if a bad value were accepted, the run would start (and the test fail).
BASE = {"dataset": "digits", "model": "cnn", "width": 0.25, "system": "{1,1/4}_{2,2}", "participation": 0.5,
        "local_steps": 1, "batch_size": 16, "rounds": 1, "threads": 1, "device": "cpu"}
EMPTY = object()   # the value `key=` on the command line
UNDER_A_FILE = object()   # a folder below an existing file (the run's config file, see _argv)
# the setting that puts a run on each of TRAIN_PATHS (a method's `runs_on` names them)
TRAIN_PATH_SETTINGS = {"embedded": ("engine", "embedded"), "batched": ("batched_clients", True),
                   "flower-sim": ("engine", "flower-sim"), "flower-deploy": ("engine", "flower-deploy")}


def bad_values(opt: Option) -> list:
    """Values the option's declaration rules out: wrong type, out of range, not a choice, empty, non-finite."""
    t, out = opt.type, [EMPTY]
    if t in (int, float):
        out += ["abc", [1]]
    if t is int:
        out.append(1.5)
    if t is float:
        out += [math.nan, math.inf, -math.inf]
    if t is bool:
        out += ["maybe", [True]]
    if t is str:
        out += [[1, 2], {"a": 1}, " "]
    if t in (list, dict):
        out += ["abc" if t is list else [1], 5]
    if opt.low is not None:
        out.append(opt.low if opt.low_open else opt.low - (1 if t is int else 0.5))
    if opt.high is not None:
        out.append(opt.high if opt.high_open else opt.high + (1 if t is int else 0.5))
    allowed = opt.allowed()
    if allowed and t is str:
        out.append("no_such_choice")
    if opt.check in (threads_rule, sim_actors_rule):   # a count of CPUs: beyond those this process may use
        out += [usable_cpus() + 1, 100_000]
    if opt.check is writable_folder:   # a folder a run writes into
        out += ["/proc/x", "/sys/fedlase", UNDER_A_FILE]
    return out


def cases() -> list[tuple[str, object, dict]]:
    """(dotted key, bad value, other settings the key needs) for every declared option."""
    out = []
    for key, opt in options().items():
        out += [(key, v, {}) for v in bad_values(opt)]
    for name, cls in METHODS.items():
        out.append((f"method_args.{name}_no_such_option", 1, {"method": name}))
        for key, opt in cls.options.items():
            out += [(f"method_args.{key}", v, {"method": name}) for v in bad_values(opt)]
    for name, cls in TRACKERS.items():
        out.append((f"analysis.{name}", 5, {}))   # an analysis is true, false or its options (a list, a text)
        for key, opt in cls.options_spec.items():
            out += [(f"analysis.{name}.{key}", v, {}) for v in bad_values(opt)]
    for name, cls in METHODS.items():   # a runner the method does not declare: refused at validation
        out += [(*TRAIN_PATH_SETTINGS[r], {"method": name}) for r in TRAIN_PATHS if r not in cls.runs_on]
        if cls.models is not None:   # a model the method does not declare (BASE's cnn): refused at validation
            out.append(("model", "cnn", {"method": name}))
        if not cls.clocked:   # simulated time for a method the clock cannot charge
            out.append(("deadline", 10, {"method": name}))
    out += [("batch_size", 10**6, {}), ("system", "{1}_{100000}", {})]   # beyond the data (known once loaded)
    for key, opt in DP.items():   # dp.* (fedlase/robust_config.py), beside a valid clip and noise
        out += [(f"dp.{key}", v, {"dp": {"clip": 1.0, "noise_multiplier": 1.0}}) for v in bad_values(opt)]
    dp_on = {"dp": {"clip": 1.0, "noise_multiplier": 1.0}}
    out += [("robust", rule, dp_on) for rule in ("median", "trimmed_mean", "multikrum", "adaptive_clip")]
    out.append(("sim_actors", 1, {"engine": "flower-sim", "ray_address": "127.0.0.1:1"}))   # the cluster decides
    return out


def _id(case) -> str:
    key, value, extra = case
    shown = "EMPTY" if value is EMPTY else "UNDER_A_FILE" if value is UNDER_A_FILE else repr(value)
    return f"{key}={shown}" + (f"[{extra['method']}]" if "method" in extra else "")


def _argv(tmp_path, key: str, value, extra: dict) -> list[str]:
    """`run FILE [key=]`: the base and the bad value in a YAML file (so every type can be written), or the
    empty value as an override."""
    raw = {**BASE, **copy.deepcopy(extra), "out": str(tmp_path / "run")}
    path = tmp_path / "bad.yaml"
    if value is UNDER_A_FILE:
        value = str(path / "x")
    override = []
    if value is EMPTY:
        override = [f"{key}="]
    else:
        head, _, rest = key.partition(".")
        if rest:   # a nested option: method_args.x, analysis.name.x
            node = raw.setdefault(head, {})
            *mid, last = rest.split(".")
            for part in mid:
                node = node.setdefault(part, {})
            node[last] = value
        else:
            raw[key] = value
    path.write_text(yaml.safe_dump(raw))
    return ["run", str(path), *override, "--quiet"]


CASES = cases()


def test_every_option_has_cases():
    keys = {k for k, _, _ in CASES}
    assert set(options()) <= keys
    assert all(f"method_args.{k}" in keys for _, cls in METHODS.items() for k in cls.options)
    assert len(CASES) > 200


def test_the_bounds_are_declared_where_they_apply():
    """The declarations the generated cases read: threads against the CPUs, every folder a run writes, and a
    setting for every runner a method may declare."""
    assert options()["threads"].check is threads_rule and options()["sim_actors"].check is sim_actors_rule
    assert options()["out"].check is writable_folder
    assert TRACKERS.get("tensorboard").options_spec["dir"].check is writable_folder
    assert set(TRAIN_PATH_SETTINGS) == set(TRAIN_PATHS)
    assert all(cls.runs_on and set(cls.runs_on) <= set(TRAIN_PATHS) for _, cls in METHODS.items())


# the adapter methods train LoRA on a text model, with no objective of their own (tests/test_lora.py)
@pytest.mark.parametrize("name", [n for n in METHODS.names() if not METHODS.get(n).adapters])
def test_a_method_declares_where_it_runs_and_why_not_elsewhere(name, tmp_path):
    """The vmapped step cannot run a method's own LocalObjective: a method whose submodels carry one must leave
    `batched` out of its `runs_on` (else it would be refused only at run time); one that leaves out an engine
    says why (`confined`), and the refusal names it; every runner it declares passes validation."""
    from fedlase.engine import Experiment
    cls = METHODS.get(name)
    models = cls.models   # a method that runs on some models only: the first of them
    argv = [f"{k}={v}" for k, v in BASE.items()] + [f"method={name}", f"out={tmp_path / 'run'}"] + \
        ([f"model={models[0]}"] if models else [])
    exp = Experiment.from_config(load_config(None, argv))
    local = any(exp.method.submodel(exp.state.params, lvl, 1).local is not None for lvl in exp.levels)
    if local:
        assert "batched" not in cls.runs_on, cls.runs_on
    for runner in cls.runs_on:
        key, value = TRAIN_PATH_SETTINGS[runner]
        load_config(None, [*argv, f"{key}={str(value).lower()}"])
    for engine in [e for e in ENGINES if e not in cls.runs_on]:
        assert cls.confined, name
        with pytest.raises(ConfigError, match=f"^engine: method {name} runs on .*{re.escape(cls.confined)}") as err:
            load_config(None, [*argv, f"engine={engine}"])
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_a_bad_value_exits_2_with_one_line(case, tmp_path, capsys):
    key, value, extra = case
    rc = main(_argv(tmp_path, key, value, extra))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out[-500:], err[-500:])
    assert len(lines) == 1 and lines[0].startswith("fedlase: error: "), err
    assert "Traceback" not in err
    # the line names the key (a nested option's owner at least: analysis.ratios, method_args.x)
    assert key.rsplit(".", 1)[0] in lines[0] if key.startswith("analysis.") else key.split(".")[-1] in lines[0], \
        lines[0]
    assert not (tmp_path / "run").exists()   # nothing started


# A few cases in real processes: the exit status, stderr and no traceback as a shell sees them.
SUBPROCESS = [["coverage="], ["lr=nan"], ["method_args.ste=maybe"], ["threads=100000"],
              ["analysis.tensorboard=/proc/x"], ["method=pfedlmt", "engine=flower-sim"]]


@pytest.mark.parametrize("override", SUBPROCESS, ids=[o[0] for o in SUBPROCESS])
def test_a_bad_value_exits_2_in_a_real_process(override, tmp_path):
    argv = [f"{k}={v}" for k, v in BASE.items()] + [f"out={tmp_path / 'run'}", *override]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "fedlase", "run", *argv, "--quiet"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    named = override[-1].split("=")[0]
    assert (named if named.startswith("analysis.") else named.split(".")[-1]) in proc.stderr
    assert not (tmp_path / "run").exists()   # refused at validation: nothing (no Flower process) started
