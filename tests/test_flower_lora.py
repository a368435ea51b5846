"""LoRA runs on Flower (docs/flower.md, "LoRA adapters"): a node builds the frozen base from the config itself and
gets and sends only the trainable tensors (the adapters, and a task head outside the transformer); the server
sends the base's fingerprint and a node holding another base refuses. Rounds in-process on the tests' Grids
(tests/test_flower.py), compared bit for bit with the embedded engine; tiny random BERT folders, no weights."""
from __future__ import annotations

import json
import sys
import uuid

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("peft")

from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from test_flower import (  # noqa: E402
    TAG,
    LocalGrid,
    NodeRounds,
    PushPullGrid,
    _clocked,
    _embedded,
    _metrics,
    _params,
    _run,
    assert_none_left,
    same_params,
)
from test_lora import lora_args, write_bert_folder  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment  # noqa: E402
from fedlase.errors import ConfigError  # noqa: E402
from fedlase.flower import client_app  # noqa: E402
from fedlase.payload import npy_bytes  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    return write_bert_folder(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture
def lora_cfg(bert_folder, tmp_path, monkeypatch):
    """A config of tests/test_lora.py's HetLoRA run with `overrides`; the nodes' trainers of an earlier test are
    dropped, so each test's nodes build their model from its config."""
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    client_app._CACHE.clear()
    return lambda *overrides, out=None: load_config(None, [*lora_args(bert_folder), f"out={out or tmp_path / 'run'}",
                                                           *overrides])


@pytest.fixture
def task_identity():
    """Messages built outside a Flower process need a task identity (as in tests/test_flower.py)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


class Recording(LocalGrid):
    """The in-process Grid, keeping every message and reply it delivered."""

    def __init__(self, cfg, node_cfg=None):
        super().__init__(cfg)
        if node_cfg is not None:   # what the nodes read: another config (e.g. another model file)
            self.run_config = {"fedlase-config": json.dumps(node_cfg.to_dict(), default=str)}
        self.sent, self.replies = [], []

    def send_and_receive(self, messages, *, timeout=None, dead=()):
        replies = super().send_and_receive(messages, timeout=timeout, dead=dead)
        self.sent += [m for m in messages if m.metadata.message_type == "train"]
        self.replies += [r for r in replies if not r.has_error() and "node" not in r.content.config_records]
        return replies


def _rounds(cfg, rounds=(1, 2), node_cfg=None):
    """The rounds on Flower nodes in this process: (the run, its grid, each round's line)."""
    grid = Recording(cfg, node_cfg)
    exp = Experiment.from_config(cfg, NodeRounds(grid))
    return exp, grid, [exp.run_round(r) for r in rounds]


@pytest.mark.parametrize("overrides", [["method=hetlora"], ["method=flexlora"], ["method=heterofl"],
                                       ["method=fedrolex"], ["method=fiarse"], ["method=fedlase"],
                                       ["method=lora_fedavg", "dp.clip=1", "dp.noise_multiplier=0.5"]],
                         ids=["hetlora", "flexlora", "heterofl", "fedrolex", "fiarse", "fedlase", "lora_fedavg-dp"])
def test_a_lora_run_on_flower_nodes_equals_the_embedded_run_and_sends_only_adapters(lora_cfg, task_identity,
                                                                                     monkeypatch, overrides):
    """Two rounds of the adapter methods (hetlora, flexlora; lora_fedavg under dp: the nodes clip), the width
    methods on the ranks (heterofl, fedrolex) and the threshold methods (fiarse, fedlase) on nodes that build their
    own base: the embedded engine's adapters bit for bit. Every message and reply holds trainable tensors only (no
    base weight, whose names the node never receives), a reply is at most its client's slice of the adapters and the
    head, and each node hashes its base once, not once a message."""
    from fedlase import model_facts
    hashed = []
    real = model_facts._hash_frozen
    monkeypatch.setattr(model_facts, "_hash_frozen", lambda frozen: hashed.append(1) or real(frozen))
    cfg = lora_cfg(*overrides, "system={1,1/4}_{1,2}")
    exp, grid, lines = _rounds(cfg)
    hashes = len(hashed)   # the server's base and the nodes'
    assert all(not x["failed"] and not x["rejected"] for x in lines), lines
    assert same_params(exp.params, _embedded(cfg, rounds=(1, 2)))
    frozen = {n for n, p in exp.model.named_parameters() if not p.requires_grad}
    for m in grid.sent:
        names = set(m.content.array_records["values"])
        assert names == set(exp.params) and not names & frozen
        assert m.content.config_records["task"]["frozen-sha256"] == exp.frozen["sha256"]
    adapter_bytes = sum(npy_bytes(p) for p in exp.params.values())
    for r in grid.replies:
        delta = r.content.array_records["delta"]
        assert set(delta) <= set(exp.params) and sum(len(a.data) for a in delta.values()) <= adapter_bytes
    assert lines[1]["bytes"]["received"] <= 3 * adapter_bytes and len(grid.replies) == 6
    nodes = [id(t.model) for t in client_app._CACHE["trainers"].values()]
    assert len(nodes) == 3 and hashes <= 1 + len(nodes) < len(grid.sent)   # at most once a base, not a message


def test_a_node_whose_base_is_another_refuses_in_one_line(lora_cfg, tmp_path, task_identity, capfd):
    """A node reading another model file (the same layout, other weights) gets the server's fingerprint, finds its
    own differs and refuses to train: the round's line rejects every client with the node's reason and the model
    is left as it was. A node's warm worker refuses the same way (and says so in its log)."""
    from fedlase.flower.worker import Worker
    other = write_bert_folder(tmp_path / "other-bert", seed=1)   # another revision: same layout, other weights
    cfg = lora_cfg("method=hetlora", "system={1,1/4}_{1,1}")
    node_cfg = lora_cfg("method=hetlora", "system={1,1/4}_{1,1}", *lora_args(other))
    exp, grid, lines = _rounds(cfg, rounds=(1,), node_cfg=node_cfg)
    rejected = lines[0]["rejected"]
    assert set(rejected) == {"0", "1"} and lines[0]["clients"] == 0
    for why in rejected.values():
        assert why.startswith("the node refused to train: its frozen base (") and "not the server's" in why
        assert "\n" not in why
    assert same_params(exp.params, Experiment.from_config(cfg).params)   # nothing trained on the wrong base
    assert not any("delta" in r.content.array_records for r in grid.replies)
    header = {"op": "train", "run": 1, "partition": 0, "config": grid.run_config["fedlase-config"]}
    first = next(m for m in grid.sent if m.content.config_records["task"]["partition-id"] == 0)
    status, reply = Worker(partition=0, node=100).handle(header, first.content)
    assert status["ok"] and "not the server's" in reply.config_records["refused"]["reason"]
    assert "round 1: refused partition 0's work: its frozen base" in capfd.readouterr().err


def test_fedbuff_with_a_width_method_on_ranks_runs_on_flower_nodes(lora_cfg, tmp_path, task_identity, monkeypatch):
    """schedule=fedbuff with heterofl on adapter ranks over push and pull (a slow partition 3 replies 3 pulls late):
    the embedded engine replaying the recorded arrivals ends with the same adapters bit for bit."""
    monkeypatch.setattr(NodeRounds, "POLL", 0.0)
    args = ["method=heterofl", "system={1,1/4}_{2,2}", "rounds=2", "eval_every=2", "schedule=fedbuff",
            "schedule_args.concurrency=4", "schedule_args.buffer=2", "device_model={}"]
    cfg = lora_cfg(*args, out=str(tmp_path / "grid"))
    _clocked(cfg, NodeRounds(PushPullGrid(cfg, {3: 3})))
    rows = [json.loads(x) for x in (tmp_path / "grid" / "arrivals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2] and any(r["staleness"] >= 1 for r in rows), rows
    replay = lora_cfg(*args, f"schedule_args.replay={tmp_path / 'grid'}", out=str(tmp_path / "replay"))
    _clocked(replay)
    assert same_params(_params(tmp_path / "grid"), _params(tmp_path / "replay"))


def test_a_decoders_next_token_lora_run_on_flower_nodes_equals_the_embedded_run(tmp_path, task_identity, monkeypatch):
    """A tiny random Llama (tests/test_llm_decoder.py's), task=lm, HetLoRA: two rounds on nodes that build the
    decoder themselves give the embedded engine's adapters bit for bit."""
    import test_llm_decoder as dec
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    client_app._CACHE.clear()
    folder = dec.write_tiny_llama(tmp_path / "llama")
    texts = dec.write_texts(tmp_path / "texts", ("sport", "tech"))
    cfg = dec._cfg(tmp_path, folder, texts, method="hetlora", lora={"r": 4}, rounds=2)
    exp, grid, lines = _rounds(cfg)
    assert all(not x["failed"] and not x["rejected"] and x["clients"] == 4 for x in lines), lines
    assert same_params(exp.params, _embedded(cfg, rounds=(1, 2)))
    frozen = {n for n, p in exp.model.named_parameters() if not p.requires_grad}
    assert all(not set(m.content.array_records["values"]) & frozen for m in grid.sent)


@pytest.mark.parametrize("engine", ["flower-sim", "flower-deploy"])
def test_flora_is_refused_on_flower_in_one_line(lora_cfg, tmp_path, engine):
    with pytest.raises(ConfigError) as err:
        lora_cfg("method=flora", f"engine={engine}", "insecure=true", out=str(tmp_path / "bad"))
    assert err.value.key == "engine" and "merges the adapters into the frozen base" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.integration   # a Ray and its actor processes: `make test-integration`
def test_a_lora_run_on_the_simulation_engine_equals_the_embedded_run(bert_folder, tmp_path, monkeypatch):
    """`fedlase run engine=flower-sim` of HetLoRA (Flower's Simulation Engine, its nodes building the tiny base in a
    Ray actor): the embedded run's adapters bit for bit and its metrics per level, and a payload of adapters."""
    tag = uuid.uuid4().hex   # every process the run starts carries it: none may be left after it
    monkeypatch.setenv(TAG, tag)
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    args = [*lora_args(bert_folder), "system={1,1/4}_{1,2}"]
    out = tmp_path / "sim"
    res = _run([sys.executable, "-m", "fedlase", "run", *args, f"out={out}", "engine=flower-sim", "sim_actors=1",
                "--quiet"], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    assert_none_left(tag)
    assert_equals_the_embedded_run(out, args, tmp_path / "emb", replies=3)


def assert_equals_the_embedded_run(out, args: list[str], emb, replies: int) -> None:
    """The Flower run in `out` (2 rounds of `args`) ends with the embedded run's adapters bit for bit and its metrics
    per level, nothing failed or rejected, and round 1's `replies` replies held at most an adapter each."""
    from fedlase.engine import run_experiment
    run_experiment(load_config(None, [*args, f"out={emb}"]), progress=False)
    assert same_params(_params(out), _params(emb))
    got, ref = _metrics(out), _metrics(emb)
    assert [x["round"] for x in got] == [1, 2] and all(not x["failed"] and not x["rejected"] for x in got), got
    assert [x["levels"] for x in got] == [x["levels"] for x in ref]
    adapters = sum(npy_bytes(p) for p in _params(emb).values())
    assert 0 < got[0]["bytes"]["received"] <= replies * adapters


def test_hetlora_with_its_penalty_on_flower_nodes_equals_the_embedded_run(lora_cfg, task_identity):
    """HetLoRA's local penalty is an objective the nodes rebuild from the level (`with_objective`); it reads each
    client's rank off the submodel the client is sent, a pruned client's own slice too. Three rounds (the clients
    prune after round 2, then train their own ranks): the embedded engine's adapters and pruned ranks bit for bit."""
    cfg = lora_cfg("method_args.prune=0.5", "method_args.penalty=0.2", "rounds=3")
    exp, grid, lines = _rounds(cfg, rounds=(1, 2, 3))
    assert all(not x["failed"] and not x["rejected"] for x in lines), lines
    ref = Experiment.from_config(cfg)
    for r in (1, 2, 3):
        ref.run_round(r)
    assert exp.method.pruned and exp.method.pruned == ref.method.pruned
    assert same_params(exp.params, ref.params)
    a = exp.method.pairs[0].a
    sent = {len(m.content.array_records["slices"][f"{a}|0"].numpy()) for m in grid.sent[-4:]}   # round 3's
    assert all(m.content.config_records["submodel"]["local"] for m in grid.sent)   # rebuilt on the node
    assert sent == set(exp.method.pruned.values())   # each client's own (pruned) rank travelled, not its level's


@pytest.mark.integration   # a SuperLink, its proxy and two SuperNodes: `make test-integration`
def test_a_lora_run_on_the_deployment_engine_equals_the_embedded_run(bert_folder, tmp_path, monkeypatch):
    """`fedlase run engine=flower-deploy` of HetLoRA on two SuperNodes over TLS with pinned node keys, each node
    building the tiny base itself: the embedded run's adapters bit for bit, its metrics per level, and replies of
    adapters only (the base's 100k-parameter weights never travel)."""
    from test_flower import TEST_POLL, _start_federation, _submit, _wait, stop_federation

    from tools.flower_local import LocalFederation
    tag = uuid.uuid4().hex
    monkeypatch.setenv("FEDLASE_CACHE", str(tmp_path / "cache"))
    fed = LocalFederation(tmp_path / "fed", nodes=2)
    fed.runs = []
    fed.env.update({TAG: tag, **TEST_POLL, "FEDLASE_CACHE": str(tmp_path / "cache")})
    args = [*lora_args(bert_folder), "system={1,1/4}_{1,1}", "reply_timeout=120"]
    out = tmp_path / "dep"
    try:
        _start_federation(fed, ["1", "1/4"])
        _wait(_submit(fed, args, out), 400, out, fed.logs)
    finally:
        stop_federation(fed, tag)
    assert_equals_the_embedded_run(out, args, tmp_path / "emb", replies=2)
