"""fedlase/util.py: the one atomic write, the one cache folder (and its deprecated alias), the one host:port
parser."""
from __future__ import annotations

import os

import pytest

from fedlase.util import atomic_write, cache_dir, split_host_port


def test_atomic_write_replaces_a_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")
    atomic_write(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["a.json"]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("old")

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]


def test_atomic_write_of_a_folder_keeps_the_one_a_racing_writer_put_first(tmp_path):
    path = tmp_path / "entry"

    def fill(text):
        def write(tmp):
            tmp.mkdir()
            (tmp / "x").write_text(text)
        return write
    atomic_write(path, fill("first"))
    atomic_write(path, fill("second"))   # os.replace refuses the non-empty folder: the first one stays
    assert (path / "x").read_text() == "first" and sorted(os.listdir(tmp_path)) == ["entry"]


def test_cache_dir_reads_fedlase_cache_then_its_deprecated_alias(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDLASE_CACHE_DIR", raising=False)
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "new"))
    monkeypatch.setenv("FEDLASE_CACHE_DIR", str(tmp_path / "old"))
    assert cache_dir() == tmp_path / "new"
    monkeypatch.delenv("FEDLASE_CACHE")
    with pytest.warns(DeprecationWarning, match="FEDLASE_CACHE_DIR is deprecated"):
        assert cache_dir() == tmp_path / "old"
    monkeypatch.delenv("FEDLASE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "fedlase"


@pytest.mark.parametrize("address, want", [("127.0.0.1:8000", ("127.0.0.1", 8000)), ("head:1", ("head", 1)),
                                           ("[::1]:9092", ("::1", 9092)), ("localhost:65535", ("localhost", 65535))])
def test_split_host_port_reads_host_and_port(address, want):
    assert split_host_port(address) == want


@pytest.mark.parametrize("address", ["8000", ":8000", "host:", "host:0", "host:65536", "host:80x", "a b:80",
                                     "http://h:80", "host"])
def test_split_host_port_refuses_what_is_not_host_port(address):
    assert split_host_port(address) is None


def test_key_lists_are_read_from_the_option_tags():
    """The lists of keys that code treats alike come from the Options' tags, so a new key is declared once."""
    from fedlase.config import options, parse_override, tagged
    from fedlase.options import TAGS, Option
    assert set(tagged("path")) > set(tagged("submitter")) > set()   # a submitter's file is a path of the run
    for key in tagged("raw", "parsed", "path"):   # kept as written, never read as YAML (1.5 would be a float)
        assert parse_override(f"{key}=1.5") == (key, "1.5")
    assert parse_override("lr=1.5") == ("lr", 1.5)
    assert all(set(o.tags) <= set(TAGS) for o in options().values())
    with pytest.raises(ValueError, match="unknown Option tags"):
        Option(1, "x", tags=("evaluation",))


def test_run_folder_refuses_a_file_and_a_finished_run_unless_resumed(tmp_path):
    from fedlase.errors import UserError
    from fedlase.util import run_folder
    assert run_folder(tmp_path / "new", resume=False) == tmp_path / "new"   # nothing created
    assert not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("x")
    for resume in (False, True):
        with pytest.raises(UserError, match="^out: .* is a file"):
            run_folder(tmp_path / "afile", resume)
    for held in ("checkpoint.pt", "summary.json"):
        run = tmp_path / held
        run.mkdir()
        (run / held).write_bytes(b"")
        with pytest.raises(UserError, match="^out: .* already holds a run; pass --resume"):
            run_folder(run, resume=False)
        assert run_folder(run, resume=True) == run
