"""A researcher's first hour with fedlase (issue 57): settings and flags in any order, plug-ins kept in the working
folder, a custom attack that declares only its own options, YAML errors that name their line, the passive OpenMP
wait for library runs, and the smaller things: whole method descriptions, the cost table's legend, the settings
`fedlase evaluate` takes, a data_dir a dataset ignores, a float64 user dataset."""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fedlase
from conftest import TINY
from fedlase.cli import main
from fedlase.config import config_from_dict, load_config, tagged
from fedlase.errors import ConfigError
from fedlase.registry import ATTACKS, DATASETS, METHODS, temporary

ROOT = Path(__file__).resolve().parents[1]
SMALL = [s for s in TINY if not s.startswith(("rounds=", "threads="))]   # the tests below set those themselves


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err) -> str:
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedlase: error: "), err
    return lines[0]


# ---- 1. settings and flags in any order ------------------------------------------------------------------------
def test_settings_may_follow_flags_in_run_evaluate_and_cost(capsys, tmp_path):
    out = tmp_path / "run"
    # the command (`fedlase run dataset=digits rounds=1 out=DIR --quiet --resume threads=1`), made tiny by
    # settings that follow the flags too
    rc, stdout, err = cli(capsys, "run", "dataset=digits", "rounds=1", f"out={out}", "--quiet", "--resume",
                          "threads=1", *SMALL)
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["config"]["threads"] == 1
    rc, stdout, err = cli(capsys, "evaluate", str(out), "--json", str(tmp_path / "e.json"), "eval_order=clients")
    assert rc == 0, err
    assert "eval_order=clients" in stdout and (tmp_path / "e.json").is_file()
    rc, stdout, err = cli(capsys, "cost", *SMALL, "--no-memory", "threads=1")
    assert rc == 0, err
    assert "| 1/4 |" in stdout


def test_a_config_file_may_come_after_settings_and_flags(capsys, tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("rounds: 1\n")
    rc, _, err = cli(capsys, "run", "--quiet", "threads=1", str(cfg), *SMALL, f"out={tmp_path / 'r'}")
    assert rc == 0, err
    rc, _, err = cli(capsys, "run", str(cfg), "--quiet", str(cfg))
    assert "one config file" in one_line_error(rc, err)


@pytest.mark.parametrize("argv, meant", [
    (["run", "dataset=digits", "--rounds", "5"], "rounds=5"),
    (["run", "dataset=digits", "--rounds=5"], "rounds=5"),
    (["run", "--method-args.score", "max"], "method_args.score=max"),   # argparse took `max` for the file
    (["run", "--rounds"], "rounds=VALUE"),
    (["cost", "--lr", "0.1"], "lr=0.1"),
    (["evaluate", "runs/x", "--eval_order", "clients"], "eval_order=clients"),
])
def test_a_config_key_written_as_a_flag_is_answered_with_the_setting(capsys, argv, meant):
    rc, _, err = cli(capsys, *argv)
    assert one_line_error(rc, err).endswith(f"write {meant}")


def test_an_unknown_flag_is_still_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "dataset=digits", "--no-such-flag"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


# ---- 3. plug-ins in the working folder -------------------------------------------------------------------------
PLUGIN = textwrap.dedent('''
    import fedlase


    @fedlase.register_method
    class Whole(fedlase.Method):
        """whole_model: every level trains the whole model. A plug-in kept beside the configs."""
        name = "whole_model"

        def submodel(self, params, level, round):
            return fedlase.Submodel({})
''')


def fedlase_in(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -P -m fedlase ARGV` run in `folder`: -P keeps the working folder off Python's path, as the installed
    `fedlase` script does (only the worktree's package is on PYTHONPATH)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != "."]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *path]), "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-P", "-m", "fedlase", *argv], cwd=folder, capture_output=True,
                          text=True, env=env, timeout=300)


def test_a_plugin_in_the_working_folder_is_run_and_listed(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir(mode=0o755)
    (folder / "my_methods.py").write_text(PLUGIN)
    res = fedlase_in(folder, "methods", "plugins=[my_methods]")
    assert res.returncode == 0, res.stderr
    assert "whole_model: whole_model: every level trains the whole model." in res.stdout
    assert "fiarse:" in res.stdout   # the built-ins beside it
    res = fedlase_in(folder, "methods", "--plugins", "my_methods")
    assert res.returncode == 0 and "whole_model:" in res.stdout, res.stderr
    res = fedlase_in(folder, "run", "method=whole_model", "plugins=[my_methods]", *SMALL, "rounds=1", "threads=1",
                     "out=run", "--quiet")
    assert res.returncode == 0, res.stderr
    assert json.loads((folder / "run" / "summary.json").read_text())["config"]["method"] == "whole_model"


def test_a_missing_or_unsafe_plugin_is_one_line(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "work"
    folder.mkdir(mode=0o755)
    monkeypatch.chdir(folder)   # in this process: the folder is not on Python's path (pytest put the checkout there)
    line = one_line_error(*cli(capsys, "methods", "plugins=[my_methods]")[::2])
    assert str(folder) in line and "PYTHONPATH" in line
    (folder / "json.py").write_text(PLUGIN)   # named like Python's own module, which would win
    line = one_line_error(*cli(capsys, "run", "plugins=[json]", *SMALL)[::2])
    assert "named like Python's module json" in line
    (folder / "my_methods.py").write_text(PLUGIN)
    folder.chmod(0o777)   # other users may write it: no plug-in is imported from it
    try:
        line = one_line_error(*cli(capsys, "methods", "plugins=[my_methods]")[::2])
    finally:
        folder.chmod(0o755)
    assert "may be written by other users" in line and "my_methods" not in sys.modules
    line = one_line_error(*cli(capsys, "methods", "rounds=3")[::2])
    assert "takes only plugins" in line


# ---- 4. a custom attack ----------------------------------------------------------------------------------------
def library_block(marker: str) -> str:
    """The Python code block of docs/library.md that holds `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "library.md").read_text(), re.S)
    [block] = [b for b in blocks if marker in b]
    return block


def test_the_documented_custom_attack_runs_as_written(tmp_path, monkeypatch, capsys):
    code = library_block("register_attack")
    monkeypatch.chdir(tmp_path)
    with temporary():
        exec(compile(code, "docs/library.md", "exec"), {})
        attack = ATTACKS.get("free_rider")
        assert set(attack.options) == {"keep"}   # who attacks comes from fedlase.Attack
        assert {"fraction", "level", "clients", "keep"} <= set(attack.all_options())
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    summary = fedlase.read_summary(tmp_path / "runs" / "lib-attack")
    assert summary["final"]["global_acc"] == pytest.approx(printed)
    assert summary["config"]["attack_args"] == {"level": "1/4", "fraction": 0.5}
    # its attackers sent nothing learned: the screen counted their updates as near zero
    totals = fedlase.read_metrics(tmp_path / "runs" / "lib-attack")[-1]["robust_totals"]
    assert sum(totals["near_zero"].values()) > 0 and set(totals["near_zero"]) == {"1/4"}


def test_an_attacker_named_twice_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match=r"attack_args.clients: names client 0 more than once"):
        tiny_cfg("attack=scale", "attack_args.clients=[0,0,1]")
    with pytest.raises(ConfigError, match="attack_args.fraction: unknown option for attack=none"):
        tiny_cfg("attack_args.fraction=0.5")   # `none` attacks no one


# ---- 5. YAML errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, where, hint", [
    ("dataset: digits\nsystem: {1,1/4}_{4,4}\nrounds: 5\n", "line 2, column 16",
     "quote it, system: '{1,1/4}_{4,4}'"),
    ("dataset: digits\n  rounds: 5\n", "line 2, column 9", "check that line's indent"),
    ("dataset: digits\nmethod_args: {score: max\n", "line 3, column 1", "the { of line 2 is never closed"),
])
def test_a_yaml_error_names_its_line_and_how_to_fix_it(capsys, tmp_path, text, where, hint):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = one_line_error(*cli(capsys, "run", str(path))[::2])
    assert line.startswith(f"fedlase: error: config: {path}, {where}: not valid YAML: "), line
    assert hint in line


def test_an_unquoted_braced_value_that_is_valid_yaml_gets_the_hint(tmp_path):
    path = tmp_path / "set.yaml"
    path.write_text("dataset: digits\nsystem: {1,1/4}   # levels, no counts\n")
    with pytest.raises(ConfigError, match=r"system: .*quote it: system: '\{1,1/4\}'$"):
        load_config(str(path))
    # every path a YAML value reaches a config by (a sweep file's run, the API given what yaml read) gets it too
    with pytest.raises(ConfigError, match=r"system: .*quote it: system: '\{1,1/4\}'$"):
        config_from_dict({"dataset": "digits", "system": {1: None, "1/4": None}})


def test_a_sweep_files_yaml_error_names_its_line(capsys, tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("base:\n  dataset: digits\ngrid:\n  system: {1}_{4}, {1,1/4}_{2,2}\n")
    rc, _, err = cli(capsys, "sweep", str(path), "--dry-run")
    assert f"{path}, line 4, column" in one_line_error(rc, err)


# ---- 7. the passive OpenMP wait for library runs ---------------------------------------------------------------
LATE = textwrap.dedent('''
    import os, sys, warnings
    {first}
    from fedlase.openmp import warn_spinning_openmp
    cfg = dict(dataset="digits", system="{{1}}_{{2}}", width=0.25, rounds=1, local_steps=1, participation=1)
    counts = []
    for step in sys.argv[1:]:   # run:THREADS, fedlase.run with those threads; check:THREADS, only its check
        what, threads = step.split(":")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if what == "run":
                fedlase.run(fedlase.make_config(**cfg, threads=int(threads), out=f"r{{len(counts)}}"))
            else:
                warn_spinning_openmp(int(threads))
        counts.append(sum("OMP_WAIT_POLICY" in str(w.message) for w in seen))
    print(os.environ.get("OMP_WAIT_POLICY"), *counts)
''')


@pytest.mark.parametrize("first, argv, expected", [
    ("import fedlase\nassert 'torch' not in sys.modules\nimport torch", ["run:2"], "PASSIVE 0"),   # in time
    # too late for this process: one warning, from the first run on more than one thread (one has none idle)
    ("import torch\nimport fedlase", ["check:1", "run:2", "check:2"], "PASSIVE 0 1 0"),
])
def test_a_library_run_waits_passively_or_says_once_why_not(tmp_path, first, argv, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", LATE.format(first=first), *argv], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-len(expected.split()):] == expected.split()


def test_import_fedlase_loads_no_module_from_outside_the_package(tmp_path):
    """`import fedlase` sets the wait policy with the os and sys that Python has loaded already: a Flower worker
    imports the package before it takes the working folder off its path (fedlase/flower/worker_start.py), so a
    module imported then could be one planted in that folder."""
    code = ("import sys\nbefore = set(sys.modules)\nimport fedlase\n"
            "print([m for m in set(sys.modules) - before if m.split('.')[0] != 'fedlase'])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr)


# ---- 8. the smaller things -------------------------------------------------------------------------------------
def test_methods_describes_each_method_by_its_whole_first_sentence(capsys):
    from fedlase.util import first_sentence
    rc, out, _ = cli(capsys, "methods")
    assert rc == 0
    for name, cls in METHODS.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{name}: "))
        assert line == f"{name}: {first_sentence(cls.__doc__)}"
        assert line.endswith("."), line   # a sentence, not a docstring's first line
    assert "whatever its own level: HeteroFL's slice of that level" in out


def test_cost_prints_a_legend_of_its_columns(capsys):
    from fedlase.cost import LEGEND
    rc, out, err = cli(capsys, "cost", *SMALL, "--no-memory")
    assert rc == 0, err
    head = next(ln for ln in out.splitlines() if ln.startswith("| level |"))
    columns = [c.strip() for c in head.strip("|").split("|")][1:]
    assert out.rstrip().endswith(LEGEND)
    named = [ln[:15].strip() for ln in LEGEND.splitlines() if ln[:1] != " "]
    shown = {c for c in columns if c not in ("down", "up")} | {"down, up"}
    assert shown <= set(named) and set(named) - shown <= {"frozen base"}   # shown only when the run freezes some
    assert all(unit in LEGEND for unit in ("MiB", "bytes", "10^6"))


def test_evaluate_help_lists_the_settings_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    out = capsys.readouterr().out
    assert "eval_finetune" in tagged("eval")
    for key in (*tagged("eval"), "plugins"):
        assert re.search(rf"^  {key} ", out, re.M), key


def test_a_data_dir_the_dataset_ignores_is_refused(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="data_dir: dataset digits is bundled with its package and reads no folder"):
        tiny_cfg(f"data_dir={tmp_path}")
    assert not DATASETS.get("digits").reads_data_dir and DATASETS.get("fashion_mnist").reads_data_dir


def test_a_float64_user_dataset_trains_as_float32(tmp_path):
    def load(cfg):   # numpy's default dtypes: float64 inputs, int32 labels
        g = torch.Generator().manual_seed(0)
        x = torch.randn(120, 1, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (120,), generator=g, dtype=torch.int32)
        return fedlase.Dataset("f64", x[:100], y[:100], x[100:].numpy(), y[100:].numpy(), num_classes=3)

    with temporary():
        fedlase.register_dataset("f64", load, num_classes=3, shape=(1, 8, 8))
        data = DATASETS.get("f64").load(None)
        assert (data.x_train.dtype, data.x_test.dtype, data.y_test.dtype) == (torch.float32,) * 2 + (torch.int64,)
        cfg = fedlase.make_config(dataset="f64", system="{1,1/4}_{2,2}", width=0.25, rounds=1, local_steps=2,
                                  batch_size=8, threads=1, device="cpu", out=str(tmp_path / "r"))
        final = fedlase.run(cfg)["final"]
    assert 0 <= final["global_acc"] <= 1
    with pytest.raises(fedlase.DataError, match="y_train holds float32 values; labels are class ids"):
        fedlase.Dataset("bad", torch.zeros(2, 1), torch.zeros(2), torch.zeros(2, 1), torch.zeros(2).long(), 2)
