"""The ServerApp: the engine's run loop (`run_experiment`: metrics.jsonl, checkpoints, resume, summary.json,
central evaluation) with each round's clients trained on Flower nodes by the `NodeRounds` runner, which admits
for each partition only the node key pinned to it (`partition-keys` in the run config, written by the
submitter from `node_keys`). Under schedule=fedbuff the same runner's `async_schedule` (fedlase/flower/buffered.py)
takes the rounds' place: a server step every `buffer` replies, in the order they come."""
from __future__ import annotations

import json

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..catalog import load_builtins
from ..config import config_from_dict
from ..engine import run_experiment
from ..simtime import clock_for
from .rounds import NodeRounds

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    load_builtins()   # a program's edge: the config names registered choices
    cfg = config_from_dict(json.loads(str(context.run_config["fedlase-config"])))
    run_experiment(cfg, resume=bool(context.run_config.get("resume", False)),
                   progress=bool(context.run_config.get("progress", False)),
                   runner=NodeRounds(grid, cfg.reply_timeout,
                                     pins=json.loads(str(context.run_config.get("partition-keys", "{}")))),
                   clock=clock_for)
