"""The ClientApp: a node answers who it is (QUERY) and trains the submodel it is sent (TRAIN).

It builds only what a client needs (fedlase/flower/node_data.py: its own samples, cut once from the whole
dataset and read from a node-local cache after; the model; the trainer; each message carries its submodel, and only
a submodel that trains with its method's own local objective, which is code and is not sent, has the node build
its own copy of the method to rebuild it: `with_objective`) and trains with `fedlase.client.ClientTrainer.update`
(same seeded batches, same `local_train` as the embedded engine), so a node computes the very delta the embedded
engine would.

The Deployment Engine starts a process per message, so this module imports only Flower at load time: a QUERY
answers from the node config alone (no config parsing, no torch). A TRAIN message goes to the node's warm worker
when its node config names one (`worker-dir`, fedlase/flower/worker.py): the arrays travel over a private Unix
socket and the worker, which keeps torch, the partition and the model, trains with the very functions below
(`train_content`), so this process never imports torch. Without a worker, or refused by it, the message trains
here as before (said once in the node's log). A TRAIN message's steps (`trainer_for`, `decode`, `train_step`,
the reply's `reply_content`) run in `train_content`, which times each when asked (`times`), so that a tool times
the very path a node takes (tools/flower_profile.py) without reaching into this module."""
from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()

# Per process: the config and each partition's trainer. A Ray actor of the Simulation Engine serves many
# messages and partitions; a Deployment Engine process serves one message.
_CACHE: dict = {}


def context_config(context: Context):
    """The run's fedlase config, read from Flower's Context (its run config; fedlase.dispatch.run_config is the
    other thing: it runs a config), built-ins registered first (a program's edge). It is read, not validated
    again: the server validated it before submitting, and validation's size check builds the model on the meta
    device, which imports torch._dynamo (1-4 s) in every ClientApp process, that is for every message."""
    return config_of(str(context.run_config["fedlase-config"]))


def config_of(text: str):
    """The config a run's `fedlase-config` text holds, parsed once per process (the worker's too)."""
    if _CACHE.get("text") != text:
        import json

        from ..catalog import load_builtins
        from ..config import config_from_dict
        load_builtins()
        cfg = config_from_dict(json.loads(text), validate_=False)
        _CACHE.clear()
        _CACHE.update(text=text, cfg=cfg, trainers={}, methods={})
    return _CACHE["cfg"]


def partition_id(context: Context) -> int:
    """This node's partition id, from its node config (`--node-config "partition-id=0 level='1/4'"`)."""
    if "partition-id" not in context.node_config:
        raise ValueError("node config has no partition-id; start the SuperNode with "
                         "--node-config \"partition-id=0 level='1/4'\"")
    return int(context.node_config["partition-id"])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Who this node says it is: its partition id and, if its node config names one, its level (the server
    checks both against the run's config and, with pinned partitions, against the node's key)."""
    node = {"partition-id": partition_id(context)}
    if "level" in context.node_config:
        node["level"] = str(context.node_config["level"])
    return Message(RecordDict({"node": ConfigRecord(node)}), reply_to=msg)


def trainer_for(cfg, pid: int):
    """Partition `pid`'s trainer, built once per process (its samples from the node cache, the model)."""
    trainers = _CACHE["trainers"]
    if pid not in trainers:
        from .. import determinism
        from ..client import pick_device
        determinism.apply(cfg.deterministic)   # as the embedded engine does, before this process touches CUDA
        from .node_data import client_dataset, client_trainer
        trainers[pid] = client_trainer(cfg, pid, pick_device(cfg.device), data=client_dataset(cfg, pid))
    return trainers[pid]


def method_for(cfg, pid: int):
    """The run's method, built on partition `pid`'s model as the server built it (once per process): only what
    rebuilds a local objective is read of it (`with_objective`); it holds no server state (no data is bound)."""
    methods = _CACHE.setdefault("methods", {})
    if pid not in methods:
        from ..model_facts import ModelFacts
        from ..registry import METHODS
        from .node_data import client_dataset
        model = trainer_for(cfg, pid).model
        facts = ModelFacts.of(model, client_dataset(cfg, pid))
        methods[pid] = METHODS.get(cfg.method).build(model, cfg.levels, facts, run_seed=cfg.seed, **cfg.method_args)
    return methods[pid]


def with_objective(cfg, pid: int, content: RecordDict, params: dict, sub, rnd: int):
    """The submodel with the local objective its method trains it with (FjORD's widths, DepthFL's exits, FedDSE's
    channels chosen on the node's data), which the message does not carry: the node's own copy of the method
    (`method_for`) builds the submodel of the client's level (the task's) and round, as the server did, and its
    objective is taken. Only methods whose objective is a function of the config, the level, the round and the
    model run on Flower (their `runs_on`); one that reads the server's state (RecipFL's hypernetwork) does not."""
    import dataclasses
    level = cfg.levels.find(str(content.config_records["task"]["level"]))
    return dataclasses.replace(sub, local=method_for(cfg, pid).submodel(params, level, rnd).local)


def decode(msg: Message | RecordDict, trainer):
    """The submodel and global parameters the message (or its content) carries, on the trainer's device: the
    trainable ones only (a LoRA run's frozen base is the node's own, never sent)."""
    from ..train import trainable
    from .codec import decode_submodel
    content = msg.content if isinstance(msg, Message) else msg
    params, buffers, sub = decode_submodel(content, trainable(trainer.model))
    dev = trainer.x.device
    return {n: p.to(dev) for n, p in params.items()}, {n: b.to(dev) for n, b in buffers.items()}, sub.to(dev)


def base_refusal(task, model) -> str | None:
    """Why this node must not train the task (None: it may): the server's frozen base (`frozen-*` in the task, a
    LoRA run's) is not the one this node built from the same config (another model file, another revision), and
    adapters trained on another base would be averaged into the server's as if they fitted it."""
    if "frozen-sha256" not in task:
        return None
    from ..model_facts import frozen_fingerprint
    mine = frozen_fingerprint(model)   # hashed once per process and base (fedlase/model_facts.py)
    theirs = {"frozen": int(task["frozen-count"]), "sha256": str(task["frozen-sha256"])}
    if mine == theirs:
        return None
    held = "no frozen base" if mine is None else f"{mine['frozen']} parameters, sha256 {mine['sha256'][:16]}"
    return (f"its frozen base ({held}) is not the server's ({theirs['frozen']} parameters, sha256 "
            f"{theirs['sha256'][:16]}): give the node the server's model file (model/model_path) and revision")


def train_step(trainer, pid: int, rnd: int, params: dict, buffers: dict, sub) -> tuple[dict, float]:
    return trainer.update(pid, params, buffers, sub, rnd)


def reply_content(delta: dict, sub, loss: float, pid: int, rnd: int) -> RecordDict:
    from .codec import encode_delta
    return RecordDict({"delta": encode_delta(delta, sub),
                       "metrics": MetricRecord({"train-loss": loss, "partition-id": pid, "round": rnd})})


def train_content(cfg, content: RecordDict, pid: int, rnd: int, times: dict | None = None) -> RecordDict:
    """A TRAIN message's reply content, computed here or in the node's worker (`times`: seconds per step)."""
    import time
    t = time.perf_counter()

    def lap(step):
        nonlocal t
        if times is not None:
            now = time.perf_counter()
            times[step], t = now - t, now
    trainer = trainer_for(cfg, pid)
    lap("trainer")
    task = content.config_records["task"]
    why = base_refusal(task, trainer.model)
    if why is not None:   # a reply, not an error: it reaches the server's round line whichever path trained
        return RecordDict({"refused": ConfigRecord({"reason": why, "partition-id": pid, "round": rnd})})
    params, buffers, sub = decode(content, trainer)
    from .codec import has_objective
    if has_objective(content):   # not sent: rebuilt here
        sub = with_objective(cfg, pid, content, params, sub, rnd)
    lap("decode")
    delta, loss = train_step(trainer, pid, rnd, params, buffers, sub)
    if "dp-clip" in task:   # differential privacy: the node clips its update before it replies
        from ..privacy import clip
        delta, _ = clip(delta, float(task["dp-clip"]))
    lap("train")
    out = reply_content(delta, sub, loss, pid, rnd)
    lap("encode")
    return out


def task_ids(content: RecordDict, pid: int) -> tuple[int, int]:
    """(partition id, round) of a TRAIN message's content, refused if it was meant for a partition not `pid`."""
    task = content.config_records["task"]
    if int(task["partition-id"]) != pid:   # the server's map is stale (e.g. a node restarted with another id)
        raise ValueError(f"sent partition {task['partition-id']}'s work, but this node is partition {pid}")
    return pid, int(task["round"])


def task_of(msg: Message, context: Context) -> tuple[int, int]:
    """(partition id, round) of a TRAIN message, refused if it was meant for another partition."""
    return task_ids(msg.content, partition_id(context))


def via_worker(msg: Message, context: Context, pid: int) -> tuple[dict, RecordDict] | None:
    """The node's worker's (header, reply content) for this message, or None if the node names no worker
    (`worker-dir` in its node config) or it cannot be used, which is said once in the node's log."""
    folder = context.node_config.get("worker-dir")
    if not folder:
        return None
    from .worker_link import WorkerError, ask, say_once
    try:
        return ask(str(folder), context.run_id, pid, str(context.run_config["fedlase-config"]), msg.content)
    except WorkerError as e:
        say_once(str(folder), context.run_id, str(e))
        return None


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid, rnd = task_of(msg, context)
    warm = via_worker(msg, context, pid)
    if warm is not None:
        return Message(warm[1], reply_to=msg)
    return Message(train_content(context_config(context), msg.content, pid, rnd), reply_to=msg)
