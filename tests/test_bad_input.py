"""Bad input, generated from the options themselves: for every config key, every `method_args.*` option of
every registered method and every `analysis.*` option, bad values are derived from what the option declares
(its type, range, choices; empty; non-finite), and `fedlase run` must exit 2 with exactly one line on stderr
that names the key, and no traceback. A new option is covered without anyone writing a test for it.

The cases go through the real command line, `fedlase.cli.main`, in this process (the whole file takes
seconds); a few of them also in real subprocesses, which is what a user runs."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import yaml

from fedlase.cli import main
from fedlase.config import options
from fedlase.options import Option
from fedlase.registry import METHODS, TRACKERS

# A base run that is valid and tiny: if a bad value were accepted, the run would start (and the test fail).
BASE = {"dataset": "digits", "model": "cnn", "width": 0.25, "system": "{1,1/4}_{2,2}", "participation": 0.5,
        "local_steps": 1, "batch_size": 16, "rounds": 1, "threads": 1, "device": "cpu"}
EMPTY = object()   # the value `key=` on the command line


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
    return out


def _id(case) -> str:
    key, value, extra = case
    shown = "EMPTY" if value is EMPTY else repr(value)
    return f"{key}={shown}" + (f"[{extra['method']}]" if "method" in extra else "")


def _argv(tmp_path, key: str, value, extra: dict) -> list[str]:
    """`run FILE [key=]`: the base and the bad value in a YAML file (so every type can be written), or the
    empty value as an override."""
    raw = {**BASE, **extra, "out": str(tmp_path / "run")}
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
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return ["run", str(path), *override, "--quiet"]


CASES = cases()


def test_every_option_has_cases():
    keys = {k for k, _, _ in CASES}
    assert set(options()) <= keys
    assert all(f"method_args.{k}" in keys for cls in METHODS._entries.values() for k in cls.options)
    assert len(CASES) > 200


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
SUBPROCESS = [["coverage="], ["lr=nan"], ["method_args.ste=maybe"]]


@pytest.mark.parametrize("override", SUBPROCESS, ids=[o[0] for o in SUBPROCESS])
def test_a_bad_value_exits_2_in_a_real_process(override, tmp_path):
    argv = [f"{k}={v}" for k, v in BASE.items()] + [f"out={tmp_path / 'run'}", *override]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "fedlase", "run", *argv, "--quiet"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert override[0].split("=")[0].split(".")[-1] in proc.stderr
