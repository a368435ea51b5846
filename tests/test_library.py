"""The Python API and plugins: a method defined outside the package, registered from the user's own module,
runs on the embedded engine and on Flower's Simulation Engine and is seen by config checks and `fedlase
methods`."""
import os
import sys
import textwrap

import pytest
import torch

import fedlase
from fedlase.errors import ConfigError
from fedlase.registry import METHODS, RULES, temporary

PLUGIN = textwrap.dedent('''
    """A user's method (every level keeps the first rows of each budgeted weight: whole output units) and server
    rule (a damped mean)."""
    import math

    import fedlase
    from fedlase.aggregate import aggregate
    from fedlase.robust_config import SCREEN


    @fedlase.register_method
    class FirstRows(fedlase.Method):
        """first_rows: each budgeted weight keeps its first ceil(level * rows) output rows."""
        name = "first_rows"
        options = {"min_rows": fedlase.Option(1, "rows kept at least", low=1)}

        def submodel(self, params, level, round):
            masks = {}
            for n in self.maskable:
                if n.endswith("weight"):
                    rows = max(self.args["min_rows"], math.ceil(float(level) * params[n].shape[0]))
                    m = torch.zeros(params[n].shape, dtype=torch.bool)
                    m[:rows] = True
                    masks[n] = m
            return fedlase.Submodel(masks)


    @fedlase.register_rule
    class Damped(fedlase.Rule):
        """damped: the screened streaming mean, its step times `keep`."""
        name = "damped"
        options = {"screen": SCREEN, "keep": fedlase.Option(0.5, "fraction of the mean's step taken", low=0, high=1)}

        def aggregate(self, params, updates, subs, rms, mode, coverage, owners):
            mean = aggregate(params, [(u.delta, u.sub or subs[u.level]) for u in updates], mode, coverage, owners)
            keep = self.args["keep"]
            return {n: p + keep * (mean[n] - p) for n, p in params.items()}, {"damped": len(updates)}


    import torch  # noqa: E402
''')

TINY_RUN = dict(dataset="digits", model="cnn", width=0.25, system="{1,1/4}_{2,2}", participation=0.5,
                local_steps=2, batch_size=16, rounds=2, eval_every=1, threads=1, device="cpu")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "user_methods.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Flower's simulation workers are other processes: they import the plugin from PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    with temporary(METHODS, RULES):
        yield "user_methods"
    sys.modules.pop("user_methods", None)


def test_api_runs_and_reads_results(tmp_path):
    cfg = fedlase.make_config(**TINY_RUN, method="fiarse", out=str(tmp_path / "r"))
    summary = fedlase.run(cfg)
    metrics = fedlase.read_metrics(tmp_path / "r")
    assert [m["round"] for m in metrics] == [1, 2]
    assert fedlase.read_summary(tmp_path / "r")["final"] == summary["final"] == metrics[-1]
    # the refusal to overwrite the run says how to continue it in the API's words, not the command line's
    with pytest.raises(fedlase.UserError, match=r"already holds a run; pass resume=True to continue") as refused:
        fedlase.run(cfg)
    assert "--resume" not in str(refused.value)


def test_unknown_method_is_a_config_error_until_registered(plugin, tmp_path):
    with pytest.raises(ConfigError, match="method: 'first_rows' is not one of"):
        fedlase.make_config(**TINY_RUN, method="first_rows", out=str(tmp_path / "r"))
    cfg = fedlase.make_config(**TINY_RUN, method="first_rows", plugins=[plugin], out=str(tmp_path / "r"))
    assert cfg.method == "first_rows"
    with pytest.raises(ConfigError, match="method_args.min_rows: must be >= 1"):
        fedlase.make_config(**TINY_RUN, method="first_rows", method_args={"min_rows": 0}, out=str(tmp_path / "r"))
    from fedlase.methods import describe_methods
    assert "first_rows: first_rows: each budgeted weight" in describe_methods()


def test_missing_plugin_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="plugins: cannot import 'no_such_module_xyz'"):
        fedlase.make_config(**TINY_RUN, plugins=["no_such_module_xyz"], out=str(tmp_path / "r"))


def test_plugin_method_and_rule_run_on_the_embedded_engine(plugin, tmp_path):
    cfg = fedlase.make_config(**TINY_RUN, method="first_rows", robust="damped", plugins=[plugin],
                              out=str(tmp_path / "r"))
    final = fedlase.run(cfg)["final"]
    assert final["levels"]["1/4"]["kept"] < final["levels"]["1"]["kept"]
    assert final["global_acc"] == pytest.approx(sum(v["global_acc"] for v in final["levels"].values()) / 2)
    assert [m["robust"] for m in fedlase.read_metrics(tmp_path / "r")] == [{"damped": 2}] * 2   # the plug-in rule ran
    with pytest.raises(ConfigError, match="robust_args.keep: must be <= 1"):
        fedlase.make_config(**TINY_RUN, robust="damped", robust_args={"keep": 2}, plugins=[plugin],
                            out=str(tmp_path / "r"))


@pytest.mark.flower
def test_plugin_method_and_rule_run_on_flower_simulation(plugin, tmp_path):
    """The plug-in method and the plug-in server rule (`robust=damped`), with no edit to fedlase/."""
    pytest.importorskip("flwr")
    run = dict(TINY_RUN, method="first_rows", robust="damped", plugins=[plugin])
    embedded = fedlase.run(fedlase.make_config(**run, out=str(tmp_path / "e")))
    flower = fedlase.run(fedlase.make_config(**run, engine="flower-sim", sim_actors=1, out=str(tmp_path / "f")))
    assert [m["robust"] for m in fedlase.read_metrics(tmp_path / "f")] == [{"damped": 2}] * 2
    assert flower["final"]["levels"] == embedded["final"]["levels"]
    emb = torch.load(tmp_path / "e" / "checkpoint.pt", weights_only=True)["params"]
    flo = torch.load(tmp_path / "f" / "checkpoint.pt", weights_only=True)["params"]
    assert all(torch.equal(emb[k], flo[k]) for k in emb)
