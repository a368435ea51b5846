"""What each level costs (fedlase/cost.py) and the simulated time built on it (fedlase/simtime.py)."""
import json

import pytest
import torch

from conftest import assert_sparse_flops_sound
from fedlase.cli import main
from fedlase.cost import _LayerFlops, level_costs, measure_memory
from fedlase.engine import Experiment, run_experiment
from fedlase.errors import ConfigError, UserError
from fedlase.simtime import SimClock, client_steps, clock_for

FOUR = ["system={1,1/4,1/16,1/64}_{1,1,1,1}", "participation=1.0"]


def costs_of(exp):
    return level_costs(exp.model, exp.method, exp.trainer, exp.levels, exp.level_clients, exp.params, exp.buffers)


def _costs(tiny_cfg, method):
    exp = Experiment.from_config(tiny_cfg(*FOUR, f"method={method}"))
    return exp, costs_of(exp)


def test_masked_methods_hold_and_compute_the_dense_model(tiny_cfg):
    exp, costs = _costs(tiny_cfg, "fiarse")
    whole = sum(p.numel() for p in exp.params.values())
    assert all(c.held == whole and not c.sliced for c in costs)
    assert len({c.step_flops for c in costs}) == 1   # every level computes the full model's step
    assert costs[-1].sparse_flops < costs[1].sparse_flops < costs[0].sparse_flops == costs[0].step_flops
    assert costs[-1].kept <= exp.method.budget(exp.params, exp.levels[-1])
    assert costs[-1].down_bytes < costs[0].down_bytes and costs[-1].up_bytes < costs[0].up_bytes


@pytest.mark.parametrize("method", ["heterofl", "fedlase_width"])
def test_width_methods_hold_and_compute_their_slice(tiny_cfg, method):
    exp, costs = _costs(tiny_cfg, method)
    held = [c.held for c in costs]
    flops = [c.step_flops for c in costs]
    assert held == sorted(held, reverse=True) and held[-1] < held[0] / 8
    assert flops == sorted(flops, reverse=True) and flops[-1] < flops[0]
    assert all(c.sparse_flops == c.step_flops for c in costs)   # a slice computes only what it keeps
    assert all(c.sliced for c in costs[1:])


@pytest.mark.parametrize("method", ["fedlase", "fiarse"])
def test_sparse_flops_of_a_resnet_are_positive_at_most_dense_and_fall_with_the_level(tiny_cfg, method):
    # a shortcut reads its block's input beside the block's convs; torch's per-module counts held it open through
    # the convs' backward, and FedLASE's 1/64 came out negative (docs/reference/resnet-width-regime before the fix)
    exp = Experiment.from_config(tiny_cfg(*FOUR, f"method={method}", "model=resnet18", "width=0.0625"))
    assert_sparse_flops_sound(costs_of(exp))


def test_each_operation_counts_in_one_layer_whatever_reads_the_same_input():
    """Two layers read one hidden state (a block and its shortcut): each layer's FLOPs are its own forward, weight
    gradient and input gradient, by hand; the first layer's input needs no gradient."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 5), "c": torch.nn.Linear(4, 5)})
    x = torch.randn(2, 3)
    with _LayerFlops(model, {"a.weight", "b.weight", "c.weight"}) as counter:
        h = model["a"](x)
        (model["b"](h) + model["c"](h)).sum().backward()
    mm = 2 * 2   # FLOPs per weight coordinate of one matmul over a batch of 2
    assert counter.per_layer == {"a.weight": 2 * mm * 12, "b.weight": 3 * mm * 20, "c.weight": 3 * mm * 20}
    assert counter.total == sum(counter.per_layer.values())


def test_costing_leaves_the_run_unchanged(tiny_cfg, tmp_path):
    # a clock (device_model set) costs every level at start-up; the trained model must be the same as without
    plain = run_experiment(tiny_cfg(*FOUR, "method=feddse", out=str(tmp_path / "a")), progress=False)
    timed = run_experiment(tiny_cfg(*FOUR, "method=feddse", "device_model={}", out=str(tmp_path / "b")),
                           progress=False, clock=clock_for)
    assert json.dumps(plain["final"]["levels"]) == json.dumps(timed["final"]["levels"])


def test_memory_is_measured_in_a_child(tiny_cfg):
    peak, train = measure_memory(tiny_cfg(*FOUR, "method=heterofl"), 3)
    assert peak > 10 * 2 ** 20 and train is not None and 0 <= train < peak


def test_client_time_and_round_time(tiny_cfg):
    cfg = tiny_cfg(*FOUR, "method=fiarse", "device_model.speed=2e6", "device_model.bandwidth=1e5")
    exp = Experiment.from_config(cfg)
    costs, steps = costs_of(exp), client_steps(exp.trainer)
    dense, sparse = SimClock(cfg, costs, steps, "dense"), SimClock(cfg, costs, steps, "sparse")
    c = costs[2]   # level 1/16: speed and bandwidth 1/16 of level 1's
    want = c.step_flops * steps[2] / (2e6 / 16) + (c.down_bytes + c.up_bytes) / (1e5 / 16)
    assert dense.client_time(2, 2) == pytest.approx(want)
    assert sparse.client_time(2, 2) < dense.client_time(2, 2)
    fate = dense.round(1)
    assert fate["time"] == pytest.approx(max(dense.client_time(k, lvl.index) for k, lvl in fate["kept"]))
    assert dense.elapsed(3) == pytest.approx(sum(dense.round(r)["time"] for r in (1, 2, 3)))


def test_deadline_drops_and_records_the_slow_clients(tiny_cfg, tmp_path):
    probe = Experiment.from_config(tiny_cfg(*FOUR, "method=fiarse", "device_model={}"), clock_for=clock_for)
    times = sorted(probe.clock.client_time(c, lvl.index) for c, lvl in probe.clock.round(1)["kept"])
    deadline = (times[0] + times[-1]) / 2   # between the fastest and the slowest client
    cfg = tiny_cfg(*FOUR, "method=fiarse", "device_model={}", f"deadline={deadline}", "rounds=1")
    with pytest.raises(UserError, match="simulated time needs a clock"):   # never silently without the deadline
        run_experiment(cfg, progress=False)
    run_experiment(cfg, progress=False, clock=clock_for)
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["missed_deadline"] and line["clients"] == 4 - len(line["missed_deadline"])
    assert line["sim_time"] == pytest.approx(deadline)


def test_sim_time_recomputes_from_the_config(tiny_cfg, tmp_path):
    # what `fedlase report` does for a finished run: the same times from config.json, without training
    from fedlase.config import config_from_dict
    cfg = tiny_cfg(*FOUR, "method=heterofl", "device_model={}")
    run_experiment(cfg, progress=False, clock=clock_for)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    again = Experiment.from_config(config_from_dict(json.loads((tmp_path / "run" / "config.json").read_text())))
    clock = SimClock(again.cfg, costs_of(again), client_steps(again.trainer))
    assert [x["sim_time"] for x in lines] == pytest.approx([clock.elapsed(x["round"]) for x in lines])
    assert "over_memory" not in lines[-1]   # no memory in the device model: nothing to exceed


def test_a_client_over_its_device_memory_is_flagged(tiny_cfg):
    import dataclasses
    cfg = tiny_cfg(*FOUR, "method=fiarse", "device_model.memory=4e8")   # a level-l device: l x 400 MB
    exp = Experiment.from_config(tiny_cfg(*FOUR, "method=fiarse"))
    costs = [dataclasses.replace(c, peak_bytes=int(2e8)) for c in costs_of(exp)]   # every level needs 200 MB
    fate = SimClock(cfg, costs, client_steps(exp.trainer)).round(1)
    assert fate["over_memory"] == [c for c, lvl in fate["kept"] if lvl.fraction < 0.5]


@pytest.mark.parametrize("bad", ["device_model.speedy=1", "device_model.speed=-1", "device_model.memory=[1,2]",
                                 "deadline=0"])
def test_bad_device_model_is_a_config_error(tiny_cfg, bad):
    with pytest.raises(ConfigError):
        tiny_cfg(*FOUR, bad)


def test_cost_command_prints_the_table(tiny_cfg, tmp_path, capsys):
    argv = ["cost", "dataset=digits", "model=cnn", "width=0.25", *FOUR, "threads=1", "method=fedlase",
            "method_args.extract_all_layers=true", f"out={tmp_path}", "--no-memory"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("(dense)") == 4 and "| 1/64 |" in out
    assert main(["cost", "dataset=digits", "device_model.x=1", f"out={tmp_path}"]) == 2


def test_report_has_the_cost_table_and_the_simulated_time(tiny_cfg, tmp_path):
    """A run with a device model recorded its costs (sim.json): the report loads no data for it; a run without
    one has its parts rebuilt (its data loaded)."""
    import dataclasses

    from fedlase.registry import DATASETS
    from fedlase.report import make_report
    run_experiment(tiny_cfg(*FOUR, "method=heterofl", "device_model={}", out=str(tmp_path / "runs" / "heterofl")),
                   progress=False, clock=clock_for)
    run_experiment(tiny_cfg(*FOUR, "method=fedlase_width", out=str(tmp_path / "runs" / "fedlase_width")),
                   progress=False)
    # an asynchronous run: its recorded time, under the charge it ran with only (docs/async.md)
    buff = run_experiment(tiny_cfg(*FOUR, "method=heterofl", "schedule=fedbuff", "schedule_args.concurrency=3",
                                   "population.speed_spread=0.5", out=str(tmp_path / "runs" / "fedbuff")),
                          progress=False, clock=clock_for)
    digits, loaded = DATASETS.get("digits"), []
    DATASETS.add("digits", dataclasses.replace(digits, load=lambda cfg: loaded.append(cfg.method) or digits.load(cfg)),
                 replace=True)
    try:
        md = make_report([str(tmp_path / "runs")], tmp_path / "report").read_text()
    finally:
        DATASETS.add("digits", digits, replace=True)
    assert loaded == ["fedlase_width"]   # the device-model run's data was never loaded
    assert "## Cost per level" in md and md.count("(slice)") == 9   # levels 1/4..1/64 of the three runs
    assert "Accuracy at equal simulated time" in md and "time to A, sparse" in md
    assert (tmp_path / "report" / "plots" / "accuracy_time.png").is_file()
    timed = md[md.index("Accuracy at equal simulated time"):]
    row = next(ln for ln in timed.splitlines() if "schedule=fedbuff" in ln)
    assert f"{buff['final']['sim_time']:.4g}" in row and "—" in row
    population = md[md.index("## Device populations"):]   # the fedbuff run's population: its spread per level
    assert "schedule=fedbuff" in population and "| 1/64 | 1 |" in population
    plain = make_report([str(tmp_path / "runs")], tmp_path / "plain", cost=False).read_text()
    assert "Cost per level" not in plain
