"""`python -m tools.profile_rounds SCENARIO METHOD [ROUNDS] [TOP]`: cProfile of the engine's rounds and of the
bench's tight loop over the same rounds (tools/bench.py scenarios: "cnn", "resnet18 w=0.25", "cnn w=0.25
digits"), then the functions whose own time differs most between the two: where the engine's fixed cost per
round goes. Each round is replayed twice from the warm-up's state, as the bench does."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from copy import deepcopy
from pathlib import Path

import torch

from fedlase.catalog import load_builtins
from fedlase.config import load_config
from fedlase.engine import Experiment

from . import bench


def own_times(profile: cProfile.Profile) -> tuple[float, dict[str, float]]:
    """(total own time, function -> own time) of a profile."""
    stats = pstats.Stats(profile)
    return stats.total_tt, {f"{Path(k[0]).name}:{k[1]}({k[2]})": v[2] for k, v in stats.stats.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.profile_rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("method")
    p.add_argument("rounds", nargs="?", type=int, default=3)
    p.add_argument("top", nargs="?", type=int, default=20)
    args = p.parse_args(argv)
    load_builtins()
    torch.set_num_threads(1)
    opts = argparse.Namespace(quick=False, device="cpu", threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        scenario = bench.scenarios(opts, bench.data_overrides(Path(tmp)))[args.scenario]
        exp = Experiment.from_config(load_config(None, [*scenario, f"method={args.method}"]))
        model = deepcopy(exp.model)
        exp.run_round(1)
        exp.state.round = 1
        warm = exp.state_dict()
        engine, tight = cProfile.Profile(), cProfile.Profile()
        for _ in range(2):
            exp.load_state_dict(warm)
            for rnd in range(2, 2 + args.rounds):
                start = exp.state.params
                engine.enable()
                exp.run_round(rnd)
                engine.disable()
                exp.state.round = rnd
                picked = exp.sample(rnd)
                subs = exp.submodels([lvl for _, lvl in picked], rnd)
                jobs = [exp.trainer.job(client, rnd) for client, _ in picked]
                tight.enable()
                bench.tight_round(exp, model, picked, subs, jobs, rnd, start)
                tight.disable()
    te, e = own_times(engine)
    tt, t = own_times(tight)
    print(f"{args.scenario}, {args.method}: engine {te:.3f} s, tight loop {tt:.3f} s (profiled), ratio {te / tt:.3f}")
    diff = sorted(((e.get(k, 0.0) - t.get(k, 0.0), k) for k in e.keys() | t.keys()), reverse=True)
    print("own time, engine minus tight loop (s), largest first:")
    for d, k in diff[:args.top]:
        print(f"  {d:+.4f}  engine {e.get(k, 0.0):.4f}  tight {t.get(k, 0.0):.4f}  {k}")
    print("... and smallest (the tight loop's own counterparts):")
    for d, k in diff[-5:]:
        print(f"  {d:+.4f}  engine {e.get(k, 0.0):.4f}  tight {t.get(k, 0.0):.4f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
