"""The ServerApp: the embedded engine's run loop (`run_experiment`: metrics.jsonl, checkpoints, resume,
summary.json, central evaluation) with each round's training done by Flower nodes through
`SubmodelStrategy`."""
from __future__ import annotations

import json

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from ..config import config_from_dict
from ..engine import Experiment, run_experiment
from .strategy import SubmodelStrategy

app = ServerApp()


class FlowerExperiment(Experiment):
    """An Experiment whose rounds are trained by Flower nodes; sampling, submodels, aggregation and
    evaluation stay the Experiment's own."""

    def __init__(self, cfg, grid: Grid):
        super().__init__(cfg)
        self.grid = grid
        self.strategy = SubmodelStrategy(self, cfg.min_replies, cfg.reply_timeout)
        self.bytes_total = {"sent": 0, "received": 0}

    def run_round(self, rnd: int) -> dict:
        old = self.params
        msgs = list(self.strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), self.grid))
        replies = self.grid.send_and_receive(msgs, timeout=self.cfg.reply_timeout) if msgs else []
        self.strategy.aggregate_train(rnd, replies)
        last = self.strategy.last
        for key in self.bytes_total:
            self.bytes_total[key] += last["bytes"][key]
        if not last.get("skipped"):   # analyses see the clients that were aggregated
            for t in self.trackers:
                t.on_round(rnd, last["accepted"], last["submodels"], old, self.params)
        out = {k: last[k] for k in ("train_loss", "clients", "failed", "rejected", "bytes")}
        out["sampled"] = len(last["sampled"])
        out["rejected"] = {str(k): v for k, v in out["rejected"].items()}
        return {**out, "bytes_total": dict(self.bytes_total)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bytes_total": dict(self.bytes_total)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.bytes_total = dict(state.get("bytes_total", self.bytes_total))


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = config_from_dict(json.loads(str(context.run_config["fedlase-config"])))
    run_experiment(cfg, resume=bool(context.run_config.get("resume", False)),
                   progress=bool(context.run_config.get("progress", False)),
                   experiment=lambda c: FlowerExperiment(c, grid))
