"""`deterministic` (fedlase/determinism.py): every kind of process that trains does so with torch's deterministic
algorithms on, checked from inside its local training, whatever the process's torch state was before."""
import json
import os
import textwrap

import pytest
import torch
import yaml

from fedlase import determinism
from fedlase.client import ClientTrainer
from fedlase.config import load_config
from fedlase.engine import Experiment, run_experiment

BASE = ["dataset=digits", "model=cnn", "width=0.25", "system={1,1/4}_{2,2}", "participation=0.5", "local_steps=2",
        "batch_size=16", "rounds=1", "eval_every=1", "threads=1", "device=cpu", "checkpoint_every=0"]


@pytest.fixture(autouse=True)
def torch_state():
    """Leave the process as the test found it, and start each test from the non-deterministic state."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              os.environ.get(determinism.CUBLAS_ENV))
    determinism.apply(False)
    os.environ.pop(determinism.CUBLAS_ENV, None)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    if before[4] is None:
        os.environ.pop(determinism.CUBLAS_ENV, None)
    else:
        os.environ[determinism.CUBLAS_ENV] = before[4]


def probe(monkeypatch, target, name) -> list[bool]:
    """Record `determinism.enabled()` each time `target.name` (a training entry point) is called."""
    seen, inner = [], getattr(target, name)

    def wrapped(*args, **kw):
        seen.append(determinism.enabled())
        return inner(*args, **kw)
    monkeypatch.setattr(target, name, wrapped)
    return seen


@pytest.mark.parametrize("batched", [False, True])
def test_the_embedded_engine_trains_deterministically_by_default(tmp_path, monkeypatch, batched):
    import fedlase.batched
    seen = (probe(monkeypatch, fedlase.batched, "train_clients_batched") if batched
            else probe(monkeypatch, ClientTrainer, "update"))
    run_experiment(load_config(None, [*BASE, f"batched_clients={str(batched).lower()}", f"out={tmp_path / 'a'}"]),
                   progress=False)
    assert seen and all(seen)
    assert os.environ[determinism.CUBLAS_ENV] == determinism.CUBLAS_DETERMINISTIC


def test_deterministic_false_gives_the_settings_up_with_the_same_cpu_result(monkeypatch):
    seen = probe(monkeypatch, ClientTrainer, "update")
    params = []
    for value in ("false", "true"):
        exp = Experiment.from_config(load_config(None, [*BASE, f"deterministic={value}"]))
        exp.run_round(1)
        params.append(exp.state.params)
        assert seen and all(s == (value == "true") for s in seen) and torch.backends.cudnn.benchmark != seen[-1]
        seen.clear()
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])   # a CPU run is bit-identical either way


def test_a_flower_client_app_trains_deterministically(monkeypatch):
    pytest.importorskip("flwr")
    from fedlase.flower import client_app
    cfg = load_config(None, BASE)
    monkeypatch.setattr(client_app, "_CACHE", {"trainers": {}})
    client_app.trainer_for(cfg, 0)   # the node worker trains through this very function
    assert determinism.enabled()


def test_a_sweep_worker_process_trains_deterministically(tmp_path):
    """A `--jobs 2` child is a fresh Python: a sitecustomize on its PYTHONPATH wraps its local training and
    writes what it saw there."""
    from fedlase.sweep import run_sweep
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""
        import json, os
        from fedlase import determinism
        from fedlase.client import ClientTrainer
        inner = ClientTrainer.update
        def update(*args, **kw):
            with open(os.environ["DET_PROBE"], "a") as f:
                f.write(json.dumps(determinism.enabled()) + "\\n")
            return inner(*args, **kw)
        ClientTrainer.update = update
    """))
    base = dict(kv.split("=", 1) for kv in BASE)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": {**base, "system": "{1,1/4}_{2,2}"}, "out": str(tmp_path / "out"),
                                    "grid": {"seed": [0, 1]}}))
    log = tmp_path / "probe.jsonl"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p),
           "DET_PROBE": str(log)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        res = run_sweep(path, progress=False, jobs=2)
    assert len(res["done"]) == 2, res
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) >= 2 and all(seen)
