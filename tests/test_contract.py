"""The API contract of docs/library.md, tested from outside the package: a method's randomness comes from
`Method.generator(level, round)` (seed, round, level), so a random-mask method resumes bit-identically and is
evaluated with the submodel it trained with; a plugin may be the running script; errors are reachable from
`import fedlase`; `kind` is image or text."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fedlase
from fedlase.registry import DATASETS, KINDS, METHODS, register_dataset, register_method, temporary

# A user's method that draws its masks: each budgeted tensor keeps a random `level` fraction of its
# coordinates, a new draw every round. It logs every submodel it hands out (round, level, digest of the masks).
RANDOM_MASK = textwrap.dedent('''
    import hashlib

    import torch

    import fedlase

    LOG = []


    @fedlase.register_method
    class RandomMask(fedlase.Method):
        """random_mask: every budgeted tensor keeps a random fraction `level` of its coordinates, drawn per round."""
        name = "random_mask"

        def submodel(self, params, level, round):
            g = self.generator(level, round)
            masks = {n: torch.rand(params[n].shape, generator=g) < float(level) for n in self.maskable}
            digest = hashlib.sha1(b"".join(m.numpy().tobytes() for m in masks.values())).hexdigest()
            LOG.append((round, level.index, digest))
            return fedlase.Submodel(masks)


    @fedlase.register_method
    class GlobalRandomMask(RandomMask):
        """global_random_mask: the same, drawn from torch's global stream (what the contract rules out)."""
        name = "global_random_mask"

        def generator(self, level, round):
            return None
''')

TINY = dict(dataset="digits", model="cnn", width=0.25, system="{1,1/4}_{2,2}", participation=0.5, local_steps=2,
            batch_size=16, eval_every=1, checkpoint_every=1, threads=1, device="cpu")


@pytest.fixture
def random_mask(tmp_path, monkeypatch):
    (tmp_path / "random_mask.py").write_text(RANDOM_MASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    with temporary(METHODS):
        yield "random_mask"
    sys.modules.pop("random_mask", None)


def _params(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=True)["params"]


def _whole_and_resumed(tmp_path, method: str, plugin: str) -> tuple[dict, dict, dict, dict]:
    """3 rounds at once, and 1 round then a resume to 3: (params, final) of each."""
    cfg = dict(TINY, method=method, plugins=[plugin])
    whole = fedlase.run(fedlase.make_config(**cfg, rounds=3, out=str(tmp_path / f"{method}-whole")))
    fedlase.run(fedlase.make_config(**cfg, rounds=1, out=str(tmp_path / f"{method}-cut")))
    resumed = fedlase.run(fedlase.make_config(**cfg, rounds=3, out=str(tmp_path / f"{method}-cut")), resume=True)
    timeless = [{k: v for k, v in s["final"].items() if not k.endswith("_time")} for s in (whole, resumed)]
    return _params(tmp_path / f"{method}-whole"), _params(tmp_path / f"{method}-cut"), *timeless


def test_a_random_method_resumes_bit_identically(random_mask, tmp_path, one_thread):
    a, b, final_a, final_b = _whole_and_resumed(tmp_path, "random_mask", random_mask)
    # same weights and same evaluation, bit for bit (one machine, computed the same way)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert final_a == final_b
    # the control: the same method drawing from torch's global stream does not resume to the same weights
    a, b, _, _ = _whole_and_resumed(tmp_path, "global_random_mask", random_mask)
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_evaluation_uses_the_submodel_trained_that_round(random_mask, tmp_path, one_thread):
    fedlase.run(fedlase.make_config(**TINY, method="random_mask", plugins=[random_mask], rounds=2,
                                    out=str(tmp_path / "r")))
    log = sys.modules["random_mask"].LOG
    by_round_level: dict = {}
    for rnd, level, digest in log:
        by_round_level.setdefault((rnd, level), []).append(digest)
    # every level is evaluated every round (eval_every=1), and a trained level was asked for twice
    assert set(by_round_level) == {(r, lv) for r in (1, 2) for lv in (0, 1)}
    assert any(len(d) >= 2 for d in by_round_level.values())
    assert all(len(set(d)) == 1 for d in by_round_level.values()), by_round_level
    # and the draws differ between rounds at the small level (a new random mask every round)
    assert by_round_level[(1, 1)][0] != by_round_level[(2, 1)][0]


def test_the_generator_is_a_function_of_seed_round_and_level():
    from fedlase.methods import FedAvg
    from fedlase.models import build_model
    model = build_model("cnn", 1, 10, 0.25, image_size=8)
    system = [1.0, 0.25]

    def draw(seed, level, rnd):
        method = FedAvg(model, system, run_seed=seed)
        return torch.rand(5, generator=method.generator(level, rnd))

    assert torch.equal(draw(0, 0.25, 3), draw(0, 0.25, 3))
    assert not torch.equal(draw(0, 0.25, 3), draw(1, 0.25, 3))
    assert not torch.equal(draw(0, 0.25, 3), draw(0, 0.25, 4))
    assert not torch.equal(draw(0, 0.25, 3), draw(0, 1.0, 3))


# ---- plugins ------------------------------------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    """A user's script that defines its method and names itself in `plugins` (so that sweep children and
    Flower's apps can import it): the script runs as __main__ and is imported again as my_script."""
    import sys

    import torch

    import fedlase


    @fedlase.register_method
    class KeepAll(fedlase.Method):
        """keep_all: every client trains the whole model."""
        name = "keep_all"

        def submodel(self, params, level, round):
            return fedlase.Submodel({})


    if __name__ == "__main__":
        cfg = fedlase.make_config(dataset="digits", model="cnn", width=0.25, system="{1}_{2}", participation=1,
                                  local_steps=1, rounds=1, threads=1, device="cpu", method="keep_all",
                                  plugins=["my_script"], out=sys.argv[1])
        print(fedlase.run(cfg, progress=False)["config"]["method"])
''')


def test_a_plugin_may_be_the_running_script(tmp_path):
    (tmp_path / "my_script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(tmp_path / "my_script.py"), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "keep_all"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["method"] == "keep_all"


def test_registering_the_same_class_again_is_a_no_op_and_another_class_is_an_error():
    from fedlase.methods import FedAvg
    cls = type("Twice", (FedAvg,), {"name": "twice_registered", "__doc__": "a test method"})
    other = type("Twice", (FedAvg,), {"name": "twice_registered", "__doc__": "another test method",
                                      "__qualname__": "OtherTwice"})
    with temporary():
        register_method(cls)
        assert register_method(cls) is cls and METHODS.get("twice_registered") is cls
        with pytest.raises(ValueError, match="registered already"):
            register_method(other)
        register_method(other, replace=True)
        assert METHODS.get("twice_registered") is other
    assert "twice_registered" not in METHODS


def test_temporary_undoes_what_was_registered_and_replaced_inside_it():
    from fedlase.methods import FedAvg
    builtin, names = METHODS.get("fedavg"), METHODS.names()
    stand_in = type("StandIn", (FedAvg,), {"name": "fedavg", "__doc__": "a test method"})
    with pytest.raises(RuntimeError), temporary(METHODS):
        register_method(stand_in, replace=True)
        register_method(type("New", (FedAvg,), {"name": "new_in_block", "__doc__": "a test method"}))
        assert METHODS.get("fedavg") is stand_in and "new_in_block" in METHODS
        raise RuntimeError("left by an error")
    assert METHODS.get("fedavg") is builtin and METHODS.names() == names


# ---- errors and kinds ---------------------------------------------------------------------------------------

def test_errors_are_reachable_after_import_fedlase():
    code = ("import sys, fedlase; assert fedlase.ConfigError is fedlase.errors.ConfigError; "
            "assert issubclass(fedlase.ConfigError, fedlase.UserError); "
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"   # and `import fedlase` stays light


def test_kind_is_image_or_text():
    assert KINDS == ("image", "text")
    assert {DATASETS.get(n).kind for n in DATASETS} <= set(KINDS)
    with pytest.raises(ValueError, match="kind must be one of image, text"):
        register_dataset("audio_data", lambda cfg: None, num_classes=2, kind="audio")
    assert "audio_data" not in DATASETS


def test_catalog_imports_every_choice_module_once(monkeypatch):
    from fedlase import catalog
    imported = []
    monkeypatch.setattr(catalog, "_loaded", False)
    monkeypatch.setattr(catalog.importlib, "import_module", lambda name: imported.append(name))
    monkeypatch.setattr(catalog, "load_plugins", lambda: [])
    catalog.load_builtins()
    catalog.load_builtins()
    # every module of the choice packages, found on disk (a new method file needs no list), imported once
    assert len(imported) == len(set(imported))
    assert {"fedlase.analysis", "fedlase.data.builtins", "fedlase.methods.fedlase_width", "fedlase.models.cnn",
            "fedlase.data.text", "fedlase.models.transformer"} <= set(imported)
    assert not [m for m in imported if not m.startswith(catalog.CHOICE_PACKAGES)]
