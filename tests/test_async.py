"""Asynchronous schedules (fedlase/asynchronous.py, options in fedlase/sim_config.py): the reduction to the
synchronous run, the staleness-weighted step, the metrics per server step, and resume with updates in flight."""
import itertools
import json

import pytest
import torch

from fedlase import checkpoint
from fedlase.aggregate import aggregate
from fedlase.engine import run_experiment
from fedlase.masks import Submodel
from fedlase.sim_config import staleness_weight
from fedlase.simtime import clock_for

FOUR = ["system={1,1/4}_{2,2}"]


def _run(tiny_cfg, out, *overrides, resume=False):
    run_experiment(tiny_cfg(*overrides, out=str(out)), resume=resume, progress=False, clock=clock_for)
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return checkpoint.load(out / "checkpoint.pt"), lines


@pytest.mark.numerics
@pytest.mark.parametrize("method", ["fiarse", "heterofl"])
def test_fedbuff_at_equal_speeds_and_c_equal_k_is_the_synchronous_run_bit_for_bit(tiny_cfg, tmp_path, method):
    """Every client at one level (1/4: submodels), so all take the same simulated time; concurrency = buffer =
    the 2 clients a round samples (the default), a constant staleness weight, every client online."""
    same = ["system={1/4}_{4}", f"method={method}", "rounds=3", "device_model={}"]
    sync, sync_lines = _run(tiny_cfg, tmp_path / "sync", *same)
    buff, buff_lines = _run(tiny_cfg, tmp_path / "buff", *same, "schedule=fedbuff",
                            "schedule_args.staleness=constant")
    assert sync["params"].keys() == buff["params"].keys()
    assert all(torch.equal(sync["params"][k], buff["params"][k]) for k in sync["params"])
    for a, b in zip(sync_lines, buff_lines, strict=True):
        assert (a["train_loss"], a["clients"], a["sim_time"], a["global_acc"]) == \
               (b["train_loss"], b["clients"], b["sim_time"], b["global_acc"])
        assert b["staleness"] == [0, 0] and b["level_updates"] == {"1/4": 2}


def test_the_buffer_step_is_fedbuffs_staleness_weighted_sum_over_the_count_per_coordinate():
    """Nguyen et al. 2022: the weights scale the deltas only; the step divides by the count of credited
    updates (a weighted mean, dividing by the sum of the weights, would give [2, 2, 4, 4] here)."""
    params = {"w": torch.zeros(4)}
    half = Submodel(masks={"w": torch.tensor([True, True, False, False])})
    full = Submodel(masks={"w": torch.ones(4, dtype=torch.bool)})
    d1, d2 = {"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}, {"w": torch.tensor([4.0, 4.0, 4.0, 4.0])}
    # staleness 0 and 3 under poly a=0.5: weights 1/sqrt(1) = 1 and 1/sqrt(4) = 0.5
    new = aggregate(params, [(d1, half), (d2, full)], weights=[1.0, 0.5])["w"]
    # held by both: (1*1 + 0.5*4) / 2; held by the second only: 0.5*4 / 1
    assert new.tolist() == pytest.approx([1.5, 1.5, 2.0, 2.0])
    # a uniformly stale buffer takes a smaller step (a weighted mean would cancel the weights)
    stale = aggregate(params, [(d1, half), (d2, full)], weights=[0.5, 0.5])["w"]
    assert stale.tolist() == pytest.approx([1.25, 1.25, 2.0, 2.0])
    # mode=mean: sum_i w_i d_i / K
    assert aggregate(params, [(d1, half), (d2, full)], "mean", weights=[1.0, 0.5])["w"].tolist() == \
        pytest.approx([1.5, 1.5, 1.0, 1.0])
    assert torch.equal(aggregate(params, [(d1, half), (d2, full)], weights=[1.0, 1.0])["w"],
                       aggregate(params, [(d1, half), (d2, full)])["w"])
    args = {"staleness": "poly", "a": 0.5, "b": 4.0}
    assert staleness_weight(args, 3) == 0.5 and staleness_weight({**args, "staleness": "constant"}, 9) == 1.0
    assert staleness_weight({**args, "staleness": "hinge", "a": 10}, 4) == 1.0
    assert staleness_weight({**args, "staleness": "hinge", "a": 10}, 6) == pytest.approx(1 / 21)


ASYNC = [*FOUR, "rounds=4", "device_model={}", "population.speed_spread=0.5", "population.online=0.6",
         "population.offline=0.2", "schedule=fedbuff", "schedule_args.concurrency=3", "schedule_args.buffer=2"]


def test_fedbuff_and_fedasync_record_each_server_step(tiny_cfg, tmp_path):
    state, lines = _run(tiny_cfg, tmp_path / "buff", *ASYNC)
    assert [x["round"] for x in lines] == [1, 2, 3, 4]
    times = [x["sim_time"] for x in lines]
    assert times == sorted(times) and times[0] > 0
    for x in lines:
        assert len(x["staleness"]) == 2 and sum(x["level_updates"].values()) == x["clients"] == 2
        assert x["in_flight"] <= 3
    assert any(max(x["staleness"]) > 0 for x in lines)
    assert state["schedule"]["flight"]   # clients still in flight at the end
    # the run's totals: the per-step fields summed, and what the arrival record says
    record = [json.loads(ln) for ln in (tmp_path / "buff" / "arrivals.jsonl").read_text().splitlines()]
    for key in ("lost_offline", "offline_skipped"):
        per_step = [len(x.get(key, [])) if key == "lost_offline" else x.get(key, 0) for x in lines]
        assert [x["totals"][key] for x in lines] == list(itertools.accumulate(per_step))
    assert lines[-1]["totals"]["lost_offline"] == sum(bool(r.get("lost")) for r in record) > 0
    # the staleness weights reach the step: with a constant weight the same events give another model
    same, const = _run(tiny_cfg, tmp_path / "const", *ASYNC, "schedule_args.staleness=constant")
    assert [x["staleness"] for x in const] == [x["staleness"] for x in lines]
    assert not all(torch.equal(same["params"][k], state["params"][k]) for k in state["params"])
    # fedasync, evaluated every 0.15 simulated seconds (and after the last step) instead of every step
    _, lines = _run(tiny_cfg, tmp_path / "async", *ASYNC[:-2], "schedule=fedasync", "schedule_args.concurrency=2",
                    "schedule_args.mixing=0.6", "eval_every=100", "eval_every_seconds=0.15")
    # one update a step, accepted: the first arrival is rejected (the running reference has nothing to judge it by
    # yet), and a step that would leave the model unchanged is not taken
    assert all(x["clients"] == 1 and len(x["staleness"]) == 1 for x in lines)
    buckets = [int(x["sim_time"] // 0.15) for x in lines]
    # one evaluation per 0.15 s crossed, and the last step's (evaluated whatever its time)
    assert lines[-1]["round"] == 4 and 1 < len(lines) < 4 and buckets[:-1] == sorted(set(buckets[:-1])), buckets
    # steps left unevaluated still count in the totals
    record = [json.loads(ln) for ln in (tmp_path / "async" / "arrivals.jsonl").read_text().splitlines()]
    assert lines[-1]["totals"]["lost_offline"] == sum(bool(r.get("lost")) for r in record)


def test_a_resumed_fedbuff_run_with_updates_in_flight_is_bit_identical(tiny_cfg, tmp_path):
    """The pattern of the other resume tests: a run stopped after step 2 (its checkpoint, as a kill -9 would leave
    it: the metrics lines after it are dropped) and resumed ends as the uninterrupted one."""
    whole, whole_lines = _run(tiny_cfg, tmp_path / "whole", *ASYNC, "schedule_args.staleness=poly")
    stopped, _ = _run(tiny_cfg, tmp_path / "split", *ASYNC, "rounds=2")
    assert stopped["schedule"]["flight"] and any("delta" in f for f in stopped["schedule"]["flight"])
    split, split_lines = _run(tiny_cfg, tmp_path / "split", *ASYNC, resume=True)
    assert all(torch.equal(whole["params"][k], split["params"][k]) for k in whole["params"])
    drop = ("train_time", "eval_time")
    assert [{k: v for k, v in x.items() if k not in drop} for x in whole_lines] == \
           [{k: v for k, v in x.items() if k not in drop} for x in split_lines]
    # the arrival record too: the stopped run's lines up to its checkpoint, then the resumed run's
    assert (tmp_path / "whole" / "arrivals.jsonl").read_text() == (tmp_path / "split" / "arrivals.jsonl").read_text()


def test_clients_that_always_drop_out_stop_the_run_with_one_line(tiny_cfg, tmp_path):
    from fedlase.errors import UserError
    cfg = tiny_cfg(*FOUR, "schedule=fedbuff", "population.online=0.001", "population.offline=0.001",
                   out=str(tmp_path / "r"))
    with pytest.raises(UserError, match="keep going offline") as e:
        run_experiment(cfg, progress=False, clock=clock_for)
    assert "\n" not in str(e.value)


# ---- the arrival record and its replay (the Flower deployment's: tests/test_flower.py) ----------------------------
TIMED = [*FOUR, "rounds=4", "device_model={}", "schedule=fedbuff", "schedule_args.concurrency=3",
         "schedule_args.buffer=2"]


def _record(out) -> list[dict]:
    return sorted((json.loads(ln) for ln in (out / "arrivals.jsonl").read_text().splitlines()),
                  key=lambda r: r["arrival"])


def _same(a, b) -> bool:
    return a["params"].keys() == b["params"].keys() and all(torch.equal(a["params"][k], b["params"][k])
                                                              for k in a["params"])


def test_a_replayed_arrival_order_rebuilds_the_run_and_another_order_another_model(tiny_cfg, tmp_path):
    """The record of a run, replayed, gives its model and its record again; the same record with two arrivals
    of different steps swapped is followed as written and gives another model; a record of another run is
    refused in one line."""
    from fedlase.errors import UserError
    ran, lines = _run(tiny_cfg, tmp_path / "ran", *TIMED)
    rows = _record(tmp_path / "ran")
    applied = [r for r in rows if "staleness" in r]
    assert [r["step"] for r in applied] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [r["staleness"] for r in applied] == [s for x in lines for s in x["staleness"]]
    again, again_lines = _run(tiny_cfg, tmp_path / "again", *TIMED, f"schedule_args.replay={tmp_path / 'ran'}")
    assert _same(ran, again) and _record(tmp_path / "again") == rows
    assert [x["staleness"] for x in again_lines] == [x["staleness"] for x in lines]
    # two arrivals of different instants and steps swapped: the later one is applied a step earlier
    i = next(k for k in range(len(rows) - 1) if rows[k]["instant"] != rows[k + 1]["instant"]
             and rows[k]["step"] != rows[k + 1]["step"])
    j = i + 1
    swapped = [dict(r) for r in rows]
    swapped[i], swapped[j] = ({**rows[j], "arrival": i + 1, "instant": rows[i]["instant"]},
                              {**rows[i], "arrival": j + 1, "instant": rows[j]["instant"]})
    (tmp_path / "swapped.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swapped))
    other, _ = _run(tiny_cfg, tmp_path / "other", *TIMED, f"schedule_args.replay={tmp_path / 'swapped.jsonl'}")
    got = _record(tmp_path / "other")
    assert [(r["seq"], r["client"]) for r in got[:j + 1]] == [(r["seq"], r["client"]) for r in swapped[:j + 1]]
    assert got[i]["step"] == rows[i]["step"] and not _same(ran, other)
    bad = [{**rows[0], "seq": 99}, *rows[1:]]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(UserError, match="has not sent") as e:
        _run(tiny_cfg, tmp_path / "bad", *TIMED, f"schedule_args.replay={tmp_path / 'bad.jsonl'}")
    assert "\n" not in str(e.value)
