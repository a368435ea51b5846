"""Device populations (fedlase/population.py): spread within a level, availability, a user's FedScale trace read
as plain data only, and the config's one-line errors."""
import json
import os
import pickle

import numpy as np
import pytest

from fedlase.cli import main
from fedlase.engine import build_parts, run_experiment
from fedlase.errors import ConfigError, DataError
from fedlase.levels import System
from fedlase.population import OnOff, Population
from fedlase.sim_config import check_population
from fedlase.simtime import clock_for, time_spread_table

FOUR = ["system={1,1/4}_{2,2}"]


def test_spread_is_seeded_lognormal_and_scales_each_clients_time(tiny_cfg):
    system = System.parse("{1,1/4}_{50,50}")
    args = check_population({"speed_spread": 0.5})
    a, b = Population.of(args, system, 3), Population.of(args, system, 3)
    assert np.array_equal(a.speed, b.speed) and not np.array_equal(a.speed, Population.of(args, system, 4).speed)
    assert np.all(a.bandwidth == 1.0) and 0.7 < np.median(a.speed) < 1.4 and 0.3 < np.log(a.speed).std() < 0.7
    lo, mid, hi = a.spread(list(system.client_level), 2)[0]
    assert lo < mid < hi
    # on the clock: a client's time is its level's, its compute part divided by its factor
    cfg = tiny_cfg(*FOUR, "device_model={}", "population.speed_spread=0.5")
    parts = build_parts(cfg)
    plain, spread = clock_for(tiny_cfg(*FOUR, "device_model={}"), parts), clock_for(cfg, parts)
    times = [spread.client_time(c, 0) for c in (0, 1)]
    assert times[0] != times[1] and plain.client_time(0, 0) == plain.client_time(1, 0)
    assert (spread.population.speed[0] > spread.population.speed[1]) == (times[0] < times[1])
    # `fedlase cost` shows the spread per level: min / median / max of the level's clients' times
    rows = [ln.strip("| ").split(" | ") for ln in time_spread_table(cfg, spread.costs).splitlines()
            if ln.startswith("| 1")]
    assert [r[0] for r in rows] == ["1", "1/4"]
    assert float(rows[0][2]) == pytest.approx(min(times), rel=1e-3) and float(rows[0][4]) == pytest.approx(
        max(times), rel=1e-3)


def test_on_off_process_is_consistent_and_seeded():
    av, again = OnOff(3, 10.0, 5.0, seed=1), OnOff(3, 10.0, 5.0, seed=1)
    for c in range(3):
        for t in np.linspace(0, 200, 401):
            assert av.online(c, t) == again.online(c, t)
            if av.online(c, t):
                off = av.offline_at(c, t)
                assert off > t and av.online(c, (t + off) / 2) and not av.online(c, off)
    share = np.mean([av.online(0, t) for t in np.linspace(0, 20000, 4001)])
    assert 0.55 < share < 0.8   # online 10 / (10 + 5) of the time
    t = av.next_online(100.0)
    assert any(av.online(c, t) for c in range(3))


def test_offline_clients_are_not_picked_and_lost_ones_are_recorded(tiny_cfg, tmp_path):
    # simulated rounds last ~0.2 s: clients online ~0.3 s, offline ~0.3 s come and go within rounds
    cfg = tiny_cfg(*FOUR, "rounds=6", "population.online=0.3", "population.offline=0.3", "local_steps=1",
                   out=str(tmp_path / "r"))
    run_experiment(cfg, progress=False, clock=clock_for)
    lines = [json.loads(ln) for ln in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    clock = clock_for(cfg, build_parts(cfg))
    fates = [clock.round(r) for r in range(1, 7)]
    assert any(f["offline"] for f in fates) and any(f["lost"] for f in fates)
    for r, (f, line) in enumerate(zip(fates, lines), 1):
        start = clock.elapsed(r - 1)
        assert all(not clock.online(c, start) for c in f["offline"])
        assert all(clock.online(c, start) for c, _ in f["kept"])
        assert not {c for c, _ in f["kept"]} & set(f["lost"])
        assert line["clients"] == len(f["kept"]) and line.get("offline", []) == f["offline"]
        assert line.get("lost_offline", []) == f["lost"] and line["sim_time"] == clock.elapsed(r) > start


def _pickle(path, obj):
    path.write_bytes(pickle.dumps(obj))
    return str(path)


def test_a_fedscale_trace_maps_levels_by_speed_quantile_and_says_when_clients_are_online(tmp_path):
    system = System.parse("{1,1/4}_{3,3}")
    ms = {i + 1: float(v) for i, v in enumerate([9, 1, 5, 2, 8, 4, 7])}   # ms per sample; id 7 unused
    cap = _pickle(tmp_path / "cap", {k: {"computation": v, "communication": 100.0 * k} for k, v in ms.items()})
    behave = _pickle(tmp_path / "beh", {1: {"active": [0, 50], "inactive": [10], "finish_time": 100},
                                        2: {"active": [5], "inactive": [6], "finish_time": 10}})
    pop = Population.of(check_population({"capacity": cap, "behave": behave}), system, 0)
    # clients 0-5 take ids 1-6; the three fastest (ms 1, 2, 4) go to level 1, each relative to its level's median
    assert pop.speed.tolist() == pytest.approx([2.0, 1.0, 0.5, 8 / 5, 1.0, 8 / 9])
    av = pop.availability
    assert av.online(0, 5) and not av.online(0, 10) and av.online(0, 60) and av.online(0, 105)
    # the unmatched active lasts the cycle, and runs on into the next cycle's [0, 10)
    assert av.offline_at(0, 3) == 10 and av.offline_at(0, 150) == 210
    assert av.online(1, 25.5) and not av.online(1, 26) and av.online(2, 0)   # client 2 reuses id 1
    assert av.next_online(10.5) == pytest.approx(15.0)


def test_a_trace_client_online_across_a_cycle_boundary_is_not_lost_there(tmp_path):
    behave = _pickle(tmp_path / "beh", {1: {"active": [0], "inactive": [], "finish_time": 100},   # always online
                                        2: {"active": [0, 40], "inactive": [40, 100], "finish_time": 100},
                                        3: {"active": [0, 90], "inactive": [10], "finish_time": 100}})
    av = Population.of(check_population({"behave": behave}), System.parse("{1}_{3}"), 0).availability
    assert av.offline_at(0, 99.5) == float("inf") and av.offline_at(0, 1e6 + 3) == float("inf")
    assert av.offline_at(1, 250) == float("inf")   # touching intervals covering the cycle
    assert av.offline_at(2, 95) == 110 and av.offline_at(2, 305) == 310 and av.offline_at(2, 50) == 50


def test_a_malicious_trace_is_refused_in_one_line_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    cap = _pickle(tmp_path / "cap.pkl", {1: Payload()})
    with pytest.raises(DataError, match="refusing to load posix.mkdir"):
        Population.of(check_population({"capacity": cap}), System.parse("{1}_{2}"), 0)
    argv = ["run", "dataset=digits", "model=cnn", "width=0.25", *FOUR, "rounds=1", "threads=1", "local_steps=1",
            f"population.capacity={cap}", f"out={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refusing to load posix.mkdir" in err and "cap.pkl" in err
    assert not marker.exists()


@pytest.mark.parametrize("bad, key", [
    ("population.online=10", "population.online"), ("population.speedy=1", "population.speedy"),
    ("population.speed_spread=-1", "population.speed_spread"), ("population.capacity=/no/such", "population.capacity"),
    ("schedule_args.buffer=2", "schedule_args"), ("schedule=fedasync schedule_args.buffer=2", "schedule_args.buffer"),
    ("schedule=fedbuff deadline=3", "deadline"), ("schedule=fedbuff robust=median", "schedule_args.staleness"),
    ("schedule=fedbuff schedule_args.concurrency=9", "schedule_args.concurrency"),
    ("schedule=fedbuff schedule_args.mixing=0.5", "schedule_args.mixing"),
    ("schedule=fedbuff engine=flower-deploy population.speed_spread=0.5", "population"),
    ("schedule=fedbuff schedule_args.replay=/no/such", "schedule_args.replay"),
    ("schedule=fedbuff schedule_args.replay=. population.speed_spread=0.5", "schedule_args.replay"),
    ("schedule=fedbuff schedule_args.buffer=1 min_replies=2", "min_replies"),
    ("schedule=fedasync min_replies=2", "min_replies"),
    # a rule that compares a step's updates has nothing to compare in a step of one (issue 48, item 8)
    ("schedule=fedasync robust=median", "robust"), ("schedule=fedasync robust=trimmed_mean", "robust"),
    ("schedule=fedasync robust=multikrum", "robust"),
    ("schedule=fedbuff schedule_args.buffer=1 robust=centered_clip schedule_args.staleness=constant", "robust")])
def test_bad_population_or_schedule_is_a_one_line_config_error(tiny_cfg, bad, key):
    with pytest.raises(ConfigError) as e:
        tiny_cfg(*FOUR, *bad.split())
    assert e.value.key == key and "\n" not in str(e.value)
