"""scripts/gpu_check.sh's exit status (issue 56 item 15): a Python without torch stops it at once with one line
and nothing written; a part that fails makes it exit non-zero (every part made to fail by a stand-in Python that
only claims to have torch, so that the script runs through in seconds)."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def check(tmp_path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python, "OUT": str(tmp_path / "out"), "DEVICE": "cpu", "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def no_torch_python(tmp_path) -> str:
    """A python3 that cannot import torch: the system's if it has none, else this one with a site folder whose
    `torch` fails to import."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and subprocess.run([cand, "-c", "import torch"], capture_output=True).returncode:
            return cand
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    wrapper = tmp_path / "python-without-torch"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={shadow} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def test_a_python_without_torch_stops_it_at_once_in_one_line(tmp_path):
    res = check(tmp_path, no_torch_python(tmp_path))
    assert res.returncode != 0
    lines = (res.stdout + res.stderr).splitlines()
    assert len(lines) == 1 and "cannot import torch" in lines[0], lines
    assert not (tmp_path / "out").exists()   # nothing written


@pytest.mark.skipif(sys.platform != "linux", reason="a POSIX shell stand-in")
def test_a_failing_part_makes_it_exit_non_zero(tmp_path):
    """A stand-in Python that says it has torch and fails every other command: each part fails, the summary
    says how many, and the exit status is 1 (it was 0)."""
    fake = tmp_path / "python-that-fails"
    fake.write_text('#!/bin/sh\n[ "$1" = -c ] && [ "$2" = "import torch" ] && exit 0\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    res = check(tmp_path, str(fake))
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "FAILED" in summary and summary.rstrip().endswith("part(s) FAILED."), summary
