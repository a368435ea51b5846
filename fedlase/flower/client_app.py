"""The ClientApp: a node answers who it is (QUERY) and trains the submodel it is sent (TRAIN).

It builds only what a client needs (fedlase/flower/node_data.py: its own samples from a node-local cache, the
model, the trainer) and trains with the engine's own `ClientTrainer.update` (same seeded batches, same
`local_train`), so a node computes the very delta the embedded engine would.

`FEDLASE_PROFILE=1` in a node's environment: each message writes one line to stderr saying where its time
went (docs/flower.md, "What a message costs"); timers only, the result is the same."""
from __future__ import annotations

import json
import os
import sys
import time

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..catalog import load_builtins
from ..config import config_from_dict
from ..client import pick_device
from .codec import decode_submodel, encode_delta
from .node_data import client_dataset, client_trainer

app = ClientApp()
_PROFILE: dict | None = {"imported": time.time()} if os.environ.get("FEDLASE_PROFILE") == "1" else None

# Per process: the config and each partition's trainer. A Ray actor of the Simulation Engine serves many
# messages and partitions; a Deployment Engine process serves one message.
_CACHE: dict = {}


def _config(context: Context):
    text = str(context.run_config["fedlase-config"])
    if _CACHE.get("text") != text:
        load_builtins()   # a program's edge: the config names registered choices
        _CACHE.clear()
        _CACHE.update(text=text, cfg=config_from_dict(json.loads(text)), trainers={})
    return _CACHE["cfg"]


def identity(context: Context, cfg) -> tuple[int, str]:
    """(partition id, level name) of this node: the level from its node config (`level=1/4`, Deployment
    Engine), else from the run config's system at its partition id (Simulation Engine)."""
    if "partition-id" not in context.node_config:
        raise ValueError("node config has no partition-id; start the SuperNode with "
                         "--node-config \"partition-id=0 level='1/4'\"")
    pid = int(context.node_config["partition-id"])
    if not 0 <= pid < cfg.num_clients:
        raise ValueError(f"partition-id {pid} is outside 0..{cfg.num_clients - 1} (the run has {cfg.num_clients} clients)")
    level = context.node_config.get("level")
    if level is not None:
        return pid, str(level)
    return pid, cfg.levels.level_of(pid).name


@app.query()
def query(msg: Message, context: Context) -> Message:
    clock = _Clock(msg)
    pid, level = identity(context, _config(context))
    clock("config", done=True)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": pid, "level": level})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    clock = _Clock(msg)
    cfg = _config(context)
    pid, _ = identity(context, cfg)
    task = msg.content.config_records["task"]
    rnd = int(task["round"])
    if int(task["partition-id"]) != pid:   # the server's map is stale (e.g. a node restarted with another id)
        raise ValueError(f"sent partition {task['partition-id']}'s work, but this node is partition {pid}")
    clock("config")
    trainers = _CACHE["trainers"]
    if pid not in trainers:
        data = client_dataset(cfg, pid)
        clock("data")
        trainers[pid] = client_trainer(cfg, pid, pick_device(cfg.device), data=data)
        clock("model")
    trainer = trainers[pid]
    template = {n: p for n, p in trainer.model.named_parameters()}
    params, buffers, sub = decode_submodel(msg.content, template)
    dev = trainer.x.device
    clock("decode")
    if cfg.optimizer == "adamw":   # only torch.optim pays this; fedlase's SGD does not import torch._dynamo
        clock.optim()
    delta, loss = trainer.update(pid, {n: p.to(dev) for n, p in params.items()},
                                 {n: b.to(dev) for n, b in buffers.items()}, sub.to(dev), rnd)
    clock("train")
    content = RecordDict({"delta": encode_delta(delta, sub),
                          "metrics": MetricRecord({"train-loss": loss, "partition-id": pid, "round": rnd})})
    clock("encode", done=True)
    return Message(content, reply_to=msg)


class _Clock:
    """FEDLASE_PROFILE=1: seconds per step of this message, written as one stderr line. In a `flwr-clientapp`
    process (Deployment Engine, one message each) the line is written at exit and also holds `start` (process
    start -> this module imported: interpreter, flwr's imports, pulling the message, the app bundle's install,
    fedlase's and torch's imports; PYTHONPROFILEIMPORTTIME=1 splits the imports), `wait` (-> the handler)
    and `reply` (the reply's push and the process's exit)."""

    def __init__(self, msg: Message):
        self.on, self.steps, self.t = _PROFILE is not None, {}, time.time()
        if self.on:
            _PROFILE.setdefault("message", self.t)
        self.kind = f"{msg.metadata.message_type} round={msg.metadata.group_id or '-'}"

    def optim(self) -> None:
        """torch.optim (AdamW here) imports torch._dynamo (about 1-2 s) at a process's first optimizer: time it
        apart."""
        if self.on and "torch._dynamo" not in sys.modules:
            import torch._dynamo  # noqa: F401
            self("optim")

    def __call__(self, step: str, done: bool = False) -> None:
        if not self.on:
            return
        now = time.time()
        self.steps[step], self.t = now - self.t, now
        if not done:
            return
        if os.path.basename(sys.argv[0]) != "flwr-clientapp":   # a Ray actor serves many messages
            return self.write(self.steps)
        import atexit
        import psutil
        p = _PROFILE
        first = {"start": p["imported"] - psutil.Process().create_time(), "wait": p["message"] - p["imported"]}
        atexit.register(lambda: self.write({**first, **self.steps, "reply": time.time() - now},
                                           total=time.time() - psutil.Process().create_time()))

    def write(self, steps: dict, total: float | None = None) -> None:
        line = " ".join(f"{k}={v:.3f}" for k, v in steps.items())
        total = f" total={total:.3f}" if total is not None else ""
        print(f"fedlase-profile pid={os.getpid()} {self.kind} {line}{total}", file=sys.stderr, flush=True)
