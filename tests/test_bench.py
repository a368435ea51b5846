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


def test_a_failing_method_fails_in_its_row_and_the_gpu_section_goes_on(monkeypatch, tmp_path):
    """The gpu section's bookkeeping with its timings faked: a method that raises (RecipFL's KeyError on
    ResNet-18 killed the bench before) gets its row, the others theirs, and the projection is their mean."""
    import argparse

    import tools.bench as bench

    def timed(overrides, rounds):
        if "method=fedlase" in overrides:
            raise KeyError("linear")
        return 2.0 if "method=fiarse" in overrides else 1.0
    monkeypatch.setattr(bench, "timed_rounds", timed)
    monkeypatch.setattr(bench, "anchor_steps", lambda *a, **k: 0.01)
    monkeypatch.setattr(bench, "deterministic_cost", lambda *a: (1.5, 1.0))
    args = argparse.Namespace(device="cpu", threads=1, width=None, steps=None, rounds=1)
    text = bench.section_gpu(args, {"cifar": ["dataset=cifar10"], "fmnist": ["dataset=fashion_mnist"]})
    assert "| fedlase | fp32, sequential | failed: KeyError: 'linear' |" in text
    assert "| fiarse | fp32, sequential | 2.000 | 10.00x |" in text   # 10 clients x 2 steps x 10 ms = 0.2 s
    hours = (2.0 + 1.0 + 1.0) / 3 * bench.TABLE_ROUNDS / 3600   # fiarse, heterofl, fedrolex: fedlase failed
    assert f"{hours:.1f} h at the sequential fp32 rounds" in text and "smaller than the papers' round" in text
    assert "| resnet18 | 1.500 | 1.000 | 1.50x |" in text and "| cnn | 1.500 | 1.000 | 1.50x |" in text
