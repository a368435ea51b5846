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
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from flwr.app import RecordDict

from .worker_link import (  # noqa: F401
    SOCKET,
    Closed,
    WorkerError,
    ask,
    check_private,
    listening,
    pack,
    peer_uid,
    receive,
    say_once,
    send,
    unpack,
)

_LOCK: int | None = None   # the worker's lock on its folder (bind)


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
