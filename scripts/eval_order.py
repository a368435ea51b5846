"""How much the evaluation batch composition moves accuracy (docs/methods.md, `eval_order`).

Evaluates every finished run under a sweep folder again with eval_order=clients (the official FIARSE order:
the clients' test parts joined in client order, batches of 20) and prints, per method, the mean global and
local accuracy under both orders (the `test` figures are the runs' own final evaluations).

    python scripts/eval_order.py runs/regime
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from fedlase.engine import evaluate_run
from fedlase.report_tables import markdown_table


def main(folder: str) -> None:
    torch.set_num_threads(1)
    by_method: dict[str, list] = defaultdict(list)
    for summary in sorted(Path(folder).glob("*/summary.json")):
        run = summary.parent
        final = json.loads(summary.read_text())["final"]
        cached = run / "eval-clients.json"   # evaluations are deterministic: reuse one made before
        if cached.is_file():
            clients = json.loads(cached.read_text())
        else:
            clients = evaluate_run(run, ["eval_order=clients", "threads=1"])
            cached.write_text(json.dumps(clients))
        method = json.loads((run / "config.json").read_text())["method"]
        by_method[method].append((final, clients))
        print(f"{run.name}: global {final['global_acc']:.4f} -> {clients['global_acc']:.4f}", file=sys.stderr)
    rows = []
    for method, pairs in by_method.items():
        def col(key, i):
            v = 100 * np.array([p[i][key] for p in pairs])
            return f"{v.mean():.2f}"
        diff = 100 * np.array([p[1]["global_acc"] - p[0]["global_acc"] for p in pairs])
        rows.append([method, str(len(pairs)), col("global_acc", 0), col("global_acc", 1),
                     f"{diff.mean():+.2f} ({diff.min():+.2f} to {diff.max():+.2f})",
                     col("local_acc", 0), col("local_acc", 1)])
    print(markdown_table(["method", "runs", "global, test order", "global, clients order", "difference (range)",
                          "local, test order", "local, clients order"], rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/regime")
