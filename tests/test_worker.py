"""The warm worker beside a SuperNode (fedlase/flower/worker.py): a worker process on a private socket trains
what the ClientApp hands it bit for bit as the ClientApp would itself, refuses another run or partition, is
reachable by its own user only, dies with the process it watches, replaces a stale socket; a ClientApp without
a worker trains in-process and says so once. The loopback deployment whose worker is killed mid-run is in
tests/test_flower_security.py, on that module's federation."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("FEDLASE_CACHE", tempfile.mkdtemp(prefix="fedlase-cache-"))
pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import Experiment  # noqa: E402
from fedlase.flower import client_app, worker  # noqa: E402
from fedlase.flower.rounds import NodeRounds  # noqa: E402

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["dataset=digits", "model=cnn", "width=0.25", "local_steps=2", "batch_size=16", "lr=0.05", "threads=1",
        "device=cpu", "participation=1", "eval_every=1", "checkpoint_every=1", "system={1,1/4}_{1,1}"]
SERVED = 1   # the partition the test's worker serves


def cfg_of(tmp_path, *more):
    return load_config(None, [*ARGS, f"out={tmp_path / 'run'}", *more])


def env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def start_worker(folder: Path, partition: int = SERVED, watch: int | None = None, log=None) -> subprocess.Popen:
    """A worker process; returns once its socket listens (it binds before importing torch; a killed worker's
    stale socket refuses connections)."""
    cmd = [sys.executable, "-m", "fedlase.flower.worker", "--dir", str(folder), "--partition-id", str(partition)]
    p = subprocess.Popen(cmd + ([] if watch is None else ["--watch-pid", str(watch)]), env=env(),
                         stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not worker.listening(folder):
        assert p.poll() is None and time.monotonic() < deadline, f"the worker exited with {p.returncode}"
        time.sleep(0.05)
    return p


def gone(p: subprocess.Popen, timeout: float = 30) -> bool:
    try:
        p.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture
def wdir():
    """A short private folder (a Unix socket path has at most 107 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="fw-"))
    yield folder
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def served(wdir):
    """A worker for partition SERVED in `wdir`, stopped after the test."""
    with open(wdir / "worker.log", "w") as log:
        p = start_worker(wdir, log=log)
    yield wdir, p
    if p.poll() is None:
        p.terminate()
        p.wait(timeout=30)


@pytest.fixture
def task_identity():
    """Messages built outside a Flower process need a task identity."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


class Wire:
    """Delivers a round's messages by calling fedlase's ClientApp in this process, as a SuperNode would start it:
    partition SERVED's node names the worker folder `folder` (None: no worker anywhere)."""

    def __init__(self, cfg, folder: Path | None, run_id: int = 7):
        self.run_config = {"fedlase-config": json.dumps(cfg.to_dict(), default=str)}
        self.nodes = {100 + p: p for p in range(cfg.num_clients)}
        self.folder, self.run_id = folder, run_id

    def context(self, node: int) -> Context:
        conf = {"partition-id": self.nodes[node]}
        if self.folder is not None and self.nodes[node] == SERVED:
            conf["worker-dir"] = str(self.folder)
        return Context(run_id=self.run_id, node_id=node, node_config=conf, state=RecordDict(),
                       run_config=self.run_config)

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        fns, out = {"query": client_app.query, "train": client_app.train}, []
        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex   # as a Grid does when it pushes
            out.append(fns[m.metadata.message_type](m, self.context(m.metadata.dst_node_id)))
        return out


def flower_round(cfg, folder, rnd=2, run_id=7):
    exp = Experiment(cfg, NodeRounds(Wire(cfg, folder, run_id)))
    stats = exp.run_round(rnd)
    return exp, stats


def same(a: dict, b: dict) -> bool:
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_worker_trains_bit_for_bit_as_the_clientapp(tmp_path, served, task_identity, capfd):
    """Two rounds through the ClientApp's warm path (partition 1 trained by the worker, over its socket) give the
    embedded engine's weights bit for bit; so does the ClientApp that trains in its own process."""
    folder, proc = served
    cfg = cfg_of(tmp_path)
    exp = Experiment(cfg, NodeRounds(Wire(cfg, folder)))
    for rnd in (1, 2):
        stats = exp.run_round(rnd)
        assert stats["clients"] == 2 and not stats["failed"], stats
    emb = Experiment(cfg_of(tmp_path))
    emb.run_round(1)
    emb.run_round(2)
    assert same(exp.params, emb.params)
    assert "fedlase:" not in capfd.readouterr().err   # the worker answered: nothing to say
    assert proc.poll() is None
    log = (folder / "worker.log").read_text()
    assert log.count("trained partition 1") == 2 and "round 2: trained" in log, log


# A ClientApp process on the warm path: the message's content from a frame file, fedlase's ClientApp `train`,
# the reply's frame written back; and whether torch was imported.
_CLIENTAPP = """
import json, sys
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedlase.flower import client_app, worker
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
raw = open(sys.argv[1], "rb").read()
n = int.from_bytes(raw[:8], "big"); header = json.loads(raw[8:8 + n]); blobs, at = [], 8 + n
for e in header["records"]:
    for a in e.get("arrays", []):
        blobs.append(raw[at:at + a[4]]); at += a[4]
msg = Message(worker.unpack(header, blobs), dst_node_id=0, message_type="train")
ctx = Context(run_id=7, node_id=0, node_config={"partition-id": 1, "worker-dir": sys.argv[2]}, state=RecordDict(),
              run_config={"fedlase-config": header["config"]})
reply = client_app.train(msg, ctx)
open(sys.argv[3], "wb").write(b"".join(worker.pack({}, reply.content)))
print("torch" in sys.modules)
"""


def test_the_clientapp_hands_over_without_torch(tmp_path, served, task_identity):
    """A ClientApp process whose node has a worker imports no torch, and its reply is byte for byte the one
    the ClientApp computes in-process."""
    folder, _ = served
    cfg = cfg_of(tmp_path)
    text = json.dumps(cfg.to_dict(), default=str)
    content = _train_content(cfg)
    (tmp_path / "msg.bin").write_bytes(b"".join(worker.pack({"config": text}, content)))
    res = subprocess.run([sys.executable, "-c", _CLIENTAPP, str(tmp_path / "msg.bin"), str(folder),
                          str(tmp_path / "reply.bin")], env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["False"], res.stdout + res.stderr
    here = client_app.train_content(client_app.config_of(text), content, SERVED, 3)
    assert (tmp_path / "reply.bin").read_bytes() == b"".join(worker.pack({}, here))


_CONTENTS: dict = {}


def _train_content(cfg, pid=SERVED, rnd=3) -> RecordDict:
    """A TRAIN message's content for partition `pid`, built as the server builds it (once per config and round)."""
    key = (json.dumps(cfg.to_dict(), default=str), rnd)
    if key not in _CONTENTS:
        _CONTENTS[key] = _server_contents(cfg, rnd)
    return _CONTENTS[key][pid]


def _server_contents(cfg, rnd) -> dict:
    captured = {}

    class Capture(Wire):
        def send_and_receive(self, messages, timeout=None):
            if messages[0].metadata.message_type == "train":
                captured.update({m.content.config_records["task"]["partition-id"]: m.content for m in messages})
                return []
            return super().send_and_receive(messages)
    Experiment(cfg, NodeRounds(Capture(cfg, None))).run_round(rnd)
    return captured


def test_a_worker_refuses_another_run_or_partition(tmp_path, served, task_identity):
    folder, _ = served
    cfg = cfg_of(tmp_path)
    text = json.dumps(cfg.to_dict(), default=str)
    header, reply = worker.ask(folder, 5, SERVED, text, _train_content(cfg))   # binds the worker to run 5
    assert header["ok"] and "delta" in reply
    with pytest.raises(worker.WorkerError, match="serves run 5"):
        worker.ask(folder, 6, SERVED, text, _train_content(cfg))
    with pytest.raises(worker.WorkerError, match="serves run 5"):   # the same run id with another config
        worker.ask(folder, 5, SERVED, json.dumps({**cfg.to_dict(), "lr": 0.5}, default=str), _train_content(cfg))
    with pytest.raises(worker.WorkerError, match=f"serves partition {SERVED}, not 0"):
        worker.ask(folder, 5, 0, text, _train_content(cfg, pid=0))


def test_no_worker_trains_in_process_and_says_so_once(tmp_path, wdir, task_identity, capfd):
    """A node whose worker folder holds no worker: the same weights, one line in the node's log for the run."""
    cfg = cfg_of(tmp_path)
    exp = Experiment(cfg, NodeRounds(Wire(cfg, wdir)))
    exp.run_round(1)
    exp.run_round(2)
    emb = Experiment(cfg_of(tmp_path))
    emb.run_round(1)
    emb.run_round(2)
    assert same(exp.params, emb.params)
    err = capfd.readouterr().err
    assert err.count("this node trains in its ClientApp processes") == 1, err
    assert f"no worker answers at {wdir / worker.SOCKET}" in err


def connect_as_nobody(sock: Path) -> str:
    """'connected', 'answered' or the error a process of uid/gid 65534 (nobody) gets connecting to `sock`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: drop to nobody, try, report through the pipe
        code = "?"
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            import socket
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(20)
            s.connect(str(sock))
            code = "connected"
            # a well-formed request, which the worker answers its own user (with a refusal)
            s.sendall(b"".join(worker.pack({"op": "hello"})))
            code = "answered" if s.recv(8) else "connected"
        except OSError as e:
            code = code if code == "connected" else type(e).__name__
        finally:
            os.write(w, code.encode())
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return f.read()


def test_only_the_nodes_user_reaches_the_worker(served):
    """The socket is 0600 in a 0700 folder of the node's user; a process of another user (nobody) cannot connect,
    and with the folder opened up the worker still answers it nothing (SO_PEERCRED)."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user (nobody)")
    folder, _ = served
    sock = folder / worker.SOCKET
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(sock).st_mode & 0o777 == 0o600
    assert os.stat(sock).st_uid == os.getuid()

    assert connect_as_nobody(sock) == "PermissionError"
    with pytest.raises(worker.WorkerError, match="refused"):   # its own user is answered (here: a refusal)
        worker.ask(folder, 1, 0, "{}", RecordDict())
    os.chmod(folder, 0o777)
    os.chmod(sock, 0o777)
    try:
        assert connect_as_nobody(sock) == "connected"   # the kernel let it in; the worker closed without a word
    finally:
        os.chmod(sock, 0o600)
        os.chmod(folder, 0o700)


def test_a_worker_dies_with_its_node_and_restarts_cleanly(wdir):
    """kill -9 of the watched process (the SuperNode) ends the worker; kill -9 of a worker leaves nothing
    behind, a new one replaces its stale socket, and a second worker on a live socket is refused."""
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        w = start_worker(wdir, watch=node.pid)
        node.kill()
        assert gone(w), "the worker outlived its node"
    finally:
        node.kill()
        node.wait()
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        w = start_worker(wdir, watch=node.pid)
        kids = psutil.Process(w.pid).children(recursive=True)
        w.send_signal(signal.SIGKILL)
        w.wait()
        assert not kids and (wdir / worker.SOCKET).exists()   # nothing below it; its socket is stale
        again = start_worker(wdir, watch=node.pid)
        second = subprocess.run([sys.executable, "-m", "fedlase.flower.worker", "--dir", str(wdir),
                                 "--partition-id", "1"], env=env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "already listens" in second.stderr, second.stderr
        assert again.poll() is None
        node.kill()
        assert gone(again)
    finally:
        node.kill()
        node.wait()
