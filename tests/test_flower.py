"""fedlase on Flower: payload codec, reply checks, the strategy's round against the embedded engine's (all
in-process), then real Simulation Engine and Deployment Engine runs in subprocesses, compared bit for bit
with the embedded engine. Select with `-m flower`, skip with `-m "not flower"`."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

# Nodes cache their samples (fedlase/flower/node_data.py); keep the tests' cache out of the home folder.
os.environ.setdefault("FEDLASE_CACHE", str(Path(__import__("tempfile").mkdtemp(prefix="fedlase-cache-"))))
pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment  # noqa: E402
from fedlase.flower import (
    QUIET_ENV,  # noqa: E402
    client_app,  # noqa: E402
)
from fedlase.flower.codec import ReplyError, decode_submodel, encode_delta, encode_submodel, validate_reply  # noqa: E402
from fedlase.flower.rounds import NodeRounds  # noqa: E402
from fedlase.masks import Submodel  # noqa: E402

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]
# Small enough for 2 shared cores: digits, a quarter-width CNN, 2 local steps.
SMALL = ["dataset=digits", "model=cnn", "width=0.25", "local_steps=2", "batch_size=16", "lr=0.05", "threads=1",
         "device=cpu", "checkpoint_every=1", "participation=1", "eval_every=1"]


def small_cfg(tmp_path, *overrides, out="run"):
    return load_config(None, [*SMALL, f"out={tmp_path / out}", *overrides])


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


TAG = "FEDLASE_TEST_RUN"   # set in a test's environment; every process it starts, and theirs, inherits it


def flower_processes(tag: str | None = None) -> set[int]:
    """Pids of live processes that look like Flower, Ray, nginx or fedlase worker ones (with `tag`: only those
    whose environment carries it, so that other sessions' runs on the same machine are not counted)."""
    import psutil
    keys = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp",
            "raylet", "gcs_server", "ray::", "ray/_private", "default_worker.py", "nginx: ", "fedlase.flower.worker",
            "fedlase-worker")
    found = set()
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE or not any(k in " ".join(p.cmdline()) for k in keys):
                continue
            if tag is None or p.environ().get(TAG) == tag:
                found.add(p.pid)
        except psutil.Error:
            pass
    return found


def assert_none_left(tag: str, grace: float = 20.0) -> None:
    """Fails if Flower, Ray or nginx processes carrying `tag` are still there after `grace` seconds."""
    deadline = time.monotonic() + grace
    while (left := flower_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind: {sorted(left)}"


@pytest.fixture
def no_leftovers(monkeypatch):
    """Fails the test if Flower, Ray or nginx processes it started are still there (after a grace period)."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    yield
    assert_none_left(tag)


@pytest.fixture
def task_identity():
    """Messages built outside a Flower process need a task identity."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


# ---- payload codec ---------------------------------------------------------------------------------------------
METHODS = ["fiarse", "fedlase", "heterofl", "fedrolex", "fedavg", "fedavg_small"]


@pytest.mark.parametrize("method", [*METHODS, "fiarse method_args.ste=fixed"])
def test_submodel_round_trip_is_exact(tmp_path, method):
    name, *args = method.split()
    exp = Experiment.from_config(small_cfg(tmp_path, "system={1,1/4}_{1,1}", f"method={name}", *args))
    sub = exp.method.submodel(exp.params, 0.25, 3)
    params, buffers, back = decode_submodel(encode_submodel(exp.params, exp.buffers, sub), exp.params)
    assert back.thresholds == sub.thresholds and back.ste == sub.ste
    assert all(torch.equal(back.masks[n], sub.masks[n]) for n in sub.masks)
    assert same_params(buffers, exp.buffers)
    # the client's masked forward sees exactly what it would see with the whole model
    with torch.no_grad():
        assert same_params(back.apply(params), sub.apply(exp.params))
    assert same_params(back.buffers, sub.buffers)
    delta = {n: torch.randn_like(p) * (sub.masks[n] if n in sub.masks else 1) for n, p in exp.params.items()}
    assert same_params(validate_reply(encode_delta(delta, sub), exp.params, sub), delta)


def test_credited_mask_travels_when_it_differs_from_the_threshold_support():
    w = torch.tensor([[0.5, -0.1, 0.9], [0.05, -0.7, 0.2]])
    mask = torch.tensor([[True, False, False], [False, True, False]])   # 0.9 is above tau but not credited
    sub = Submodel({"w": mask}, thresholds={"w": 0.4})
    params, _, back = decode_submodel(encode_submodel({"w": w}, {}, sub), {"w": w})
    assert torch.equal(back.masks["w"], mask)
    assert torch.equal(params["w"], w * (w.abs() >= 0.4))


# ---- reply checks ----------------------------------------------------------------------------------------------
def _spoil(kind: str, arrays: ArrayRecord, params: dict, sub: Submodel) -> str:
    """Spoil a good reply in one way; return a fragment of the expected error."""
    masked = next(n for n in params if n in sub.masks)
    dense = next((n for n in params if n not in sub.masks), masked)
    v = arrays[masked].numpy()
    if kind == "shape":
        arrays[dense] = Array(arrays[dense].numpy().reshape(1, -1))
        return "shape"
    if kind == "dtype":
        arrays[masked] = Array(v.astype("float64"))
        return "dtype"
    if kind in ("nan", "inf"):
        v = v.copy()
        v[0] = float(kind)
        arrays[masked] = Array(v)
        return "NaN or Inf"
    if kind == "outside-mask":
        full = torch.zeros(params[masked].shape)
        full[~sub.masks[masked]] = 1.0
        arrays[masked] = Array(full.numpy())
        return "outside the client's mask"
    if kind == "dense":   # a whole delta, zero off the mask: still more than the submodel allows
        full = torch.zeros(params[masked].shape)
        full[sub.masks[masked]] = torch.from_numpy(v)
        arrays[masked] = Array(full.numpy())
        return "larger than"
    if kind == "oversized":   # declares the right shape but carries far more bytes
        a = arrays[masked]
        arrays[masked] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data + bytes(1 << 16))
        return "larger than"
    if kind == "longer":
        arrays[masked] = Array(torch.cat([torch.from_numpy(v), torch.zeros(5)]).numpy())
        return "shape"
    if kind == "unknown":
        arrays["extra.weight"] = Array(v)
        return "unknown parameter"
    if kind == "missing":
        del arrays[masked]
        return "missing parameter"
    raise AssertionError(kind)


BAD = ["shape", "dtype", "nan", "inf", "outside-mask", "dense", "oversized", "longer", "unknown", "missing"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_reply_is_rejected(tmp_path, kind):
    exp = Experiment.from_config(small_cfg(tmp_path, "system={1,1/4}_{1,1}"))
    sub = exp.method.submodel(exp.params, 0.25, 1)
    delta, _ = exp.trainer.update(1, exp.params, exp.buffers, sub, 1)
    arrays = encode_delta(delta, sub)
    expected = _spoil(kind, arrays, exp.params, sub)
    with pytest.raises(ReplyError, match=expected):
        validate_reply(arrays, exp.params, sub)


# ---- the strategy's round, in-process ----------------------------------------------------------------------
class LocalGrid:
    """A Grid that delivers messages by calling the ClientApp's functions in this process."""

    def __init__(self, cfg, first_node=100):
        self.run_config = {"fedlase-config": json.dumps(cfg.to_dict(), default=str)}
        self.nodes = {first_node + p: p for p in range(cfg.num_clients)}

    def context(self, node):
        return Context(run_id=1, node_id=node, node_config={"partition-id": self.nodes[node]}, state=RecordDict(),
                       run_config=self.run_config)

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, *, timeout=None, dead=()):
        """Replies as Flower gives them; for a node in `dead`, the SuperLink's error reply (sent as node 1)."""
        fns, out = {"query": client_app.query, "train": client_app.train}, []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex   # as a Grid does when it pushes
            if self.nodes[m.metadata.dst_node_id] in dead:
                reply = Message(Error(code=0, reason="node unavailable"), reply_to=m)
                reply.metadata.__dict__["_src_node_id"] = 1
            else:
                reply = fns[m.metadata.message_type](m, self.context(m.metadata.dst_node_id))
            out.append(reply)
        return out


def _round(cfg, rnd=1, spoil=None, drop=(), dead=()):
    """One Flower round in-process; spoil: (partition, kind) makes that client's reply bad; drop: partitions
    whose replies never arrive; dead: partitions whose node died (the SuperLink answers with an error).
    Returns the new global params and the round's statistics."""
    exp, stats = _round_run(cfg, rnd, spoil, drop, dead)
    return exp.params, stats


def _round_run(cfg, rnd=1, spoil=None, drop=(), dead=()):
    """`_round`, returning the run (its Experiment) instead of its params."""
    grid = LocalGrid(cfg)
    runner = NodeRounds(grid)

    def deliver(msgs, timeout=None):
        if not msgs or msgs[0].metadata.message_type != "train":   # QUERY: every node answers
            return grid.send_and_receive(msgs)
        replies = grid.send_and_receive(msgs, dead=dead)
        replies = [r for r in replies if r.has_error() or grid.nodes[r.metadata.src_node_id] not in drop]
        if spoil is not None:
            sent, _, sub, _ = runner.pending[spoil[0]]
            reply = next(r for r in replies if r.metadata.reply_to_message_id == sent.metadata.message_id)
            _spoil(spoil[1], reply.content.array_records["delta"], exp.params, sub)
        return replies

    runner.grid = type("Wire", (), {"send_and_receive": staticmethod(deliver), "get_node_ids": grid.get_node_ids})()
    exp = Experiment.from_config(cfg, runner)
    stats = exp.run_round(rnd)   # the engine's line ("skipped" under min_replies) over the runner's details
    return exp, stats


def _embedded(cfg, rnd=1, without=(), rounds=None):
    """The embedded engine's round `rnd` (or its `rounds`, one after another), with clients taken out of the
    sample: `without` holds client ids (out of every round run) or (round, client) pairs (out of that round)."""
    return _embedded_run(cfg, rnd, without, rounds).params


def _embedded_run(cfg, rnd=1, without=(), rounds=None):
    """`_embedded`, returning the run (its Experiment) instead of its params."""
    exp = Experiment.from_config(cfg)
    sample = exp.sample
    exp.sample = lambda r: [(c, lvl) for c, lvl in sample(r) if c not in without and (r, c) not in without]
    for r in rounds or (rnd,):
        exp.run_round(r)
    return exp


@pytest.mark.parametrize("method", METHODS)
def test_strategy_round_equals_the_embedded_round(tmp_path, task_identity, method):
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}", f"method={method}")
    params, stats = _round(cfg, rnd=3)
    assert stats["clients"] == 3 and not stats["failed"] and not stats["rejected"]
    assert same_params(params, _embedded(cfg, rnd=3))
    b = stats["bytes"]
    assert b["levels"]["1/4"]["clients"] == 2 and b["sent"] <= b["dense_sent"] + 3 * 4096
    per_client = {lvl: row["sent"] / row["clients"] for lvl, row in b["levels"].items()}
    if not method.startswith("fedavg"):   # the FedAvg baselines send every client the same model
        assert 0 < per_client["1/4"] < per_client["1"] and b["received"] < b["dense_received"]


@pytest.mark.parametrize("method", ["fjord method_args.widths=uniform5 method_args.distill=true",
                                    "depthfl method_args.heads=linear method_args.kd_rampup=2", "fedlmt"])
def test_a_local_objective_is_rebuilt_on_the_node(tmp_path, task_identity, method, monkeypatch):
    """FjORD's widths and DepthFL's exits are code, not arrays, and are not sent: each node rebuilds its client's
    objective with its own copy of the method, and the round equals the embedded engine's bit for bit (a node
    that trained without it would not). FedLMT (no objective: every client the same factorized model) too."""
    name, *args = method.split()
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}", f"method={name}", *args)
    params, stats = _round(cfg, rnd=3)
    assert stats["clients"] == 3 and not stats["failed"] and not stats["rejected"]
    embedded = _embedded(cfg, rnd=3)
    assert same_params(params, embedded)
    if name == "fedlmt":
        return
    monkeypatch.setattr(client_app, "with_objective", lambda cfg, pid, content, params, sub, rnd: sub)
    plain, _ = _round(cfg, rnd=3)
    assert not same_params(plain, embedded)


def test_feddse_choices_travel_in_the_replies(tmp_path, task_identity, monkeypatch):
    """FedDSE's clients choose their channels on their own data, on the node, and send the choice in their reply
    beside the delta: the round and the counts its levels are evaluated with (hence their evaluation submodels)
    equal the embedded engine's bit for bit. A node that trained without the objective sends no choice, and its
    reply is rejected for the missing tensors."""
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}", "method=feddse", "method_args.samples=16")
    exp, stats = _round_run(cfg, rnd=3)
    assert stats["clients"] == 3 and not stats["failed"] and not stats["rejected"]
    embedded = _embedded_run(cfg, rnd=3)
    assert same_params(exp.params, embedded.params)
    quarter = exp.levels[1]
    (rnd, counts), (rnd_e, counts_e) = exp.method.counts[quarter.index], embedded.method.counts[quarter.index]
    assert rnd == rnd_e == 3 and counts.keys() == counts_e.keys() and len(counts) > 1
    assert all(torch.equal(counts[g], counts_e[g]) and int(counts[g].sum()) == 2 * math.ceil(counts[g].numel() / 2)
               for g in counts)   # two clients of 1/4, each keeping half of every group
    assert all(torch.equal(a, b) for a, b in zip(exp.method.eval_submodel(exp.params, quarter, 3).masks.values(),
                                                 embedded.method.eval_submodel(embedded.params, quarter, 3)
                                                 .masks.values()))
    monkeypatch.setattr(client_app, "with_objective", lambda cfg, pid, content, params, sub, rnd: sub)
    _, plain = _round(cfg, rnd=3)
    assert plain["clients"] == 1 and len(plain["rejected"]) == 2
    assert all("missing parameter(s) feddse.keep." in why for why in plain["rejected"].values())


@pytest.mark.parametrize("kind", ["nan", "outside-mask", "oversized", "dtype"])
def test_bad_reply_leaves_the_model_as_if_the_client_was_not_sampled(tmp_path, task_identity, kind):
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    params, stats = _round(cfg, spoil=(1, kind))
    assert list(stats["rejected"]) == ["1"] and stats["clients"] == 2
    assert same_params(params, _embedded(cfg, without={1}))


def test_a_reply_with_a_non_finite_loss_is_rejected(tmp_path, task_identity, monkeypatch):
    step = client_app.train_step

    def nan_loss(trainer, pid, *rest):
        delta, loss = step(trainer, pid, *rest)
        return delta, float("nan") if pid == 1 else loss
    monkeypatch.setattr(client_app, "train_step", nan_loss)
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    params, stats = _round(cfg)
    assert "non-finite train-loss" in stats["rejected"]["1"] and stats["clients"] == 2
    assert same_params(params, _embedded(cfg, without={1}))


def test_missing_reply_dead_node_and_min_replies(tmp_path, task_identity):
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    params, stats = _round(cfg, drop={2})
    assert stats["failed"] == [2] and same_params(params, _embedded(cfg, without={2}))
    params, stats = _round(cfg, dead={0})
    assert stats["failed"] == [0] and same_params(params, _embedded(cfg, without={0}))
    params, stats = _round(cfg, drop={0, 1, 2})
    assert stats.get("skipped") and same_params(params, Experiment.from_config(cfg).params)


def test_dp_nodes_clip_the_server_adds_the_noise_and_an_unclipped_node_is_caught(tmp_path, task_identity,
                                                                               monkeypatch):
    """With dp, each node clips to the bound its TRAIN message carries and the server adds the noise: the round
    equals the embedded one bit for bit, epsilon in its line. A node that skips clipping is rejected and
    recorded; the model is the embedded round's without it (the denominator is public, so unchanged)."""
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}", "dp.clip=0.01", "dp.noise_multiplier=1")
    params, stats = _round(cfg)
    assert stats["epsilon"] > 0 and not stats["rejected"] and stats["clients"] == 3
    assert same_params(params, _embedded(cfg))
    train = client_app.train_content

    def skips_clipping(cfg, content, pid, rnd, times=None):
        if pid == 1:
            del content.config_records["task"]["dp-clip"]
        return train(cfg, content, pid, rnd, times)
    monkeypatch.setattr(client_app, "train_content", skips_clipping)
    params, stats = _round(cfg)
    assert "unclipped update" in stats["rejected"]["1"] and stats["clients"] == 2
    assert same_params(params, _embedded(cfg, without={1}))


# ---- FedBuff over push and pull, in-process (the loopback deployment's: test_fedbuff_on_the_deployment_...) ----
class PushPullGrid(LocalGrid):
    """A Grid with Flower's push and pull: a reply is computed when its message is pushed, and partition p's is
    handed out by the `delays[p]`-th pull after that (default: the first), as a slow node's would be."""

    def __init__(self, cfg, delays: dict[int, int]):
        super().__init__(cfg)
        self.delays, self.out = delays, {}   # message id -> [pulls left, reply]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            reply = self.send_and_receive([m])[0]
            self.out[m.metadata.message_id] = [self.delays.get(self.nodes[m.metadata.dst_node_id], 1), reply]
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        got = []
        for mid in message_ids:
            entry = self.out.get(mid)
            if entry is not None:
                entry[0] -= 1
                if entry[0] <= 0:
                    got.append(self.out.pop(mid)[1])
        return got


def _clocked(cfg, runner=None):
    """run_experiment with the simulated clock an asynchronous schedule needs (as fedlase.run passes it)."""
    from fedlase.engine import run_experiment
    from fedlase.simtime import clock_for
    return run_experiment(cfg, progress=False, runner=runner, clock=clock_for)


@pytest.mark.parametrize("schedule", ["fedbuff", "fedasync"])
def test_fedbuff_over_push_and_pull_steps_in_arrival_order_and_replays_on_the_embedded_engine(
        tmp_path, task_identity, monkeypatch, schedule):
    """FedBuff (and FedAsync) on a Grid (fedlase/flower/buffered.py), partition 3's replies 3 pulls late: every
    step applies 2 replies (FedAsync: 1) in the order they were pulled, the slow client's come stale, and the
    embedded engine replaying the recorded order ends with the same model bit for bit."""
    monkeypatch.setattr(NodeRounds, "POLL", 0.0)
    k = 2 if schedule == "fedbuff" else 1
    args = ["system={1,1/4}_{2,2}", f"rounds={8 // k}", f"eval_every={8 // k}", f"schedule={schedule}",
            "schedule_args.concurrency=4", *(["schedule_args.buffer=2"] if schedule == "fedbuff" else [])]
    cfg = small_cfg(tmp_path, *args, out="grid")
    _clocked(cfg, NodeRounds(PushPullGrid(cfg, {3: 3})))
    rows = [json.loads(x) for x in (tmp_path / "grid" / "arrivals.jsonl").read_text().splitlines()]
    # FedAsync's first reply has no reference to be judged by yet: rejected, and its step is not taken then
    steps = [1 + i // k for i in range(8)] if schedule == "fedbuff" else [1, *range(1, 9)]
    assert [r["arrival"] for r in rows] == list(range(1, len(steps) + 1)) and [r["step"] for r in rows] == steps
    slow = [r for r in rows if r["client"] == 3]
    assert slow and slow[0]["arrival"] > 4 and slow[0]["staleness"] >= 1, rows
    assert all("wall_time" in r for r in rows) and [x["round"] for x in _metrics(tmp_path / "grid")] == [8 // k]
    replay = small_cfg(tmp_path, *args, f"schedule_args.replay={tmp_path / 'grid'}", out="replay")
    _clocked(replay)
    assert same_params(_params(tmp_path / "grid"), _params(tmp_path / "replay"))
    again = [json.loads(x) for x in (tmp_path / "replay" / "arrivals.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["client"], r["version"], r["step"]) for r in again] == \
           [(r["seq"], r["client"], r["version"], r["step"]) for r in rows]
    # what was in flight lives in the SuperLink, not in the checkpoint: no resume, said in one line
    from fedlase.errors import UserError
    from fedlase.flower import run_flower
    with pytest.raises(UserError, match="cannot resume") as e:
        run_flower(small_cfg(tmp_path, *args, "engine=flower-sim", out="grid"), resume=True)
    assert "\n" not in str(e.value)


def test_partitions_are_pinned_to_node_keys(tmp_path, task_identity):
    """With pins, a node whose key is pinned to no partition is refused unasked; a node whose key is pinned to
    partition 2 but claims 1 is refused after its answer; neither gets a model, both refusals are in the round's
    line. A legitimate node re-registered under a new node id is followed, and the move is in the next line."""
    from cryptography.hazmat.primitives import serialization
    from flwr.proto.node_pb2 import NodeInfo

    from fedlase.flower.security import make_node_key, node_key, partition_keys
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    for i in range(4):
        make_node_key(node_key(tmp_path / "keys", i))
    pins = partition_keys(tmp_path / "keys", 3)

    def pem(i):   # how Flower's NodeInfo holds a registered key
        key = serialization.load_ssh_public_key(Path(f"{node_key(tmp_path / 'keys', i)}.pub").read_bytes())
        return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    grid = LocalGrid(cfg)
    grid.nodes = {100: 0, 101: 1, 103: 0, 104: 1}      # node id -> the partition it claims
    keys = {100: 0, 101: 1, 103: 3, 104: 2}            # node id -> whose key it was registered with
    sent = []

    def deliver(msgs, timeout=None):
        sent.extend(msgs)
        return grid.send_and_receive(msgs)
    wire = type("Wire", (), {"send_and_receive": staticmethod(deliver), "get_node_ids": grid.get_node_ids,
                             "get_nodes": staticmethod(lambda: [NodeInfo(node_id=n, public_key=pem(k))
                                                                 for n, k in keys.items()])})
    runner = NodeRounds(wire(), reply_timeout=2, pins=pins)   # partition 2 has no node: wait 2 s for one
    exp = Experiment.from_config(cfg, runner)
    stats = exp.run_round(1)
    assert runner.nodes == {0: 100, 1: 101}
    refused = stats["refused"]["103"]
    assert refused["partition"] is None and "pinned to no partition" in refused["reason"]
    assert stats["refused"]["104"]["partition"] == 1 and "pinned to partition 2" in stats["refused"]["104"]["reason"]
    assert 103 not in {m.metadata.dst_node_id for m in sent}                   # never even asked
    assert {m.metadata.dst_node_id for m in sent if m.metadata.message_type == "train"} == {100, 101}
    assert stats["failed"] == [2] and stats["moved"] == {}
    assert same_params(exp.params, _embedded(cfg, without={2}))
    # Partition 1's node comes back under a new node id, with its own key: followed, and the move recorded.
    del grid.nodes[101], keys[101]
    grid.nodes[105], keys[105] = 1, 1
    stats = exp.run_round(2)
    assert stats["moved"] == {"1": {"from": 101, "to": 105}} and stats["refused"] == {}
    assert runner.nodes == {0: 100, 1: 105}


def test_node_cache_key_is_what_the_data_code_reads(tmp_path, monkeypatch):
    """A node's cached partition is keyed by the config keys its dataset's loader and the partitioner read: a
    change of one of those gives a new entry, a change of anything else reuses the entry, and a plugin loader
    that reads a key of its own (here `width`) is keyed by it too."""
    from fedlase.client import client_splits
    from fedlase.flower import node_data
    from fedlase.registry import DATASETS
    cache = tmp_path / "cache"

    def entries():
        return sorted(p.name for p in (cache / "digits").iterdir() if p.is_dir())

    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}", "partition=dirichlet", "alpha=0.5")
    data = node_data.client_dataset(cfg, 1, cache)
    full = DATASETS.get("digits").load(cfg)
    train, _ = client_splits(cfg, full.y_train.numpy(), full.y_test.numpy(), full.num_classes)
    assert torch.equal(data.x_train, full.x_train[torch.as_tensor(train[1])])
    read = set(json.loads((cache / "digits" / "keys.json").read_text()))
    assert {"dataset", "partition", "alpha", "seed"} <= read and "lr" not in read and "width" not in read
    again = node_data.client_dataset(small_cfg(tmp_path, "system={1,1/4}_{1,2}", "partition=dirichlet",
                                               "alpha=0.5", "lr=0.2"), 1, cache)   # lr: not read, same entry
    assert torch.equal(again.x_train, data.x_train) and len(entries()) == 1
    other = node_data.client_dataset(small_cfg(tmp_path, "system={1,1/4}_{1,2}", "partition=dirichlet",
                                               "alpha=5"), 1, cache)
    assert len(entries()) == 2 and not torch.equal(other.y_train, data.y_train)

    load = node_data.load_dataset

    def probe(c):   # a plugin loader that also reads `width`
        _ = c.width
        return load(c)
    monkeypatch.setattr(node_data, "load_dataset", probe)
    cache = tmp_path / "plugin-cache"
    node_data.client_dataset(cfg, 1, cache)
    assert "width" in json.loads((cache / "digits" / "keys.json").read_text()) and len(entries()) == 1
    node_data.client_dataset(small_cfg(tmp_path, "system={1,1/4}_{1,2}", "partition=dirichlet", "alpha=0.5",
                                       "width=0.5"), 1, cache)
    assert len(entries()) == 2


# ---- real Flower runs (subprocesses) ---------------------------------------------------------------------------
def _env(path=()):
    """The environment of the processes a test starts: fedlase and the tests (and `path`) importable."""
    return {**os.environ, **QUIET_ENV,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *map(str, path)])}


def _run(cmd: list[str], timeout: float, listening: set | None = None, path=()) -> subprocess.CompletedProcess:
    """Run a command; past the timeout, SIGTERM it (so it stops what it started) before failing. `listening`:
    filled, while it runs, with (address, process name) of every socket its processes listen on. `path`: more
    folders to import from."""
    with subprocess.Popen(cmd, env=_env(path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        done, watcher = threading.Event(), None
        if listening is not None:
            watcher = threading.Thread(target=_watch_listening, args=(p.pid, listening, done), daemon=True)
            watcher.start()
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            out, _ = p.communicate(timeout=60)
            pytest.fail(f"timed out after {timeout:.0f} s:\n{out[-3000:]}")
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def _watch_listening(pid: int, found: set, done: threading.Event) -> None:
    while not done.wait(0.2):
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                found.update((c.laddr.ip, proc.name()) for c in proc.net_connections(kind="inet")
                             if c.status == psutil.CONN_LISTEN)


def _params(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["params"]


# The Simulation Engine's tests read one run of `fedlase run engine=flower-sim` (xdist_group: one pytest-xdist worker
# runs both; a simulation costs a Ray and an actor process per CPU, each importing torch): round 1 on two actors,
# during which partition 1's client kills its own process (the Ray actor that trains it; plugin killed_client),
# then the run resumed to round 2 on one actor, with no fault.
SIM = pytest.mark.xdist_group("flower-sim")
KILLED = 1
KILLED_CLIENT = f"""
import os, signal
from fedlase.flower import client_app
_step = client_app.train_step
def _killed(trainer, pid, rnd, *rest):
    if pid == {KILLED} and rnd == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(trainer, pid, rnd, *rest)
client_app.train_step = _killed
"""


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory):
    """The run above: (its folder, its args without `out` and `rounds`, the (address, process) of every socket
    its processes listened on). No process that carries its tag may be left after the module."""
    root = tmp_path_factory.mktemp("sim")
    (root / "plug").mkdir()
    (root / "plug" / "killed_client.py").write_text(KILLED_CLIENT)
    # with dp (fedlase/privacy.py): the nodes clip, the server adds the seeded noise, so the run still equals
    # the embedded one bit for bit (the denominator is public: a killed client does not change it)
    args = [*SMALL, "system={1,1/4}_{2,2}", "dp.clip=0.05", "dp.noise_multiplier=0.5"]
    out, listening = root / "sim", set()
    tag = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TAG, tag)
        for part, resume in ((["rounds=1"], []), (["rounds=2", "sim_actors=1"], ["--resume"])):
            res = _run([sys.executable, "-m", "fedlase", "run", *args, *part, "plugins=[killed_client]",
                        f"out={out}", "engine=flower-sim", "--quiet", *resume], timeout=300, listening=listening,
                       path=[root / "plug"])
            assert res.returncode == 0, res.stdout[-3000:]
            assert "deprecated" not in res.stdout, res.stdout[-3000:]
        yield out, args, listening
        assert_none_left(tag)


@SIM
def test_simulation_engine_matches_embedded(sim_run, tmp_path):
    """Flower's public run_simulation, stopped after round 1 and resumed to round 2, gives the embedded engine's
    weights bit for bit (without the clients whose actor died in round 1); two actors train round 1 side by side
    and one trains round 2, so the result does not depend on how many clients train at once."""
    out, args, listening = sim_run
    # the run's private Ray (GCS, raylet, workers) answers on loopback only: Ray has no authentication, and by
    # default it listens on every interface (fedlase/flower/sim_engine.py, SINGLE_MACHINE_RAY)
    assert any(name == "gcs_server" for _, name in listening), listening   # the watcher did see Ray's ports
    assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip, _ in listening), listening
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [1, 2] and lines[1]["failed"] == [] and lines[1]["clients"] == 4, lines
    cfg = load_config(None, [*args, "rounds=2", f"out={tmp_path / 'emb'}"])
    assert same_params(_params(out), _embedded(cfg, rounds=(1, 2), without={(1, c) for c in lines[0]["failed"]}))
    assert lines[-1]["bytes_total"]["sent"] == lines[0]["bytes"]["sent"] + lines[1]["bytes"]["sent"] > 0
    assert json.loads((out / "summary.json").read_text())["final"]["round"] == 2
    assert 0 < lines[0]["epsilon"] < lines[1]["epsilon"] and not lines[1]["rejected"]   # dp's epsilon, every line


@SIM
def test_a_killed_client_does_not_stop_the_run(sim_run):
    """The round whose client killed its actor ends with the others' updates, lists it as failed, and the run
    goes on."""
    out, _, _ = sim_run
    first = _metrics(out)[0]
    # Flower 1.42's actor pool keeps the dead actor, so a later message routed to it fails too.
    assert KILLED in first["failed"] and first["clients"] == 4 - len(first["failed"]) >= 1, first


# ---- the Deployment Engine on loopback: faults ----------------------------------------------------------------
# The two fault tests read one run on one federation (xdist_group: one pytest-xdist worker runs both): a SuperLink,
# its proxy and three SuperNodes with their sidecars and workers cost about as much CPU as a run, and a run of its
# own for each fault would train its second run in ClientApp processes (a node's worker binds to the first run it
# serves).
FAULTS = pytest.mark.xdist_group("flower-faults")
# The tests' federations: each SuperExec asks for a task to start at Flower's default interval, not at the 0.2 s
# of a deployment (launch.NODE_ENV, a latency choice). The suite is bound by CPU, and an idle 3-node federation
# used 5.7 CPU-s in 30 s at 0.2 s, 1.9 at 1 s (docs/benchmarks.md, issue 29).
TEST_POLL = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1"}

# Plugins on the nodes' and the server's path; a run imports only those its config names (`plugins=[...]`).
# faulty_node: partition 2's node replies with a well-formed update of 3e38 everywhere, through its valid
# credentials. stuck_node: partition 1's node never finishes its round-2 training, so it is surely still training
# when the test kills it. hold_round_3: the server holds round 3 until partition 1's node has gone offline (the
# SuperLink saw its heartbeats missed), says so in the file FEDLASE_TEST_OFFLINE names, and waits for the node to
# come back; so whether the restarted node trains again depends on Flower's rejoin, not on how fast the rounds go.
PLUGINS = {"faulty_node": """
import torch
from fedlase.flower import client_app
_step = client_app.train_step
def _faulty(trainer, pid, *rest):
    delta, loss = _step(trainer, pid, *rest)
    return ({n: torch.full_like(d, 3e38) for n, d in delta.items()} if pid == 2 else delta), loss
client_app.train_step = _faulty
""", "stuck_node": """
import time
from fedlase.flower import client_app
_step = client_app.train_step
def _stuck(trainer, pid, rnd, *rest):
    if pid == 1 and rnd == 2:
        time.sleep(3600)   # until the test kills the node (its worker dies with it)
    return _step(trainer, pid, rnd, *rest)
client_app.train_step = _stuck
""", "hold_round_3": """
import os, time
from pathlib import Path
from fedlase.flower import rounds
rounds.NodeRounds.POLL = 1.0   # most of this run is waiting on Flower's heartbeats: pull replies at 1 s, not 0.2
_prepare = rounds.NodeRounds.prepare
def _held(self, exp, rnd, *rest):
    nid, gone, deadline = self.nodes.get(1), False, time.monotonic() + 300
    while rnd == 3 and time.monotonic() < deadline:
        online = nid in self.grid.get_node_ids()
        if gone and online:
            break
        if not online and not gone:
            gone = True
            Path(os.environ["FEDLASE_TEST_OFFLINE"]).touch()
        time.sleep(1.0)
    return _prepare(self, exp, rnd, *rest)
rounds.NodeRounds.prepare = _held
"""}


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """A LocalFederation (tools/flower_local.py: the SuperLink on loopback, the mutual-TLS proxy, a sidecar and
    a worker per node, node authentication) with nodes for partitions 0, 1 (level 1) and 2 (level 1/4), and the
    plugins above on its path. At the end of the module it is stopped, with every `fedlase run` started with
    `_submit`, and no process that carries its tag may be left."""
    from tools.flower_local import LocalFederation
    root = tmp_path_factory.mktemp("faults")
    (root / "plug").mkdir()
    for name, text in PLUGINS.items():
        (root / "plug" / f"{name}.py").write_text(text)
    tag = uuid.uuid4().hex
    fed = LocalFederation(root / "fed", nodes=3)
    fed.runs, fed.offline = [], root / "node-1-offline"
    fed.env.update({TAG: tag, "FEDLASE_TEST_OFFLINE": str(fed.offline), **TEST_POLL,
                    "PYTHONPATH": os.pathsep.join([str(root / "plug"), _env()["PYTHONPATH"]])})
    try:
        nodes = _start_federation(fed, ["1", "1", "1/4"])
        yield fed, nodes
    finally:
        stop_federation(fed, tag)


def stop_federation(fed, tag: str) -> None:
    """Stop the federation's runs (killed after 30 s) and its processes; none that carries `tag` may be left."""
    for p in fed.runs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    fed.stop()
    assert_none_left(tag)


def _start_federation(fed, levels: list[str], register: int | None = None):
    """The SuperLink, the first `register` (default: all) node keys registered, one SuperNode per level."""
    fed.start_superlink()
    for path in fed.creds.nodes[:len(levels) if register is None else register]:
        fed.register(Path(f"{path}.pub"))
    return {pid: fed.start_node(pid, lvl) for pid, lvl in enumerate(levels)}


def _submit(fed, args: list[str], out: Path) -> subprocess.Popen:
    """`fedlase run engine=flower-deploy` on the SuperLink's host, verifying it with the CA and pinning partition
    i to node-<i>.key.pub."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}-run.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "fedlase", "run", *args, f"out={out}", "engine=flower-deploy",
                          f"superlink={fed.address}", f"tls_ca={fed.creds.ca}", f"node_keys={fed.creds.folder}",
                          "--quiet"],
                         env=fed.env, stdout=log, stderr=subprocess.STDOUT)
    fed.runs.append(p)
    return p


def _wait(p: subprocess.Popen, timeout: float, out: Path, logs: Path | None = None) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run did not end within {timeout:.0f} s\n{_logs(out, logs)}")
    assert p.returncode == 0, _logs(out, logs)


def _logs(out: Path, logs: Path | None = None) -> str:
    """The run's own log and the federation's process logs (in `logs`, default `<out>/flower-logs`)."""
    files = [out.parent / f"{out.name}-run.log", *sorted((logs or out / "flower-logs").glob("*.log"))]
    return "\n".join(f"== {f.name}\n{f.read_text()[-1500:]}" for f in files if f.exists())


def _metrics(out: Path) -> list[dict]:
    f = out / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


# The deployment's security (TLS, the proxy, node authentication, pinned partitions) and its bit-identity with
# the embedded engine: tests/test_flower_security.py, on one federation.


def _node_is_training(node: subprocess.Popen) -> bool:
    """The SuperNode runs a ClientApp process right now."""
    from fedlase.flower.processes import descendants
    for p in descendants(node.pid):
        try:
            if "flwr-clientapp" in " ".join(p.cmdline()):
                return True
        except Exception:   # gone meanwhile
            pass
    return False


@pytest.fixture(scope="module")
def faulty_run(faults, tmp_path_factory):
    """One 3-round run on the faults federation with two faults: partition 2's node replies 3e38 in every round
    (faulty_node), and partition 1's SuperNode is SIGKILLed while it trains in round 2 (stuck_node keeps it
    there), then started again with its key once the SuperLink has seen the old one miss its heartbeats (Flower
    1.42 refuses it until then, up to 60 s). Returns the run's folder and the run's config without `out`."""
    fed, nodes = faults
    timeout = float(os.environ.get("FEDLASE_TEST_REPLY_TIMEOUT", "90"))
    args = [*SMALL, "system={1,1/4}_{2,1}", "rounds=3", f"reply_timeout={timeout}"]
    out = tmp_path_factory.mktemp("faulty-run") / "dep"
    run = _submit(fed, [*args, "plugins=[faulty_node,stuck_node,hold_round_3]"], out)
    deadline = time.monotonic() + 300
    while not _metrics(out) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    assert _metrics(out), "round 1 did not finish\n" + _logs(out, fed.logs)
    while not _node_is_training(nodes[1]) and time.monotonic() < deadline and len(_metrics(out)) < 2:
        time.sleep(0.05)
    assert len(_metrics(out)) == 1, "round 2 ended before node 1 could be killed in it"
    fed.kill(nodes[1])
    while not fed.offline.exists() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)   # one start once the SuperLink has let the old node go, not one every few seconds
    while time.monotonic() < deadline and run.poll() is None:   # start it again until the SuperLink takes it
        nodes[1] = fed.start_node(1, "1", name="supernode-1-again")
        while nodes[1].poll() is None and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)   # a refused node exits (305); an accepted one runs until the federation stops
        if nodes[1].poll() is None:
            break
        time.sleep(2)
    _wait(run, 300 + 2 * timeout, out, fed.logs)
    return out, args


@FAULTS
def test_a_node_replying_3e38_is_rejected_and_the_model_stays_intact(faulty_run, tmp_path, faults):
    """Partition 2 is rejected in every round (the engine's screen, fedlase/server_step.py), and the model is the
    embedded engine's without it (and without partition 1 in round 2, whose node was killed), bit for bit."""
    out, args = faulty_run
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [1, 2, 3], _logs(out, faults[0].logs)
    assert all(list(x["rejected"]) == ["2"] and "median" in x["rejected"]["2"] for x in lines), lines
    cfg = load_config(None, [*args, "attack=nan", "attack_args.clients=[2]", f"out={tmp_path / 'emb'}"])
    params = _params(out)
    assert same_params(params, _embedded(cfg, rounds=(1, 2, 3), without={(2, 1)}))   # client 1 killed in round 2
    assert max(float(p.abs().max()) for p in params.values()) < 1e3


@FAULTS
def test_a_killed_supernode_fails_its_round_and_rejoins(faulty_run, faults):
    """Round 2 goes on without the killed node and lists client 1 as failed; the node, started again with its
    key, keeps its node id and trains again in round 3 (partition 2's 3e38 is rejected in every round, so
    `clients`, the updates aggregated, counts one fewer)."""
    out, _ = faulty_run
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [1, 2, 3], _logs(out, faults[0].logs)
    assert lines[0]["failed"] == [] and lines[0]["clients"] == 2
    assert lines[1]["failed"] == [1] and lines[1]["clients"] == 1, lines[1]
    assert lines[2]["failed"] == [] and lines[2]["clients"] == 2, (lines[2], _logs(out, faults[0].logs))
    # Restarted with its own key, the node is the pinned one for its partition: neither refused nor moved.
    assert all(x["refused"] == {} and x["moved"] == {} for x in lines), lines
    assert (out / "summary.json").exists()


# ---- the Deployment Engine on loopback: FedBuff ---------------------------------------------------------------
# A federation of its own (xdist_group: one pytest-xdist worker): four nodes with their workers, whose first run
# is this one (a worker binds to the first run it serves; the fault federation's serve faulty_run). slow_node:
# every training start leaves a file in FEDLASE_TEST_STARTS, and partition 3's node holds its first update back
# until the other nodes have started six trainings, that is until at least three of their replies have reached
# the server (it sent their second messages). Counted, not timed: the nodes' latency varies with the machine.
FEDBUFF = pytest.mark.xdist_group("flower-fedbuff")
SLOW_NODE = """
import os, time, uuid
from pathlib import Path
from fedlase.flower import client_app
_step = client_app.train_step
def _slow(trainer, pid, *rest):
    starts = Path(os.environ["FEDLASE_TEST_STARTS"])
    (starts / f"{pid}-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + 300
    while pid == 3 and time.monotonic() < deadline and sum(
            not f.name.startswith("3-") for f in starts.iterdir()) < 6:
        time.sleep(0.2)
    return _step(trainer, pid, *rest)
client_app.train_step = _slow
"""


@pytest.fixture(scope="module")
def buffered_fed(tmp_path_factory):
    """A LocalFederation (tools/flower_local.py) with nodes for partitions 0, 1 (level 1), 2 and 3 (level 1/4),
    slow_node on its path; stopped at the end of the module, and no process that carries its tag may be left."""
    from tools.flower_local import LocalFederation
    root = tmp_path_factory.mktemp("fedbuff")
    (root / "plug").mkdir()
    (root / "plug" / "slow_node.py").write_text(SLOW_NODE)
    tag = uuid.uuid4().hex
    fed = LocalFederation(root / "fed", nodes=4)
    fed.runs = []
    (root / "starts").mkdir()
    fed.env.update({TAG: tag, **TEST_POLL, "FEDLASE_TEST_STARTS": str(root / "starts"),
                    "PYTHONPATH": os.pathsep.join([str(root / "plug"), _env()["PYTHONPATH"]])})
    try:
        _start_federation(fed, ["1", "1", "1/4", "1/4"])
        yield fed
    finally:
        stop_federation(fed, tag)


@FEDBUFF
def test_fedbuff_on_the_deployment_steps_as_replies_arrive_and_its_replay_is_bit_identical(buffered_fed, tmp_path):
    """schedule=fedbuff on four nodes, C = 4, K = 2: the ServerApp steps every 2 replies in the order they come
    (fedlase/flower/buffered.py); the slow node's first update, sent with the others' first ones, comes after at
    least three of theirs and is applied stale; the embedded engine, replaying the run's arrivals.jsonl, ends with
    the deployment's model bit for bit."""
    fed = buffered_fed
    args = [*SMALL, "system={1,1/4}_{2,2}", "rounds=5", "eval_every=5", "reply_timeout=120", "schedule=fedbuff",
            "schedule_args.concurrency=4", "schedule_args.buffer=2"]
    out = tmp_path / "dep"
    _wait(_submit(fed, [*args, "plugins=[slow_node]"], out), 400, out, fed.logs)
    rows = [json.loads(x) for x in (out / "arrivals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5] and not any("failed" in r for r in rows), rows
    times = [r["wall_time"] for r in rows]
    assert times == sorted(times), rows
    slow = [r for r in rows if r["client"] == 3]
    assert slow and slow[0]["seq"] < 4 and slow[0]["version"] == 0, rows   # in the first dispatch
    assert slow[0]["arrival"] > 3 and slow[0]["staleness"] >= 1, rows       # arrived late, applied stale
    assert _metrics(out)[-1]["round"] == 5
    emb = tmp_path / "emb"
    _clocked(load_config(None, [*args, f"schedule_args.replay={out}", f"out={emb}"]))
    assert same_params(_params(out), _params(emb))
    again = [json.loads(x) for x in (emb / "arrivals.jsonl").read_text().splitlines()]
    assert [(r["seq"], r["client"], r["version"], r["step"]) for r in again] == \
           [(r["seq"], r["client"], r["version"], r["step"]) for r in rows]


# ---- public Flower API only; security settings -----------------------------------------------------------------
# Flower and Ray modules fedlase may use: tests/test_structure.py names them.


def test_the_client_side_loads_no_engine_and_no_torch_until_it_trains():
    """A ClientApp process (one per message on the Deployment Engine) imports Flower and fedlase's ClientApp
    module only; a QUERY needs nothing more. Its training code imports torch but never the server's engine."""
    code = ("import sys, fedlase.flower.client_app\n"
            "print('torch' in sys.modules, 'fedlase.engine' in sys.modules)\n"
            "import fedlase.flower.node_data, fedlase.flower.codec\n"
            "print('torch' in sys.modules, 'fedlase.engine' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False", "True", "False"], res.stdout


def test_security_keys_are_checked(tmp_path):
    from fedlase.config import tagged
    from fedlase.deploy_config import check_deployment
    from fedlase.errors import ConfigError
    from fedlase.flower.launch import require_tls
    from fedlase.flower.security import make_credentials
    creds = make_credentials(tmp_path / "tls", nodes=1)
    ok = small_cfg(tmp_path, "engine=flower-deploy", f"tls_ca={creds.ca}", f"tls_cert={creds.cert}",
                   f"tls_key={creds.key}", f"node_keys={creds.folder}")
    check_deployment(ok, tagged("submitter"))
    require_tls(ok)
    cases = [(["engine=flower-deploy", f"tls_ca={tmp_path / 'nope.crt'}"], "tls_ca"),
             ([f"tls_ca={creds.ca}", f"tls_cert={creds.cert}"], "tls_key"),
             ([f"tls_ca={creds.ca}", f"tls_cert={creds.nodes[0]}.pub",
               f"tls_key={creds.key}"], "tls_cert"),                                    # not PEM
             ([f"node_keys={tmp_path / 'none'}"], "node_keys"),
             (["insecure=true", f"tls_ca={creds.ca}"], "insecure")]
    for overrides, key in cases:   # the config's own validation calls check_deployment
        with pytest.raises(ConfigError) as e:
            small_cfg(tmp_path, *overrides)
        assert e.value.key == key and "\n" not in str(e.value), (overrides, str(e.value))
    with pytest.raises(ConfigError) as e:   # secure by default: a deployment without tls_ca is refused
        require_tls(small_cfg(tmp_path, "engine=flower-deploy"))
    assert e.value.key == "tls_ca"
    with pytest.raises(ConfigError) as e:   # nor without the node keys its partitions are pinned to
        require_tls(small_cfg(tmp_path, "engine=flower-deploy", f"tls_ca={creds.ca}"))
    assert e.value.key == "node_keys"
    require_tls(small_cfg(tmp_path, "engine=flower-deploy", "insecure=true"))   # asked for: allowed


def test_made_credentials_verify(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from fedlase.flower.security import fingerprint, make_credentials, node_cert, partition_keys
    creds = make_credentials(tmp_path, ["10.0.0.5", "link.example"], nodes=2)
    ca = x509.load_pem_x509_certificate(creds.ca.read_bytes())
    srv = x509.load_pem_x509_certificate(creds.cert.read_bytes())
    srv.verify_directly_issued_by(ca)
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(x) for x in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert san.get_values_for_type(x509.DNSName) == ["link.example"]
    for key in creds.nodes:
        assert isinstance(serialization.load_ssh_private_key(key.read_bytes(), None), ec.EllipticCurvePrivateKey)
        assert isinstance(serialization.load_ssh_public_key(Path(f"{key}.pub").read_bytes()),
                          ec.EllipticCurvePublicKey)
        assert key.stat().st_mode & 0o077 == 0   # private keys readable by their owner only
    for i in range(2):   # each node's client certificate: signed by the CA, for client authentication only
        crt, crt_key = node_cert(tmp_path, i)
        cert = x509.load_pem_x509_certificate(crt.read_bytes())
        cert.verify_directly_issued_by(ca)
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        assert serialization.load_pem_private_key(crt_key.read_bytes(), None).public_key() == cert.public_key()
        assert crt_key.stat().st_mode & 0o077 == 0
    # A key's fingerprint is the same read from its .pub file or as the PEM Flower stores.
    pub = serialization.load_ssh_public_key(Path(f"{creds.nodes[1]}.pub").read_bytes())
    pem = pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert partition_keys(tmp_path, 2)[1] == fingerprint(pem) != partition_keys(tmp_path, 2)[0]
