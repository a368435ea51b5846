"""How hard the default rule (`bounded`) falls on each level in the CNN regime (issue 48, item 9): with its
reference per level (the rule since issue 48) and with the round's reference alone (the rule before it: every
update judged against the lower median of the whole round), the share of each level's honest updates that the
3x screen rejects and that the clip shortens, the norm the accepted ones keep, and each level's global accuracy.

    python scripts/level_clip_share.py [--seeds 0 1 2] [--methods fedlase fiarse] [--jobs 2] [key=value ...]

Each (method, seed) runs `configs/demo.yaml` (its 20 rounds; `threads=1`, evaluated at the last round only)
twice: as it is, and with the per-level reference switched off (`server_step.PER_LEVEL` set beyond any level's
size, so every level takes the round's). At every screen it records each finite update's level, its norm per
coordinate held, and the clip's reference the rule used, or that the screen rejected it (`bounded` at its
defaults: rejected beyond 3x its reference, clipped beyond 1x).
Prints two markdown tables, pooled over the seeds, and the accuracies paired by seed."""
import argparse
import multiprocessing as mp
import sys
import tempfile
from collections import defaultdict
from fractions import Fraction

import numpy as np

from fedlase.server_step import PER_LEVEL


def one_run(spec: tuple[str, int, bool, list[str]]) -> tuple[list, dict]:
    """(every screened update: (level, norm per coordinate held, clip reference; None, None if rejected),
    {level: global acc})."""
    method, seed, per_level, extra = spec
    import torch

    import fedlase.server_step as server_step
    from fedlase.catalog import load_builtins
    from fedlase.config import load_config
    from fedlase.engine import run_experiment
    load_builtins()
    torch.set_num_threads(1)
    # beyond any level's size, each level takes the round's reference (set in each run: a process runs several)
    server_step.PER_LEVEL = PER_LEVEL if per_level else 10 ** 9
    seen, real = [], getattr(server_step.judge, "real", server_step.judge)   # not a wrapper of an earlier run's

    def judge(updates, subs, full, factor, recent=None, **kw):
        v = real(updates, subs, full, factor, recent, **kw)
        if factor is not None and recent is None:   # what the screen decided: (level, figure, clip reference)
            level = {str(u.client): server_step.level_key(u) for u in updates}
            seen.extend((server_step.level_key(u), r, ref) for u, r, ref in zip(v.accepted, v.rms, v.refs))
            seen.extend((level[c], None, None) for c in v.rejected)   # rejected (honest runs: beyond 3x)
        return v
    judge.real = real
    server_step.judge = judge
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/demo.yaml", [f"method={method}", f"seed={seed}", "threads=1",
                                                "checkpoint_every=0", "eval_every=20", f"out={out}", *extra])
        summary = run_experiment(cfg, progress=False)
    return seen, {lv: v["global_acc"] for lv, v in summary["final"]["levels"].items()}


def paired(a: list[float], b: list[float]) -> str:
    """Mean of b - a in points, and the two-sided paired t-test's p."""
    from scipy.stats import ttest_rel
    d = 100 * (np.array(b) - np.array(a))
    p = ttest_rel(b, a).pvalue if len(d) > 1 and d.std() > 0 else float("nan")
    return f"{d.mean():+.2f} (p {p:.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=["fedlase", "fiarse"])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    specs = [(m, s, p, args.overrides) for m in args.methods for s in args.seeds for p in (True, False)]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        results = pool.map(one_run, specs, chunksize=1)
    figures, acc = defaultdict(list), defaultdict(list)
    for (method, _, per_level, _), (seen, levels) in zip(specs, results):
        for lv, r, clip in seen:
            figures[method, lv, per_level].append((r, clip))
        for lv, a in levels.items():
            acc[method, lv, per_level].append(a)
    keys = sorted({(m, lv) for m, lv, _ in figures}, key=lambda k: (k[0], Fraction(k[1])))
    print(f"seeds {args.seeds}; updates pooled over them\n")
    print("| method | level | updates | per level: rejected (>3x) | clipped | norm kept "
          "| round's: rejected (>3x) | clipped | norm kept |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, lv in keys:
        cells = []
        for per_level in (True, False):
            rows = figures[method, lv, per_level]
            accepted = [(r, clip) for r, clip in rows if r is not None]
            kept = sum(min(1.0, clip / r) for r, clip in accepted) / max(len(accepted), 1)
            cells += [f"{100 * (len(rows) - len(accepted)) / len(rows):.1f}%",
                      f"{100 * sum(r > clip for r, clip in accepted) / max(len(accepted), 1):.0f}%", f"{kept:.2f}"]
        print(f"| {method} | {lv} | {len(figures[method, lv, True])} | " + " | ".join(cells) + " |")
    print("\n| method | level | global acc, per level (%) | round's (%) | per level - round's, points (paired) |")
    print("|---|---|---|---|---|")
    for method, lv in keys:
        a, b = acc[method, lv, False], acc[method, lv, True]
        print(f"| {method} | {lv} | {' / '.join(f'{100 * x:.1f}' for x in b)} | "
              f"{' / '.join(f'{100 * x:.1f}' for x in a)} | {paired(a, b)} |")
    for method in args.methods:
        levels = [lv for m, lv in keys if m == method]
        a, b = ([float(np.mean([acc[method, lv, p][i] for lv in levels])) for i in range(len(args.seeds))]
                for p in (False, True))
        print(f"| {method} | mean | {' / '.join(f'{100 * x:.1f}' for x in b)} | "
              f"{' / '.join(f'{100 * x:.1f}' for x in a)} | {paired(a, b)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
