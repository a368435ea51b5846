"""The warm worker beside a SuperNode (fedlase/flower/worker.py): a worker process on a private socket trains
what the ClientApp hands it bit for bit as the ClientApp would itself, refuses another run or partition, is
reachable by its own user only, dies with the process it watches (its parent too, when that dies during the
worker's start-up), replaces a stale socket; a ClientApp without a worker trains in-process and says so once.
Issue 43's hardening: one worker survives every malformed frame, a claim without bytes, a MemoryError and a
trickling client, then trains an honest message; a stopped worker is passed over; a working folder cannot inject
a module; a swapped socket folder never leads a bind outside it. The loopback deployment whose worker is killed
mid-run is in tests/test_flower_security.py, on that module's federation."""
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


def start_worker(folder: Path, partition: int = SERVED, watch: int | None = None, log=None, more=(),
                 cwd=None) -> subprocess.Popen:
    """A worker process (started as `python -m`, without -P: the worker's own import-path rule is what holds);
    returns once its socket listens (it binds before importing torch; a killed worker's stale socket refuses
    connections)."""
    cmd = [sys.executable, "-m", "fedlase.flower.worker", "--dir", str(folder), "--partition-id", str(partition)]
    p = subprocess.Popen(cmd + ([] if watch is None else ["--watch-pid", str(watch)]) + list(more), env=env(),
                         cwd=cwd, stdout=log or subprocess.DEVNULL,
                         stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
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
    and with the folder opened up the worker still answers it nothing (SO_PEERCRED). The modes and its own user's
    answer are checked as any user; only the other user's attempts need root (CI may run unprivileged)."""
    folder, _ = served
    sock = folder / worker.SOCKET
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(sock).st_mode & 0o777 == 0o600
    assert os.stat(sock).st_uid == os.getuid()
    with pytest.raises(worker.WorkerError, match="refused"):   # its own user is answered (here: a refusal)
        worker.ask(folder, 1, 0, "{}", RecordDict())
    if os.getuid() != 0:
        pytest.skip("the rest needs root to run a process as another user (nobody)")

    assert connect_as_nobody(sock) == "PermissionError"
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


# ---- what a local process may send, and how the worker starts (issue 43) ---------------------------------------
DEADLINE = 4.0   # the hardened worker's request deadline (seconds): short, so that a trickling client costs little
GiB = 1 << 30
# A folder another user could write, holding a module the first message imports lazily (hmac imports it).
_SECRETS = "open({marker!r}, 'w').write('ran')\n"


@pytest.fixture(scope="module")
def hardened(tmp_path_factory):
    """One worker for partition SERVED with a DEADLINE-second request deadline, started from a working folder
    that holds a `secrets.py` (which would write `marker` if imported); -> (folder, process, marker, the run's
    config and its text)."""
    folder, cwd = Path(tempfile.mkdtemp(prefix="fw-")), Path(tempfile.mkdtemp(prefix="fw-cwd-"))
    cfg = cfg_of(tmp_path_factory.mktemp("hardened"))
    marker = cwd / "secrets-ran"
    (cwd / "secrets.py").write_text(_SECRETS.format(marker=str(marker)))
    with open(folder / "worker.log", "w") as log:
        p = start_worker(folder, log=log, more=["--deadline", str(DEADLINE)], cwd=cwd)
    yield folder, p, marker, cfg, json.dumps(cfg.to_dict(), default=str)
    p.send_signal(signal.SIGCONT)
    p.terminate()
    p.wait(timeout=30)
    import shutil
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(cwd, ignore_errors=True)


def frame(header) -> bytes:
    """A frame's first part: a header (bytes as they are, anything else as JSON) with its length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "big") + raw


def connect(folder: Path):
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(folder / worker.SOCKET))
    return s


def exchange(folder: Path, raw: bytes) -> dict | None:
    """The worker's reply header to the bytes `raw` sent on a connection of their own; None: it closed it."""
    import socket
    with connect(folder) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass   # refused before all of it was read
        try:
            return worker.receive(s, keepalive=True)[0]
        except (OSError, worker.WorkerError):
            return None


def rss(pid: int) -> int:
    """Resident bytes of process `pid` (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def exhausted(folder: Path, pid: int) -> dict | None:
    """A MemoryError while a request arrives: the worker's address space capped just above its size, a payload
    streamed into it until it gives up; the cap lifted again. -> the reply header (None: dropped)."""
    import resource
    import socket
    proc = psutil.Process(pid)
    old = proc.rlimit(resource.RLIMIT_AS)
    s = connect(folder)
    try:
        s.sendall(frame({"records": [{"name": "w", "kind": "array",
                                      "arrays": [["w", "uint8", [GiB], "numpy.ndarray", GiB]]}]}))
        time.sleep(0.3)   # the request's thread runs: its stack is mapped before the cap
        proc.rlimit(resource.RLIMIT_AS, (proc.memory_info().vms + (64 << 20), old[1]))
        chunk = bytes(1 << 20)
        for _ in range(512):
            s.sendall(chunk)
    except OSError:
        pass   # the worker gave up and closed
    finally:
        proc.rlimit(resource.RLIMIT_AS, old)
    with s:
        s.shutdown(socket.SHUT_WR)
        try:
            return worker.receive(s, keepalive=True)[0]
        except (OSError, worker.WorkerError):
            return None


def test_no_frame_kills_the_worker(hardened, task_identity):
    """Every header of issue 43 (items 1-3) in turn to one worker, a 1.5 GiB claim without its bytes (RSS
    unchanged), a MemoryError while a request arrives, and a valid header without content for run 999: each
    gets a refusal, an error or a closed connection, and none binds the worker. Then an honest message trains
    and its reply is byte for byte the in-process one; the `secrets.py` of the worker's working folder never
    ran."""
    folder, proc, marker, cfg, text = hardened
    content = _train_content(cfg)
    ok = {"op": "train", "run": 7, "partition": SERVED, "config": text}

    def arrays(*entries):
        return {**ok, "records": [{"name": "w", "kind": "array", "arrays": list(entries)}]}
    f32 = ["w", "float32", [1], "numpy.ndarray"]
    malformed = [
        frame([]),                                                   # a JSON list
        frame(b"[" * 100_000 + b"]" * 100_000),                      # nested 100,000 deep
        frame({**ok, "records": 5}),
        frame({**ok, "records": [{"name": "w", "kind": "array"}]}),  # an array record without `arrays`
        frame(arrays([*f32, "4"])),                                  # a size given as a string
        frame(arrays([*f32, 1e30], [*f32, -1e30])),
        frame(arrays([*f32, 20 * GiB], [*f32, -20 * GiB])),          # negative sizes that sum to 0
        frame({**ok, "records": [{"name": "c", "kind": "config", "items": {"a": {"b": 1}}}]}),
        frame({**ok, "records": [{"name": "m", "kind": "metric", "items": {"a": "text"}}]}),   # Flower refuses
        frame(arrays(["w", "float32", 5, "numpy.ndarray", 4])),      # shape=5
        frame(b"\xff\xfe not json"),
        (1 << 62).to_bytes(8, "big"),                                # a header larger than any
    ]
    for raw in malformed:
        reply = exchange(folder, raw)
        assert reply is not None and "malformed request" in reply["refused"], (raw[:80], reply)
        assert proc.poll() is None
    for bad in ({**ok, "run": None}, {**ok, "partition": [1]}, {**ok, "config": {"a": 1}}, {**ok, "op": 3}):
        reply = exchange(folder, b"".join(worker.pack(bad, content)))
        assert reply is not None and "refused" in reply, (bad, reply)
        assert proc.poll() is None

    before = rss(proc.pid)
    with connect(folder) as s:   # 1.5 GiB claimed, nothing sent: the worker waits, its memory unchanged
        s.sendall(frame(arrays(["w", "uint8", [3 * GiB // 2], "numpy.ndarray", 3 * GiB // 2])))
        peak = before
        for _ in range(20):
            time.sleep(0.05)
            peak = max(peak, rss(proc.pid))
        s.settimeout(0.1)
        with pytest.raises(TimeoutError):   # no reply: it is waiting for the bytes
            s.recv(1)
    assert peak - before < 32 << 20, f"RSS {before >> 20} MiB -> {peak >> 20} MiB"

    assert exhausted(folder, proc.pid) is None and proc.poll() is None
    reply = exchange(folder, b"".join(worker.pack({**ok, "run": 999})))   # no content: fails, binds nothing
    assert reply is not None and "KeyError" in reply["error"], reply
    assert proc.poll() is None

    header, reply = worker.ask(folder, 7, SERVED, text, content)
    assert header["ok"] and b"".join(worker.pack({}, reply)) == in_process(text, content)
    log = (folder / "worker.log").read_text()
    assert "MemoryError" in log and "run 7 round 3: trained partition 1" in log, log
    assert not marker.exists(), "the worker imported its working folder's secrets.py"
    with pytest.raises(worker.WorkerError, match="larger than this run's messages"):   # bound: its model's size
        worker.ask(folder, 7, SERVED, text, RecordDict({"w": _big_record(8 << 20)}))


_REPLIES: dict = {}


def in_process(text: str, content) -> bytes:
    """The frame of the reply the ClientApp computes in-process for `content` (once per config)."""
    if text not in _REPLIES:
        reply = client_app.train_content(client_app.config_of(text), content, SERVED, 3)
        _REPLIES[text] = b"".join(worker.pack({}, reply))
    return _REPLIES[text]


def _big_record(n: int):
    import numpy as np
    from flwr.app import Array, ArrayRecord
    return ArrayRecord({"w": Array(np.zeros(n, np.uint8))})


def test_a_slow_client_loses_its_connection_and_delays_nobody(hardened, task_identity):
    """A client trickling a header one byte at a time is cut off at the request deadline, not per recv; an
    honest request sent meanwhile is answered before that."""
    import select
    import threading
    folder, proc, _, cfg, text = hardened
    head = json.dumps({"op": "train", "run": 7, "partition": SERVED, "config": text}).encode()
    slow = connect(folder)
    slow.sendall(len(head).to_bytes(8, "big"))
    start, cut = time.monotonic(), []

    def trickle():
        for b in head:
            try:
                slow.send(bytes([b]))
                if select.select([slow], [], [], 0.2)[0] and not slow.recv(1):
                    break   # closed by the worker
            except OSError:
                break
        cut.append(time.monotonic() - start)
    t = threading.Thread(target=trickle)
    t.start()
    try:
        time.sleep(0.2)
        header, reply = worker.ask(folder, 7, SERVED, text, _train_content(cfg))
        answered = time.monotonic() - start
        t.join(timeout=DEADLINE + 20)
    finally:
        slow.close()
    assert header["ok"] and "delta" in reply
    # the whole header would take minutes; the margin is for a busy machine, where the worker's threads wait
    # for a core while the honest request trains (11 s seen under a load of 8 on 2 cores)
    assert cut and DEADLINE - 0.5 < cut[0] < DEADLINE + 15, cut
    assert answered < cut[0], (answered, cut)
    assert proc.poll() is None


def test_a_stopped_worker_is_passed_over_within_the_timeout(hardened, task_identity, monkeypatch, capfd):
    """A worker that stopped (SIGSTOP) sends no keepalive: `ask` gives up after its timeout, and the ClientApp
    trains the message in its own process (the same reply) with its one line in the node's log."""
    from flwr.app import Message

    from fedlase.flower import worker_link
    folder, proc, _, cfg, text = hardened
    content = _train_content(cfg)
    proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(worker.WorkerError, match="timed out"):
            worker.ask(folder, 7, SERVED, text, content, timeout=1.0)
        assert time.monotonic() - t < 3
        monkeypatch.setattr(worker_link, "REPLY_TIMEOUT", 1.0)
        ctx = Context(run_id=7, node_id=0, node_config={"partition-id": SERVED, "worker-dir": str(folder)},
                      state=RecordDict(), run_config={"fedlase-config": text})
        reply = client_app.train(Message(content, dst_node_id=0, message_type="train"), ctx)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert b"".join(worker.pack({}, reply.content)) == in_process(text, content)
    err = capfd.readouterr().err
    assert err.count("this node trains in its ClientApp processes") == 1 and "timed out" in err, err


_LAUNCHER = """
import subprocess, sys
w = subprocess.Popen([sys.executable, "-m", "fedlase.flower.worker", "--dir", sys.argv[1], "--partition-id", "1"])
print(w.pid, flush=True)
w.wait()
"""


def test_a_parent_killed_during_start_up_leaves_no_worker(wdir):
    """The default watch (the parent) is read and armed before the worker's slow imports: a parent killed while
    the worker imports flwr and torch takes it along."""
    parent = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(wdir)], env=env(), stdout=subprocess.PIPE,
                              text=True)
    pid = int(parent.stdout.readline())
    time.sleep(0.5)   # the worker imports (flwr alone takes longer)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:   # gone: its leader exited (a zombie until reaped) and no thread listens
        try:
            ended = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            ended = True
        if ended and not worker.listening(wdir):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the worker outlived its parent")


# Another user's swap of the socket folder, played by this user: the folder and a symlink to a folder outside it
# exchanged atomically (renameat2 RENAME_EXCHANGE), as fast as it goes, until killed.
_SWAPPER = """
import ctypes, os, sys
a, b = sys.argv[1:3]
libc = ctypes.CDLL(None, use_errno=True)
exchange = getattr(libc, "renameat2", None)
print("go", flush=True)
while True:
    if exchange is not None:
        exchange(-100, a.encode(), -100, b.encode(), 2)   # AT_FDCWD, RENAME_EXCHANGE
    else:   # no renameat2 in this libc: the same swap in three renames
        try:
            os.rename(a, a + ".x"); os.rename(b, a); os.rename(a + ".x", b)
        except OSError:
            pass
"""


def snapshot(folder: Path) -> dict:
    """Every entry below `folder` with its type, mode, owner and content (files)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_mode, st.st_uid, p.read_bytes() if p.is_file() and
                                           not p.is_symlink() else None)
    return out


def test_a_swapped_folder_never_leads_the_worker_outside_it(tmp_path, monkeypatch, capsys):
    """Under a parent folder that another user could write (mode 0777, not sticky), that user swaps the socket
    folder for a symlink to a private folder while the worker binds, 200 times: the worker opens the folder once
    without following a link and works through its descriptor, so nothing outside the socket folder is created
    or changed (the victim holds a `worker.sock` and a marker that a bind by path would remove or chmod). The
    parent check that refuses such a folder in the first place is switched off for the race; on, it refuses
    with one line. Missing parents are made 0700 whatever the umask."""
    top = tmp_path / "t"
    victim, shared = top / "victim", top / "shared"
    victim.mkdir(parents=True, mode=0o700)
    (victim / worker.SOCKET).write_text("not a socket")
    (victim / "in-process-run-1").write_text("")
    os.chmod(victim / worker.SOCKET, 0o644)
    shared.mkdir()
    os.chmod(shared, 0o777)
    folder = shared / "d"
    folder.mkdir(mode=0o700)
    (shared / "link").symlink_to(victim)
    before = snapshot(victim)

    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(folder), str(shared / "link")],
                               stdout=subprocess.PIPE, text=True)
    outcomes = {"bound": 0, "refused": 0}
    try:
        assert swapper.stdout.readline().strip() == "go"
        with monkeypatch.context() as m:
            m.setattr(worker, "check_parents", lambda folder: None)
            for _ in range(200):
                try:
                    worker.bind(folder).close()
                    outcomes["bound"] += 1
                except worker.WorkerError:
                    outcomes["refused"] += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert snapshot(victim) == before, outcomes
    assert sorted(os.listdir(top)) == ["shared", "victim"] and sorted(os.listdir(shared)) == ["d", "link"]
    assert outcomes["refused"], f"the swap never raced a bind: {outcomes}"

    if folder.is_symlink():   # the swapper's last exchange: the real folder back in place
        os.rename(shared / "link", shared / "x")
        os.rename(folder, shared / "link")
        os.rename(shared / "x", folder)
    assert worker.main(["--dir", str(folder), "--partition-id", "1", "--watch-pid", str(os.getpid())]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"its parent {shared} can be changed by another user" in err, err

    old = os.umask(0)
    try:
        deep = top / "a" / "b" / "c"
        worker.bind(deep).close()
    finally:
        os.umask(old)
    assert [oct(os.stat(p).st_mode & 0o777) for p in (top / "a", top / "a" / "b", deep)] == ["0o700"] * 3
