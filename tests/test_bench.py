"""tools/bench.py's asynchronous section at a tiny size: its split of a FedBuff step's CPU time adds up, and the
timers see the work they name (the figures themselves are docs/benchmarks.md's, never asserted)."""
from conftest import TINY
from tools.bench import async_child


def test_async_bench_splits_a_fedbuff_step():
    spec = {"overrides": [*TINY, "system={1,1/4}_{10,10}", "participation=0.2", "checkpoint_every=0",
                          "schedule=fedbuff", "schedule_args.concurrency=4", "schedule_args.buffer=2",
                          "population.speed_spread=0.5"], "steps": 3}
    r = async_child(spec)
    assert r["arrivals"] == 3 * 2   # every measured step applies a full buffer (nobody goes offline here)
    assert 0 < r["in_flight"] <= 4 and r["sim_time"] > 0   # in flight when a step is taken
    assert r["train"] > 0 and r["serve"] > 0   # the runner and the server step were timed, once each
    assert r["train"] + r["serve"] + r["extract"] <= r["total"] and r["loop"] >= 0
    assert r["samples"] == 16 and r["rss_mib"] >= r["rss_init_mib"] > 0
