"""fedlase on Flower: payload codec, reply checks, the strategy's round against the embedded engine's (all
in-process), then real Simulation Engine and Deployment Engine runs in subprocesses, compared bit for bit
with the embedded engine. Select with `-m flower`, skip with `-m "not flower"`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment, run_experiment  # noqa: E402
from fedlase.flower import QUIET_ENV  # noqa: E402
from fedlase.flower import client_app  # noqa: E402
from fedlase.flower.codec import ReplyError, decode_submodel, encode_delta, encode_submodel, validate_reply  # noqa: E402
from fedlase.flower.strategy import SubmodelStrategy  # noqa: E402
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


def flower_processes() -> set[int]:
    """Pids of processes that look like Flower or Ray ones."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    keys = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-serverapp", "flwr-clientapp",
            "raylet", "gcs_server", "ray::", "ray/_private", "default_worker.py")
    return {int(line.split(None, 1)[0]) for line in out.splitlines() if any(k in line for k in keys)}


@pytest.fixture
def no_leftovers():
    """Fails the test if Flower or Ray processes started during it are still there (after a grace period)."""
    before = flower_processes()
    yield
    deadline = time.monotonic() + 20
    while (new := flower_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not new, f"processes left behind: {sorted(new)}"


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
    exp = Experiment(small_cfg(tmp_path, "system={1,1/4}_{1,1}", f"method={name}", *args))
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
    exp = Experiment(small_cfg(tmp_path, "system={1,1/4}_{1,1}"))
    sub = exp.method.submodel(exp.params, 0.25, 1)
    delta, _ = exp.client_update(1, sub, 1)
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
    exp = Experiment(cfg)
    grid = LocalGrid(cfg)
    strategy = SubmodelStrategy(exp, min_replies=1)
    msgs = strategy.configure_train(rnd, ArrayRecord(), {}, grid)
    replies = grid.send_and_receive(msgs, dead=dead)
    replies = [r for r in replies if r.has_error() or grid.nodes[r.metadata.src_node_id] not in drop]
    if spoil is not None:
        sent, _, sub, _ = strategy.pending[spoil[0]]
        reply = next(r for r in replies if r.metadata.reply_to_message_id == sent.metadata.message_id)
        _spoil(spoil[1], reply.content.array_records["delta"], exp.params, sub)
    strategy.aggregate_train(rnd, replies)
    return exp.params, strategy.last


def _embedded(cfg, rnd=1, without=()):
    """The embedded engine's round, with some clients taken out of the sample."""
    exp = Experiment(cfg)
    sample = exp.sample
    exp.sample = lambda r: [(c, lvl) for c, lvl in sample(r) if c not in without]
    exp.run_round(rnd)
    return exp.params


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


@pytest.mark.parametrize("kind", ["nan", "outside-mask", "oversized", "dtype"])
def test_bad_reply_leaves_the_model_as_if_the_client_was_not_sampled(tmp_path, task_identity, kind):
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    params, stats = _round(cfg, spoil=(1, kind))
    assert list(stats["rejected"]) == [1] and stats["clients"] == 2
    assert same_params(params, _embedded(cfg, without={1}))


def test_missing_reply_dead_node_and_min_replies(tmp_path, task_identity):
    cfg = small_cfg(tmp_path, "system={1,1/4}_{1,2}")
    params, stats = _round(cfg, drop={2})
    assert stats["failed"] == [2] and same_params(params, _embedded(cfg, without={2}))
    params, stats = _round(cfg, dead={0})
    assert stats["failed"] == [0] and same_params(params, _embedded(cfg, without={0}))
    params, stats = _round(cfg, drop={0, 1, 2})
    assert stats.get("skipped") and same_params(params, Experiment(cfg).params)


# ---- real Flower runs (subprocesses) ---------------------------------------------------------------------------
def _env():
    return {**os.environ, **QUIET_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command; past the timeout, SIGTERM it (so it stops what it started) before failing."""
    with subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            out, _ = p.communicate(timeout=60)
            pytest.fail(f"timed out after {timeout:.0f} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def _params(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["params"]


def test_simulation_engine_matches_embedded(tmp_path, no_leftovers):
    args = [*SMALL, "system={1,1/4}_{2,2}", "rounds=2"]
    res = _run([sys.executable, "-m", "fedlase", "run", *args, f"out={tmp_path / 'sim'}", "engine=flower-sim",
                "--quiet"], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    run_experiment(load_config(None, [*args, f"out={tmp_path / 'emb'}"]), progress=False)
    assert same_params(_params(tmp_path / "sim"), _params(tmp_path / "emb"))
    lines = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2] and all(x["clients"] == 4 for x in lines)
    assert lines[-1]["bytes_total"]["sent"] == 2 * lines[0]["bytes"]["sent"] > 0
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["final"]["round"] == 2


# A ClientApp whose node for partition KILLED dies in the middle of its training (SIGKILL of its own
# process: the Ray worker in simulation). Imported by the Simulation Engine's workers from this module.
KILLED = 1
killing_app = ClientApp()


@killing_app.query()
def _query(msg, context):
    return client_app.query(msg, context)


@killing_app.train()
def _train(msg, context):
    if int(context.node_config["partition-id"]) == KILLED:
        os.kill(os.getpid(), signal.SIGKILL)
    return client_app.train(msg, context)


def test_a_killed_client_does_not_stop_the_run(tmp_path, no_leftovers):
    args = [*SMALL, "system={1,1/4}_{1,2}", "rounds=1", "engine=flower-sim"]
    script = textwrap.dedent(f"""
        from pathlib import Path
        from fedlase.config import load_config
        from fedlase.flower.launch import simulate, write_app
        cfg = load_config(None, {[*args, f"out={tmp_path / 'sim'}"]!r})
        app = write_app(Path({str(tmp_path / 'app')!r}), cfg, False, False)
        simulate(cfg, app, client_app="test_flower:killing_app")
    """)
    res = _run([sys.executable, "-c", script], timeout=300)
    assert res.returncode == 0, res.stdout[-3000:]
    line = json.loads((tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()[-1])
    # Flower 1.42's actor pool keeps the dead worker, so a later message routed to it fails too.
    assert KILLED in line["failed"] and line["clients"] == 3 - len(line["failed"]) >= 1
    cfg = load_config(None, [*args, f"out={tmp_path / 'emb'}"])
    assert same_params(_params(tmp_path / "sim"), _embedded(cfg, without=set(line["failed"])))


def test_deployment_engine_matches_embedded(tmp_path, no_leftovers):
    args = [*SMALL, "system={1,1/4}_{1,1}", "rounds=1", "reply_timeout=150"]
    res = _run([sys.executable, str(ROOT / "scripts" / "flower-deploy-local.py"), *args, f"out={tmp_path / 'dep'}"],
               timeout=400)
    logs = "".join(p.read_text()[-1500:] for p in sorted((tmp_path / "dep" / "flower-logs").glob("*.log")))
    assert res.returncode == 0, res.stdout[-3000:] + logs
    run_experiment(load_config(None, [*args, f"out={tmp_path / 'emb'}"]), progress=False)
    assert same_params(_params(tmp_path / "dep"), _params(tmp_path / "emb"))
    line = json.loads((tmp_path / "dep" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["clients"] == 2 and set(line["bytes"]["levels"]) == {"1", "1/4"}
