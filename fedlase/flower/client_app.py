"""The ClientApp: a node answers who it is (QUERY) and trains the submodel it is sent (TRAIN).

Training is the embedded engine's own `Experiment.client_update` (same data partition, same seeded batches,
same `local_train`) on the global model rebuilt from the sparse payload, so a node computes the very delta
the embedded engine would."""
from __future__ import annotations

import json

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..config import config_from_dict, parse_level
from ..engine import Experiment
from .codec import decode_submodel, encode_delta

app = ClientApp()

# One Experiment (data, partition, model) per process and config: a Ray actor in the Simulation Engine
# serves many messages and should not reload the data for each.
_CACHE: dict[str, Experiment] = {}


def _experiment(context: Context) -> Experiment:
    text = str(context.run_config["fedlase-config"])
    if text not in _CACHE:
        _CACHE.clear()
        _CACHE[text] = Experiment(config_from_dict(json.loads(text)))
    return _CACHE[text]


def identity(context: Context, num_clients: int, client_levels: list[float]) -> tuple[int, float]:
    """(partition id, level) of this node: the level from its node config (`level=1/4`, Deployment Engine),
    else from the run config's system spec at its partition id (Simulation Engine)."""
    if "partition-id" not in context.node_config:
        raise ValueError("node config has no partition-id; start the SuperNode with "
                         "--node-config \"partition-id=0 level='1/4'\"")
    pid = int(context.node_config["partition-id"])
    if not 0 <= pid < num_clients:
        raise ValueError(f"partition-id {pid} is outside 0..{num_clients - 1} (the run has {num_clients} clients)")
    level = context.node_config.get("level")
    return pid, parse_level(str(level)) if level is not None else client_levels[pid]


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg = config_from_dict(json.loads(str(context.run_config["fedlase-config"])))
    pid, level = identity(context, cfg.num_clients, cfg.client_levels)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": pid, "level": level})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    exp = _experiment(context)
    pid, _ = identity(context, exp.cfg.num_clients, exp.cfg.client_levels)
    task = msg.content.config_records["task"]
    rnd = int(task["round"])
    if int(task["partition-id"]) != pid:   # the server's map is stale (e.g. a node restarted with another id)
        raise ValueError(f"sent partition {task['partition-id']}'s work, but this node is partition {pid}")
    params, buffers, sub = decode_submodel(msg.content, exp.params)
    exp.params = {n: p.to(exp.device) for n, p in params.items()}
    exp.buffers = {n: b.to(exp.device) for n, b in buffers.items()}
    sub = sub.to(exp.device)
    delta, loss = exp.client_update(pid, sub, rnd)
    content = RecordDict({"delta": encode_delta(delta, sub),
                          "metrics": MetricRecord({"train-loss": loss, "partition-id": pid, "round": rnd})})
    return Message(content, reply_to=msg)
