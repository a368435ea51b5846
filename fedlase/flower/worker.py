"""A warm worker beside a SuperNode: one long-lived process per node that holds torch, fedlase's training code,
the node's partition and the model (on a GPU node, the CUDA context and the partition on the device), so that
the ClientApp process Flower starts for every message only hands the message's arrays over and returns the reply.

    python -m fedlase.flower.worker --dir DIR --partition-id N [--watch-pid PID]

Flower keeps transport, authentication, scheduling and the app bundle; the SuperNode is started with
`--node-config "partition-id=N ... worker-dir='DIR'"` and its ClientApp (fedlase/flower/client_app.py) asks the
worker at `DIR/worker.sock`. That half (`ask`, `say_once`) imports only Flower and the standard library: the
ClientApp process never imports torch when a worker answers.

- **Only the node's user.** DIR is a private directory (mode 0700, owned by the worker's user; made so if
  missing, refused otherwise) and the socket in it is a filesystem Unix socket created with mode 0600 (never
  Linux's abstract namespace, which has no permissions). Both ends also check the other's uid (SO_PEERCRED):
  the worker answers nothing to another user, and a ClientApp hands no model to a socket another user serves.
- **Dies with the node.** The worker watches `--watch-pid` (the SuperNode; default: its parent) through a pidfd
  and exits when it ends, SIGKILL included; a worker whose parent is that process also gets PR_SET_PDEATHSIG.
  It starts no process of its own. A stale socket (a killed worker) is replaced; a live one is not (a lock
  file that the kernel releases when the worker dies, however it dies).
- **One run, one partition.** The first TRAIN message binds the worker to its run (Flower's run id and the
  fedlase config); a message for another run or another partition is refused. A ClientApp that finds no
  worker, or is refused, trains in its own process as before (the same code, so the same result) and says so
  once in the node's log (a marker file in DIR, cleared when a worker starts).

Wire format, both ways: 8 bytes (big-endian) the length of a JSON header, the header, then the raw blobs it lists
(each array's `.npy` bytes exactly as Flower carries them, so a reply is byte for byte the in-process one)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

SOCKET = "worker.sock"
MAX_HEADER = 64 << 20    # a header holds the config text and the array list: far below this
MAX_BLOBS = 16 << 30     # the payload of one message (a ResNet-18 submodel is 45 MB)
CONNECT_TIMEOUT = 5.0    # connecting to a listening Unix socket is immediate; a full backlog is not a worker
_LOCK: int | None = None   # the worker's lock on its folder (bind)


class WorkerError(RuntimeError):
    """The worker could not be used (no socket, another user's, a refusal); the message says why."""


class Closed(WorkerError):
    """The peer closed the connection before sending a byte (a probe: `listening`)."""


# ---- the wire --------------------------------------------------------------------------------------------------
def pack(header: dict, records: RecordDict | None = None) -> list[bytes]:
    """A frame: the header (with `records` described in it) and the arrays' bytes."""
    blobs, entries = [], []
    for name, rec in (records or {}).items():
        if isinstance(rec, ArrayRecord):
            arrays = []
            for key, a in rec.items():
                arrays.append([key, a.dtype, list(a.shape), a.stype, len(a.data)])
                blobs.append(bytes(a.data))
            entries.append({"name": name, "kind": "array", "arrays": arrays})
        elif isinstance(rec, (ConfigRecord, MetricRecord)):
            kind = "config" if isinstance(rec, ConfigRecord) else "metric"
            entries.append({"name": name, "kind": kind, "items": dict(rec)})
        else:
            raise WorkerError(f"record {name!r} of type {type(rec).__name__} cannot travel to the worker")
    head = json.dumps({**header, "records": entries}).encode()
    return [struct.pack(">Q", len(head)), head, *blobs]


def unpack(header: dict, blobs: list[bytes]) -> RecordDict:
    out, i = {}, 0
    for e in header.get("records", []):
        if e["kind"] == "array":
            rec = ArrayRecord()
            for key, dtype, shape, stype, _ in e["arrays"]:
                rec[key] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=blobs[i])
                i += 1
            out[e["name"]] = rec
        else:
            out[e["name"]] = (ConfigRecord if e["kind"] == "config" else MetricRecord)(e["items"])
    return RecordDict(out)


def _recv_exact(conn: socket.socket, n: int, first: bool = False) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            if first and not got:
                raise Closed("the connection closed")
            raise WorkerError("the connection closed mid-frame")
        got += k
    return bytes(buf)


def send(conn: socket.socket, header: dict, records: RecordDict | None = None) -> None:
    conn.sendall(b"".join(pack(header, records)))


def receive(conn: socket.socket) -> tuple[dict, RecordDict]:
    (n,) = struct.unpack(">Q", _recv_exact(conn, 8, first=True))
    if n > MAX_HEADER:
        raise WorkerError(f"a header of {n} bytes is larger than {MAX_HEADER}")
    header = json.loads(_recv_exact(conn, n))
    sizes = [a[4] for e in header.get("records", []) if e.get("kind") == "array" for a in e["arrays"]]
    if sum(sizes) > MAX_BLOBS:
        raise WorkerError(f"a payload of {sum(sizes)} bytes is larger than {MAX_BLOBS}")
    return header, unpack(header, [_recv_exact(conn, int(s)) for s in sizes])


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (the kernel's word, SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def check_private(folder: Path) -> None:
    """DIR must be a directory of this user that nobody else may enter (else anyone could swap the socket)."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WorkerError(f"{folder} must be a directory owned by uid {os.getuid()} with mode 0700 "
                          f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")


# ---- the ClientApp's half (no torch) ---------------------------------------------------------------------------
def ask(folder: str | Path, run_id: int, partition: int, config_text: str,
        content: RecordDict) -> tuple[dict, RecordDict]:
    """Hand a TRAIN message's content to the worker in `folder`; -> (the reply's header, its content). Raises
    WorkerError if there is no usable worker (the caller then trains itself); a training error in the worker
    comes back as RuntimeError, as it would have been raised in-process."""
    folder = Path(folder)
    try:
        check_private(folder)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:
        raise WorkerError(f"no worker directory at {folder} ({e.strerror or e})") from None
    with conn:
        try:
            conn.settimeout(CONNECT_TIMEOUT)
            conn.connect(str(folder / SOCKET))
            conn.settimeout(None)   # training may take long; a worker that dies closes the socket
            if peer_uid(conn) != os.getuid():
                raise WorkerError(f"{folder / SOCKET} is served by another user; not handing it the model")
            send(conn, {"op": "train", "run": int(run_id), "partition": int(partition), "config": config_text},
                 content)
            header, reply = receive(conn)
        except OSError as e:
            raise WorkerError(f"no worker answers at {folder / SOCKET} ({e.strerror or e})") from None
    if "refused" in header:
        raise WorkerError(f"the worker refused: {header['refused']}")
    if "error" in header:
        raise RuntimeError(f"the node's worker failed to train: {header['error']}")
    return header, reply


def listening(folder: str | Path) -> bool:
    """Whether a worker listens in `folder` now (a stale socket refuses the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(Path(folder) / SOCKET))
            return True
        except OSError:
            return False


def say_once(folder: str | Path, run_id: int, why: str) -> bool:
    """Write to the node's log (this process's stderr, which the SuperNode keeps) that its messages train in
    their own processes, once per run and worker outage (a marker file in `folder`). -> whether it was said."""
    marker = Path(folder) / f"in-process-run-{int(run_id)}"
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    except FileExistsError:
        return False
    except OSError:
        pass   # no folder to mark: say it every time rather than never
    print(f"fedlase: {why}; this node trains in its ClientApp processes (the same result, slower)",
          file=sys.stderr, flush=True)
    return True


# ---- the worker ------------------------------------------------------------------------------------------------
def watch(pid: int) -> None:
    """Exit the moment process `pid` ends (the SuperNode): a pidfd becomes readable then, and cannot be confused
    with a later process of the same pid. If `pid` is the parent, the kernel also kills us when it dies."""
    if pid == os.getppid():
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:
        raise WorkerError(f"--watch-pid {pid}: no such process ({e.strerror})") from None

    def wait():
        import select
        select.select([fd], [], [])
        os._exit(0)   # the node is gone: nothing to finish, nothing to flush
    threading.Thread(target=wait, daemon=True, name="watch-node").start()


def bind(folder: Path) -> socket.socket:
    """The listening socket `folder/worker.sock`, mode 0600 from its creation. A lock on `folder/worker.lock`,
    held for the worker's life and dropped by the kernel when it dies (kill -9 too), says whether another worker
    serves the folder: if not, a socket left there is stale and replaced."""
    import fcntl
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
    check_private(folder)
    path = folder / SOCKET
    if len(os.fsencode(path)) > 107:
        raise WorkerError(f"{path} is longer than a Unix socket path may be (107 bytes); choose a shorter --dir")
    lock = os.open(folder / "worker.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise WorkerError(f"a worker already listens at {path}") from None
    global _LOCK
    _LOCK = lock   # kept open (and locked) until the process ends
    path.unlink(missing_ok=True)   # stale: the worker that made it is gone
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    srv.listen(8)
    for f in folder.glob("in-process-run-*"):   # a new worker: a later outage is worth saying again
        f.unlink(missing_ok=True)
    return srv


class Worker:
    """Serves TRAIN requests for one partition and, from its first request on, one run."""

    def __init__(self, partition: int):
        self.partition = partition
        self.run: tuple[int, str] | None = None   # (Flower run id, digest of the fedlase config)

    def handle(self, header: dict, content: RecordDict) -> tuple[dict, RecordDict | None]:
        import hashlib

        from . import client_app
        digest = hashlib.sha256(str(header.get("config", "")).encode()).hexdigest()[:16]
        run = (int(header.get("run", -1)), digest)
        if header.get("op") != "train":
            return {"refused": f"unknown request {header.get('op')!r}"}, None
        if int(header.get("partition", -1)) != self.partition:
            return {"refused": f"this worker serves partition {self.partition}, not {header.get('partition')}"}, None
        if self.run is None:
            self.run = run
        elif run != self.run:
            return {"refused": f"this worker serves run {self.run[0]} (config {self.run[1]}), "
                               f"not run {run[0]} (config {run[1]})"}, None
        try:
            pid, rnd = client_app.task_ids(content, self.partition)
            times: dict[str, float] = {}
            cfg = client_app.config_of(header["config"])
            reply = client_app.train_content(cfg, content, pid, rnd, times)
        except Exception as e:   # reported to the ClientApp, which fails the message as in-process training would
            return {"error": f"{type(e).__name__}: {e}"}, None
        print(f"fedlase worker: run {run[0]} round {rnd}: trained partition {pid} "
              f"({', '.join(f'{k} {v:.3f} s' for k, v in times.items())})", file=sys.stderr, flush=True)
        return {"ok": True, "times": times}, reply

    def serve(self, srv: socket.socket) -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                try:
                    if peer_uid(conn) != os.getuid():   # the folder's mode already keeps others out
                        continue
                    conn.settimeout(60.0)   # a request arrives at once; a silent peer is dropped
                    header, content = receive(conn)
                    conn.settimeout(None)
                    reply_header, reply = self.handle(header, content)
                    send(conn, reply_header, reply)
                except Closed:   # a probe (`listening`)
                    pass
                except (OSError, WorkerError, ValueError) as e:
                    print(f"fedlase worker: dropped a request: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedlase.flower.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, type=Path, help="the node's private worker directory (mode 0700)")
    ap.add_argument("--partition-id", required=True, type=int, help="the partition this node serves")
    ap.add_argument("--watch-pid", type=int, default=None, help="exit when this process (the SuperNode) ends; "
                                                                "default: the parent")
    a = ap.parse_args(argv)
    try:
        watch(a.watch_pid if a.watch_pid is not None else os.getppid())
        srv = bind(a.dir.expanduser().absolute())
    except (WorkerError, OSError) as e:
        print(f"fedlase worker: error: {e}", file=sys.stderr)
        return 2
    path = srv.getsockname()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    t = time.monotonic()
    import torch  # noqa: F401  (warm: the ClientApp processes never pay this)

    from . import client_app, codec, node_data  # noqa: F401
    print(f"fedlase worker: partition {a.partition_id} at {path} (ready in {time.monotonic() - t:.1f} s)",
          file=sys.stderr, flush=True)
    try:
        Worker(a.partition_id).serve(srv)
    finally:
        srv.close()
        Path(path).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
