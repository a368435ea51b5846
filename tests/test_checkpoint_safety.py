"""A run folder is data, not code (fedlase/checkpoint.py, fedlase/safe_pickle.py): a checkpoint or a dataset
pickle carrying a payload is refused in one line and the payload never runs; the plain layout round-trips bit
for bit; checkpoints of an older fedlase load, or are refused with the command that converts them; a run
folder's `plugins` are not imported. (Resuming bit-identically is tests/test_engine.py's and test_analysis.py's.)"""
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from conftest import TINY
from fedlase import checkpoint
from fedlase.cli import main
from fedlase.config import load_config
from fedlase.data.sources import load_dataset
from fedlase.engine import run_experiment
from fedlase.errors import DataError, UserError
from fedlase.report_clocks import run_clocks
from fedlase.report_runs import find_runs, group_runs

RUN = [*TINY, "rounds=1", "analysis.magnitudes=true"]   # an analysis: its history is numpy arrays


class Payload:
    """Pickles as a call of os.system: whatever unpickles it with the full unpickler runs the shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished one-round run (the CLI's tests of evaluate and --resume copy it)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run_experiment(load_config(None, [*RUN, f"out={out}"]), progress=False)
    return out


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "copy")


def one_error_line(capsys, rc, path):
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"fedlase: error: {path}"), err
    return err


def test_a_checkpoint_with_a_payload_is_refused_by_evaluate_and_resume_and_never_runs(run, tmp_path, capsys):
    folder, marker = copy_of(run, tmp_path), tmp_path / "ran"
    state = checkpoint.load(folder / "checkpoint.pt")
    state["method"]["extra"] = Payload(marker)
    torch.save(state, folder / "checkpoint.pt")   # what the full unpickler would run
    ckpt = folder / "checkpoint.pt"
    err = one_error_line(capsys, main(["evaluate", str(folder)]), ckpt)
    assert "posix.system" in err and "nothing in it was run" in err and "convert" not in err   # no advice to run it
    one_error_line(capsys, main(["run", *RUN, f"out={folder}", "--resume", "--quiet"]), ckpt)
    one_error_line(capsys, main(["cost", *RUN, "--no-memory", "--checkpoint", str(ckpt)]), ckpt)
    assert not marker.exists()
    torch.load(ckpt, weights_only=False)   # the control: the payload is real
    assert marker.exists()


def test_the_plain_layout_round_trips_bit_for_bit(run, tmp_path):
    state = checkpoint.load(run / "checkpoint.pt")
    arrays = {"f64": np.random.default_rng(0).normal(size=(3, 2)), "i64": np.arange(4), "b": np.array([True, False]),
              "f32_0d": np.float32(np.pi) * np.ones((), np.float32), "scalar": np.float64(1 / 3), "n": np.int64(-7),
              "big_endian": np.arange(3, dtype=">i4"), "fortran": np.asfortranarray(np.eye(3)[:, :2]),
              "empty": np.zeros((0, 4), np.float32)}
    state["runner"] = {"arrays": arrays, "nested": [(1, "a", None, True), {2: [np.int8(3)]}], "t": torch.arange(3)}
    checkpoint.save(state, tmp_path / "c.pt")
    back = checkpoint.load(tmp_path / "c.pt")
    torch.load(tmp_path / "c.pt", weights_only=True)   # the file itself is plain data
    for name, a in arrays.items():
        b = back["runner"]["arrays"][name]
        assert type(b) is type(a) and b.dtype == a.dtype and np.shape(b) == np.shape(a), name
        assert np.asarray(b).tobytes() == np.ascontiguousarray(a).tobytes(), name
    assert back["runner"]["nested"] == [(1, "a", None, True), {2: [np.int8(3)]}]
    assert type(back["runner"]["nested"][1][2][0]) is np.int8 and torch.equal(back["runner"]["t"], torch.arange(3))
    for key in ("params", "buffers"):
        assert all(torch.equal(state[key][k], back[key][k]) for k in state[key])
    for a, b in zip(state["trackers"], back["trackers"]):
        assert all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    with pytest.raises(UserError, match=r"^checkpoint.runner.x: a Payload cannot be checkpointed"):
        checkpoint.save({**state, "runner": {"x": Payload(tmp_path / "never")}}, tmp_path / "d.pt")


def test_old_checkpoints_load_or_are_refused_with_the_conversion(run, tmp_path, capsys):
    state = checkpoint.load(run / "checkpoint.pt")
    assert main(["evaluate", str(run)]) == 0
    want = capsys.readouterr().out.splitlines()[1:]   # the table (the first line names the folder)
    plain_old = {**state, "trackers": [{}]}   # an older fedlase's run without analyses: weights-only reads it
    torch.save(plain_old, tmp_path / "plain.pt")
    assert checkpoint.load(tmp_path / "plain.pt")["round"] == 1
    folder = copy_of(run, tmp_path)
    torch.save(state, folder / "checkpoint.pt")   # an older fedlase's: the analysis's numpy arrays as they are
    err = one_error_line(capsys, main(["evaluate", str(folder)]), folder / "checkpoint.pt")
    assert f"fedlase convert-checkpoint {folder / 'checkpoint.pt'}" in err
    assert main(["convert-checkpoint", str(folder / "checkpoint.pt")]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == want   # the same model, the same table


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", "list", "no-params", "format"])
def test_what_is_not_a_checkpoint_is_one_line(tmp_path, content):
    path = tmp_path / "checkpoint.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save({"list": [1, 2], "no-params": {"round": 1}, "format": {"format": "fedlase-checkpoint/99"}}
                   [content], path)
    with pytest.raises(UserError) as e:
        checkpoint.load(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_a_run_folder_names_no_module_to_import(run, tmp_path, capsys, caplog, monkeypatch):
    # Prepare: a module that leaves a marker when imported, on the path; the run's config names it
    marker = tmp_path / "imported"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "b39_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    folder = copy_of(run, tmp_path)
    state = checkpoint.load(folder / "checkpoint.pt")
    state["config"]["plugins"] = ["b39_plugin"]
    checkpoint.save(state, folder / "checkpoint.pt")
    summary = (folder / "summary.json").read_text()
    (folder / "summary.json").write_text(summary.replace('"plugins": []', '"plugins": ["b39_plugin"]'))
    # Execute / Assert: evaluate refuses; the report's cost sections leave the run out; neither imports it
    err = one_error_line(capsys, main(["evaluate", str(folder)]), folder / "checkpoint.pt")
    assert "b39_plugin" in err and "plugins=[...]" in err
    with caplog.at_level("WARNING", logger="fedlase"):
        tables, _ = run_clocks(group_runs(find_runs([str(folder)]), None))
    assert tables == {} and "b39_plugin" in caplog.text
    assert not marker.exists()
    # the user names it: then it is imported (and evaluates)
    assert main(["evaluate", str(folder), "plugins=[b39_plugin]"]) == 0 and marker.exists()


def test_a_dataset_pickle_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    for payload in (Payload(marker), np.array([Payload(marker)], dtype=object)):
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            with open(folder / name, "wb") as f:
                pickle.dump({**batch, b"batch_label": payload} if name == "data_batch_2" else batch, f, protocol=2)
        with pytest.raises(DataError) as e:
            load_dataset("cifar10", str(tmp_path))
        msg = str(e.value)
        assert msg.startswith(f"{folder / 'data_batch_2'}: not a CIFAR") and "\n" not in msg, msg
        assert not marker.exists()
    with open(folder / "data_batch_2", "wb") as f:   # the control: the same files without the payload load
        pickle.dump(batch, f, protocol=2)
    assert len(load_dataset("cifar10", str(tmp_path)).y_train) == 10


def test_the_plain_unpickler_admits_plain_data_and_numbers_only(tmp_path):
    from fedlase.safe_pickle import load_plain_pickle
    path = tmp_path / "p.pkl"
    plain = {"a": [1, 2.5, None, True, (3, "x")], b"k": b"bytes", "arr": np.arange(4, dtype=np.int16)}
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        path.write_bytes(pickle.dumps(plain, protocol=protocol))
        got = load_plain_pickle(path, "plain data")
        assert got["a"] == plain["a"] and got[b"k"] == b"bytes" and got["arr"].dtype == np.int16
        assert got["arr"].tolist() == [0, 1, 2, 3]
    # _codecs.encode rebuilds bytes with latin1 only; any other codec, or any other global, is refused
    for bad in (b"c_codecs\nencode\n(Vx\nVrot13\ntR.", b"cbuiltins\neval\n(V1\ntR.", pickle.dumps({1, 2}, protocol=2)):
        path.write_bytes(bad)
        with pytest.raises(DataError, match=f"^{path}: not plain data: UnpicklingError"):
            load_plain_pickle(path, "plain data")
