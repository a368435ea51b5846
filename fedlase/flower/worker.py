"""A warm worker beside a SuperNode: one long-lived process per node that holds torch, fedlase's training code,
the node's partition and the model (on a GPU node, the CUDA context and the partition on the device), so that
the ClientApp process Flower starts for every message only hands the message's arrays over and returns the reply.

    python -P -m fedlase.flower.worker --dir DIR --partition-id N [--watch-pid PID] [--deadline S]

Flower keeps transport, authentication, scheduling and the app bundle; the SuperNode is started with
`--node-config "partition-id=N ... worker-dir='DIR'"` and its ClientApp (fedlase/flower/client_app.py) asks the
worker at `DIR/worker.sock`. That half (`ask`, `say_once`) imports only Flower and the standard library: the
ClientApp process never imports torch when a worker answers.

- **Only the node's user.** DIR is a private directory (mode 0700, owned by the worker's user; made so, with
  any missing parents, whatever the umask; refused otherwise, and refused under a parent that another user
  could write unless it is sticky like /tmp). The worker opens DIR once, without following a symlink, and works
  through that descriptor (the lock opened O_NOFOLLOW, the socket bound and stale files removed in the folder it
  checked), so a folder swapped under it afterwards changes nothing. The socket is a filesystem Unix socket
  created with mode 0600 (the umask at bind; never Linux's abstract namespace, which has no permissions). Both
  ends also check the other's uid (SO_PEERCRED): the worker answers nothing to another user, and a ClientApp
  hands no model to a socket another user serves.
- **Whatever a local process sends.** A frame's header is checked (size, nesting, shape and types) before
  anything is read or built from it; its payload is bounded by the bound run's model (`message_limit`; before a
  run is bound, UNBOUND_LIMIT) and read into memory only as it arrives; a request must arrive whole within
  `--deadline` seconds. Any failure while serving one request ends with a reply or a closed connection, never
  the worker. Connections are served concurrently (training one at a time), so a slow client delays nobody.
- **Dies with the node.** The worker watches `--watch-pid` (the SuperNode; default: its parent, read and
  armed with PR_SET_PDEATHSIG before anything slow is imported) through a pidfd and exits when it ends, SIGKILL
  included. It starts no process of its own. A stale socket (a killed worker) is replaced; a live one is not
  (a lock file that the kernel releases when the worker dies, however it dies).
- **A safe import path.** Run as a module, it drops its working folder from `sys.path` before importing
  anything else (`-P` does so for Python's own start-up too), so a folder another user can write cannot shadow
  a module that the first message imports.
- **One run, one partition.** The first TRAIN message that trains, complete and valid, binds the worker to its
  run (Flower's run id and the fedlase config); a message for another run or another partition is refused. A
  ClientApp that finds no worker, is refused, or hears nothing from it for REPLY_TIMEOUT seconds (a training
  worker sends a keepalive every HEARTBEAT s) trains in its own process as before (the same code, so the same
  result) and says so once in the node's log (a marker file in DIR, cleared when a worker starts).

Wire format, both ways: 8 bytes (big-endian) the length of a JSON header, the header, then the raw blobs it lists
(each array's `.npy` bytes exactly as Flower carries them, so a reply is byte for byte the in-process one); from
the worker, a length of 0 is a keepalive."""
from __future__ import annotations

import os
import sys


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process with SIGKILL when its parent ends."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)
    except (OSError, AttributeError):
        pass


def _start_safely() -> int | None:
    """What `python -m fedlase.flower.worker` does before its slow imports (flwr, torch): the working folder
    leaves the import path, and without --watch-pid the parent is read and armed to take this process with it,
    so a parent that dies during start-up leaves no worker. -> the parent's pid (None with --watch-pid)."""
    try:
        here = os.getcwd()
    except OSError:   # a working folder that is gone shadows nothing
        here = ""
    # wherever it stands: `-m` puts it first, and an empty PYTHONPATH entry ("/a:") adds it again further on
    sys.path[:] = [p for p in sys.path if p not in ("", ".", here)]
    if any(arg.split("=")[0] == "--watch-pid" for arg in sys.argv[1:]):
        return None
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:   # it died between the two: nobody to serve
        os._exit(0)
    return parent


_PARENT = _start_safely() if __name__ == "__main__" else None

import argparse  # noqa: E402
import hashlib  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import stat  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

from flwr.app import RecordDict  # noqa: E402

from .worker_link import (  # noqa: E402, F401
    HEARTBEAT,
    KEEPALIVE,
    SOCKET,
    UNBOUND_LIMIT,
    BadFrame,
    Closed,
    WorkerError,
    ask,
    check_private,
    listening,
    pack,
    peer_uid,
    private_problem,
    receive,
    say_once,
    send,
    unpack,
)

DEADLINE = 10.0     # seconds a request may take to arrive whole (a ResNet-18 message takes milliseconds)
MAX_CLIENTS = 16    # connections served at once; one more is closed at once (its ClientApp trains itself)


# ---- start-up --------------------------------------------------------------------------------------------------
def watch(pid: int) -> None:
    """Exit the moment process `pid` ends (the SuperNode): a pidfd becomes readable then, and cannot be confused
    with a later process of the same pid. If `pid` is the parent, the kernel also kills us when it dies."""
    if pid == os.getppid():
        _die_with_parent()
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:
        raise WorkerError(f"--watch-pid {pid}: no such process ({e.strerror})") from None

    def wait():
        import select
        select.select([fd], [], [])
        os._exit(0)   # the node is gone: nothing to finish, nothing to flush
    threading.Thread(target=wait, daemon=True, name="watch-node").start()


def check_parents(folder: Path) -> None:
    """Refuse a folder that a user other than this one could swap: every existing directory above it, as written
    and as its symlinks resolve, must be this user's or root's, and writable by no one else unless sticky (like
    /tmp, where no one may rename another's entry)."""
    real = Path(os.path.realpath(folder.parent))
    for d in dict.fromkeys([*folder.parents, real, *real.parents]):
        try:
            st = os.stat(d)
        except FileNotFoundError:   # made below, by this user
            continue
        if st.st_uid not in (0, os.getuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise WorkerError(f"{folder}: its parent {d} can be changed by another user (uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); choose a folder whose parents only you or root "
                              f"can write, or that are sticky like /tmp")


def open_folder(folder: Path) -> int:
    """A descriptor of the private folder `folder` (made mode 0700 with any missing parents, whatever the umask),
    opened without following a symlink and checked through the descriptor itself."""
    check_parents(folder)
    missing = []
    p = folder
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    old = os.umask(0o077)
    try:
        for p in reversed(missing):
            try:
                os.mkdir(p, 0o700)
            except FileExistsError:
                pass
    finally:
        os.umask(old)
    rule = f"{folder} must be a directory owned by uid {os.getuid()} with mode 0700"
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:   # ELOOP or ENOTDIR: a symlink, a file
        raise WorkerError(f"{rule} (it is not: {e.strerror})") from None
    why = private_problem(os.fstat(fd))
    if why:
        os.close(fd)
        raise WorkerError(f"{rule} ({why})")
    return fd


class Bound(NamedTuple):
    """A listening worker socket, its folder's descriptor and its lock (held for the worker's life, dropped by
    the kernel when it dies, kill -9 too)."""
    srv: socket.socket
    folder: int
    lock: int

    def close(self) -> None:
        self.srv.close()
        try:
            os.unlink(SOCKET, dir_fd=self.folder)
        except FileNotFoundError:
            pass
        os.close(self.lock)
        os.close(self.folder)


def bind(folder: Path) -> Bound:
    """The listening socket `folder/worker.sock`, mode 0600 from its creation, everything done in the folder
    `open_folder` checked (through its descriptor). The lock on `folder/worker.lock` says whether another
    worker serves the folder: if not, a socket left there is stale and replaced."""
    import fcntl
    path = folder / SOCKET
    if len(os.fsencode(path)) > 107:   # what a ClientApp connects to
        raise WorkerError(f"{path} is longer than a Unix socket path may be (107 bytes); choose a shorter --dir")
    with ExitStack() as undo:   # on any failure, closed again
        fd = open_folder(folder)
        undo.callback(os.close, fd)
        lock = os.open("worker.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        undo.callback(os.close, lock)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkerError(f"a worker already listens at {path}") from None
        try:
            os.unlink(SOCKET, dir_fd=fd)   # stale: the worker that made it is gone
        except FileNotFoundError:
            pass
        srv = undo.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        old = os.umask(0o177)
        try:   # bind() takes a path, not a descriptor: the folder's own, through /proc
            srv.bind(f"/proc/self/fd/{fd}/{SOCKET}")
        finally:
            os.umask(old)
        srv.listen(8)
        for name in os.listdir(fd):   # a new worker: a later outage is worth saying again
            if name.startswith("in-process-run-"):
                os.unlink(name, dir_fd=fd)
        undo.pop_all()
        return Bound(srv, fd, lock)


# ---- serving ---------------------------------------------------------------------------------------------------
def message_limit(model) -> int:
    """The most payload bytes a TRAIN message for `model` can carry, with the front proxy's margin of 2: per
    parameter or buffer its values (dense), two packed bit masks, its kept indices per dimension (int64) and
    three .npy headers; at least 1 MiB."""
    from .codec import NPY_HEADER_SLACK
    need = sum(t.numel() * t.element_size() + t.numel() // 4 + 8 * sum(t.shape) + 3 * NPY_HEADER_SLACK
               for t in [*model.parameters(), *model.buffers()])
    return max(1 << 20, 2 * need)


def _say(line: str) -> None:
    try:
        print(f"fedlase worker: {line}", file=sys.stderr, flush=True)
    except Exception:   # noqa: BLE001 -- no memory left even to say it: the request is dropped all the same
        pass


def _digest(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()[:16]


class Worker:
    """Serves TRAIN requests for one partition and, from its first complete and valid request on, one run."""

    def __init__(self, partition: int, deadline: float = DEADLINE):
        self.partition, self.deadline = partition, deadline
        self.run: tuple[int, str] | None = None   # (Flower run id, digest of the fedlase config)
        self.limit = UNBOUND_LIMIT                # payload bytes a request may carry
        self.training = threading.Lock()          # one training at a time; connections are served at once
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)

    def refusal(self, header: dict) -> str | None:
        """Why this worker does not train the request `header` (already a well-formed frame), or None."""
        if header.get("op") != "train":
            return f"unknown request {header.get('op')!r}"
        run, pid, config = header.get("run"), header.get("partition"), header.get("config")
        if type(run) is not int or type(pid) is not int or not isinstance(config, str):
            return "a train request names its run and partition (integers) and its config (text)"
        if pid != self.partition:
            return f"this worker serves partition {self.partition}, not {pid}"
        if self.run is not None and (run, _digest(config)) != self.run:
            return (f"this worker serves run {self.run[0]} (config {self.run[1]}), "
                    f"not run {run} (config {_digest(config)})")
        return None

    def handle(self, header: dict, content: RecordDict) -> tuple[dict, RecordDict | None]:
        from . import client_app
        with self.training:
            why = self.refusal(header)
            if why:
                return {"refused": why}, None
            try:
                pid, rnd = client_app.task_ids(content, self.partition)
                times: dict[str, float] = {}
                cfg = client_app.config_of(header["config"])
                reply = client_app.train_content(cfg, content, pid, rnd, times)
                if self.run is None:   # complete and valid: from now on, this run's
                    self.limit = message_limit(client_app.trainer_for(cfg, pid).model)
                    self.run = (header["run"], _digest(header["config"]))
            except Exception as e:   # reported to the ClientApp, which fails the message as in-process training would
                return {"error": f"{type(e).__name__}: {e}"}, None
        _say(f"run {header['run']} round {rnd}: trained partition {pid} "
             f"({', '.join(f'{k} {v:.3f} s' for k, v in times.items())})")
        return {"ok": True, "times": times}, reply

    @contextmanager
    def keepalive(self, conn: socket.socket):
        """A keepalive to the ClientApp every HEARTBEAT s while its request waits or trains: it tells a worker
        that trains long from one that is stopped."""
        stop = threading.Event()

        def beat():
            while not stop.wait(HEARTBEAT):
                try:
                    conn.sendall(KEEPALIVE)
                except OSError:
                    return
        t = threading.Thread(target=beat, daemon=True, name="keepalive")
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def serve_one(self, conn: socket.socket) -> None:
        """One connection: its request whole within the deadline, then the reply; whatever fails, the
        connection is closed and the worker goes on."""
        try:
            with conn:
                if peer_uid(conn) != os.getuid():   # the folder's mode already keeps others out
                    return
                try:
                    header, content = receive(conn, self.limit, time.monotonic() + self.deadline)
                except BadFrame as e:
                    conn.settimeout(self.deadline)
                    send(conn, {"refused": f"a malformed request: {e}"})
                    raise
                conn.settimeout(self.deadline)
                with self.keepalive(conn):
                    reply_header, reply = self.handle(header, content)
                send(conn, reply_header, reply)
        except Closed:   # a probe (`listening`)
            pass
        except Exception as e:   # noqa: BLE001 -- MemoryError, a timeout, a reset: this request only
            _say(f"dropped a request: {type(e).__name__}: {e}")
        finally:
            self.slots.release()

    def serve(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError as e:   # out of descriptors for a moment
                _say(f"cannot accept a connection: {e}")
                time.sleep(0.1)
                continue
            if not self.slots.acquire(blocking=False):
                conn.close()
                _say(f"dropped a connection: {MAX_CLIENTS} already in progress")
                continue
            try:
                threading.Thread(target=self.serve_one, args=(conn,), daemon=True, name="request").start()
            except Exception as e:   # noqa: BLE001 -- no thread or no memory to serve it: this one only
                conn.close()
                self.slots.release()
                _say(f"dropped a connection: {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m fedlase.flower.worker", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, type=Path, help="the node's private worker directory (mode 0700)")
    ap.add_argument("--partition-id", required=True, type=int, help="the partition this node serves")
    ap.add_argument("--watch-pid", type=int, default=None, help="exit when this process (the SuperNode) ends; "
                                                                "default: the parent")
    ap.add_argument("--deadline", type=float, default=DEADLINE,
                    help=f"seconds a request may take to arrive whole (default {DEADLINE:g})")
    a = ap.parse_args(argv)
    parent = _PARENT if _PARENT is not None else os.getppid()
    folder = Path(os.path.abspath(a.dir.expanduser()))
    try:
        if a.watch_pid is None and parent == 1:
            raise WorkerError("its parent ended during start-up (or is init): nothing to watch; "
                              "give the SuperNode's pid with --watch-pid")
        watch(a.watch_pid if a.watch_pid is not None else parent)
        bound = bind(folder)
    except (WorkerError, OSError) as e:
        print(f"fedlase worker: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    t = time.monotonic()
    from .. import determinism
    determinism.cublas_workspace()   # before CUDA starts; the run's `deterministic` is applied by its first message
    import torch  # noqa: F401  (warm: the ClientApp processes never pay this)

    from . import client_app, codec, node_data  # noqa: F401
    _say(f"partition {a.partition_id} at {folder / SOCKET} (ready in {time.monotonic() - t:.1f} s)")
    try:
        Worker(a.partition_id, a.deadline).serve(bound.srv)
    finally:
        bound.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
