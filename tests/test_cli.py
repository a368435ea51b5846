"""Tests for the command line (fedlase.cli): bad input gives one line on stderr naming the key and exit
status 2, never a traceback; help lists every config key; runs, resumes and refuses to overwrite."""
import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, idx_bytes, write_fmnist
from fedlase.cli import main
from fedlase.config import Config
from fedlase.registry import METHODS

KEYS = [f.name for f in dataclasses.fields(Config) if not f.metadata.get("derived")]


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc, err, key=None):
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fedlase: error: ")
    if key is not None:
        assert lines[0].startswith(f"fedlase: error: {key}:"), lines[0]


@pytest.fixture
def base(tmp_path):
    return ["run", "--quiet", *TINY, f"out={tmp_path / 'run'}"]


BAD = [
    ("foo=1", "foo"),
    ("system={1,1/4}_{10}", "system"),
    ("system={1,2}_{3,4}", "system"),
    ("system={1,1/4}_{3,0}", "system"),
    ("system={1,1}_{3,3}", "system"),
    ("system=garbage", "system"),
    ("alpha=0", "alpha"),
    ("partition=pathological classes_per_client=12", "classes_per_client"),
    ("participation=0", "participation"),
    ("participation={0.1,3}", "participation"),
    ("data_dir=/no/such/folder", "data_dir"),
    ("dataset=imagenet", "dataset"),
    ("optimizer=rmsprop", "optimizer"),
    ("rounds=ten", "rounds"),
    ("lr=-1", "lr"),
    ("lr=inf", "lr"),
    ("lr=nan", "lr"),
    ("min_replies=0", "min_replies"),
    ("momentum=1.5", "momentum"),
    ("betas=[0.9]", "betas"),
    ("method=bogus", "method"),
    ("method_args.bogus=1", "method_args.bogus"),
    ("method_args.ste=sideways", "method_args.ste"),
    ("method_args.overlap=3", "method_args.overlap"),
    ("method=fedavg method_args.ste=paper", "method_args.ste"),
    ("device=cuda", "device") if not __import__("torch").cuda.is_available() else ("device=tpu", "device"),
]


@pytest.mark.parametrize("override, key", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, base, tmp_path, override, key):
    # Execute
    rc, _, err = cli(capsys, *base, *override.split())
    # Assert
    assert_user_error(rc, err, key)
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_override_without_value(capsys, base):
    rc, _, err = cli(capsys, *base, "rounds")
    assert_user_error(rc, err, "rounds")


def test_missing_and_bad_config_files(capsys, tmp_path):
    rc, _, err = cli(capsys, "run", str(tmp_path / "nope.yaml"))
    assert_user_error(rc, err, "config")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    rc, _, err = cli(capsys, "run", str(bad))
    assert_user_error(rc, err, "config")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("gamma: 0.5\n")
    rc, _, err = cli(capsys, "run", str(wrong))
    assert_user_error(rc, err, "gamma")


# --------------------------------------------------------------------------- corrupt data files

def write_idx_folder(folder: Path, spoil: str) -> None:
    """The four Fashion-MNIST files (tiny), one of them spoiled."""
    folder.mkdir()
    write_fmnist(folder, n_train=20, n_test=10, size=8)
    name = "train-images-idx3-ubyte"
    path = folder / (name + ".gz")
    if spoil == "truncated":
        path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-7]))
    elif spoil == "magic":
        path.write_bytes(gzip.compress(idx_bytes(np.zeros((20, 8, 8)), 2049)))
    elif spoil == "labels":
        (folder / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.full(20, 42), 2049)))
    elif spoil == "missing":
        path.unlink()
    elif spoil == "badgzip":
        path.write_bytes(b"\x1f\x8b\x08\x00this is not gzip data at all")


@pytest.mark.parametrize("spoil", ["truncated", "magic", "labels", "missing", "badgzip"])
def test_corrupt_data_files(capsys, tmp_path, spoil):
    # Prepare
    folder = tmp_path / "fmnist"
    write_idx_folder(folder, spoil)
    # Execute
    rc, _, err = cli(capsys, "run", "--quiet", "dataset=fashion_mnist", f"data_dir={folder}",
                     "system={1}_{2}", f"out={tmp_path / 'run'}")
    # Assert
    assert_user_error(rc, err)
    assert str(folder) in err


def test_good_idx_folder_runs(capsys, tmp_path):
    # the same tiny folder unspoiled is a valid dataset: the errors above come from the spoiled file
    folder = tmp_path / "fmnist"
    write_idx_folder(folder, "none")
    rc, out, err = cli(capsys, "run", "--quiet", "dataset=fashion_mnist", f"data_dir={folder}", "system={1}_{2}",
                       "participation=1", "width=0.25", "rounds=1", "local_steps=1", "batch_size=8", "threads=1",
                       "device=cpu", f"out={tmp_path / 'run'}")   # batch_size: at most the folder's 20 samples
    assert rc == 0, err
    assert "level" in out


# --------------------------------------------------------------------------- help

@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_lists_every_key(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr().out
    assert e.value.code == 0
    for key in KEYS:
        assert f"  {key} " in out, key


def test_methods_lists_every_method(capsys):
    rc, out, _ = cli(capsys, "methods")
    assert rc == 0
    for name in METHODS:
        assert f"{name}:" in out


# --------------------------------------------------------------------------- runs

def test_run_refuse_overwrite_and_resume(capsys, tmp_path):
    # Prepare: a YAML file with overrides on top
    cfg = tmp_path / "exp.yaml"
    out = tmp_path / "run"
    cfg.write_text("".join(f"{k}: '{v}'\n" if k in ("system", "participation") else f"{k}: {v}\n"
                           for k, v in (o.split("=", 1) for o in TINY)) + f"out: {out}\nrounds: 5\n")
    # Execute: the file says 5 rounds, the override 2
    rc, stdout, err = cli(capsys, "run", str(cfg), "rounds=2", "--quiet")
    # Assert
    assert rc == 0, err
    assert "mean" in stdout and "1/4" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["config"]["batch_size"] == 16

    # an existing out folder without --resume: exit 2 naming out
    rc, _, err = cli(capsys, "run", str(cfg), "rounds=2", "--quiet")
    assert_user_error(rc, err, "out")

    # --resume continues it to 3 rounds
    rc, _, err = cli(capsys, "run", str(cfg), "rounds=3", "--quiet", "--resume")
    assert rc == 0, err
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3

    # --resume with another seed is refused
    rc, _, err = cli(capsys, "run", str(cfg), "rounds=4", "seed=9", "--quiet", "--resume")
    assert_user_error(rc, err, "out")
    assert "seed" in err


def test_subprocess_bad_input(tmp_path):
    # Prepare
    exe = Path(sys.executable).with_name("fedlase")
    exe = str(exe) if exe.exists() else shutil.which("fedlase")
    assert exe, "the fedlase console script is not installed"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # Execute
    res = subprocess.run([exe, "run", "dataset=digits", "system={1,1/4}_{3}", f"out={tmp_path / 'x'}", "--quiet"],
                         capture_output=True, text=True, env=env, timeout=120)
    # Assert
    assert res.returncode == 2
    assert res.stdout == ""
    assert_user_error(res.returncode, res.stderr, "system")


def test_evaluate_reproduces_the_final_evaluation_and_takes_only_evaluation_keys(capsys, base, tmp_path):
    rc, _, err = cli(capsys, *base)
    assert rc == 0, err
    run = tmp_path / "run"
    final = json.loads((run / "summary.json").read_text())["final"]
    rc, stdout, err = cli(capsys, "evaluate", str(run), "--json", str(tmp_path / "again.json"))
    assert rc == 0, err
    assert "mean" in stdout
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["round"] == final["round"]
    for lvl, v in final["levels"].items():   # the same model, the same settings: the same numbers
        assert again["levels"][lvl]["global_acc"] == v["global_acc"]
        assert again["levels"][lvl]["local_acc"] == v["local_acc"]
    rc, stdout, err = cli(capsys, "evaluate", str(run), "eval_order=clients")
    assert rc == 0, err
    assert "eval_order=clients" in stdout
    rc, _, err = cli(capsys, "evaluate", str(run), "lr=1")   # would describe another run
    assert_user_error(rc, err, "lr")
    rc, _, err = cli(capsys, "evaluate", str(tmp_path))      # no checkpoint there
    assert_user_error(rc, err)


# --------------------------------------------------------------------------- bench

def test_bench_is_the_checkouts_tool(monkeypatch):
    """`fedlase bench ARGS` runs `python -m tools.bench ARGS` in the checkout, in a process of its own (the tool is
    outside the library; tests/test_batched.py runs its parser and a section), and returns its exit status."""
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, cwd: seen.append((cmd, cwd)) or
                        subprocess.CompletedProcess(cmd, 3))
    assert main(["bench", "--only", "comm"]) == 3
    [(cmd, cwd)] = seen
    assert cmd == [sys.executable, "-m", "tools.bench", "--only", "comm"]
    assert (Path(cwd) / "tools" / "bench.py").is_file()


def test_run_help_lists_the_registered_choices(capsys):
    """The choices are read from the registries when `fedlase run --help` prints (never for `fedlase --help`)."""
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    method_line = next(ln for ln in out.splitlines() if ln.startswith("  method "))
    assert all(name in method_line for name in METHODS)


def test_cpu_by_process_counts_a_child_by_its_kind():
    """tools/cpu_by_process.py (docs/benchmarks.md's per-process figures): a child that spins 0.6 CPU-s, whose
    command line names `fedlase run`, is counted under that kind, and its exit status is the tool's; with
    `--others`, a child of no known kind is listed by its command line."""
    import subprocess
    import sys
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\nraise SystemExit(3)"
    res = subprocess.run([sys.executable, "-m", "tools.cpu_by_process", "--every", "0.05", "--", sys.executable,
                          "-c", spin, "fedlase", "run"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.endswith("fedlase run"))
    assert float(line.split()[0]) >= 0.5, res.stdout
    res = subprocess.run([sys.executable, "-m", "tools.cpu_by_process", "--every", "0.05", "--others", "50", "--",
                          sys.executable, "-c", spin.replace("3)", "0)"), "no-known-kind"],
                         capture_output=True, text=True, timeout=60)
    line = next(x for x in res.stdout.splitlines() if "other:" in x and "no-known-kind" in x)
    assert res.returncode == 0 and float(line.split()[0]) >= 0.5, res.stdout
