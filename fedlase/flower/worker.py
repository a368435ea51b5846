"""A warm worker beside a SuperNode: one long-lived process per node that holds torch, fedlase's training code,
the node's partition and the model (on a GPU node, the CUDA context and the partition on the device), so that
the ClientApp process Flower starts for every message only hands the message's arrays over and returns the reply.

    fedlase-worker --dir DIR --partition-id N --watch-pid PID [--deadline S] [--max-bytes B]
    (or python -P -m fedlase.flower.worker ...)

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
- **Only its node's ClientApps.** `--watch-pid` names the node (the SuperNode); a connection from a process
  that is neither it nor below it is refused at accept, before it takes a connection slot or a byte of it is
  read. The process is the kernel's word: a pidfd of the process that connected (SO_PEERPIDFD; on a kernel
  before 6.5 one opened on SO_PEERCRED's pid), which must still run once its parents have been read from /proc,
  where a parent that started after its child is a reused pid, not the parent.
- **Whatever a local process sends.** A frame's header is checked (size, nesting, shape and types) before
  anything is read or built from it: at most MAX_HEADER bytes, and once a run is bound HEADER_MARGIN times the
  header of its first message (at least 64 KiB). Its payload is read straight into the bytes that Flower's
  arrays keep (no copy; resident only as it arrives), within one budget for all requests in flight
  (`--max-bytes`, default UNBOUND_LIMIT; once a run is bound, at most `message_limit` of its model), which a
  header's length is taken from before its header is read, and its payload's size before its payload: a
  request that does not fit now is answered "busy". Each request's arrays are freed as soon as it is answered
  (`discard`). A request must arrive whole within `--deadline` seconds. Any failure while serving one request
  ends with a reply or a closed connection, never the worker. Connections are served concurrently (training
  one at a time), so a slow client delays nobody; one more than MAX_CLIENTS is answered "busy". A line about
  a caller turned away (a refused connection, a connection over MAX_CLIENTS, a dropped request) is logged at
  most once a second per kind and cut at LINE characters, and a refusal repeats at most SHOWN characters of a
  name the caller sent.
- **Dies with the node, and on a signal.** The worker watches `--watch-pid` (required) through a pidfd,
  opened before anything slow is imported (fedlase/flower/worker_start.py), and exits when it ends, SIGKILL
  included, whoever adopts the worker meanwhile. SIGTERM and SIGINT end it at once, training or not (Python's
  own shutdown under torch's threads aborts). It starts no process of its own. A stale socket (a killed worker)
  is replaced; a live one is not (a lock file that the kernel releases when the worker dies, however it dies).
- **A safe import path.** Started as the console script `fedlase-worker`, nothing is imported from the working
  folder (Python puts the script's own folder first on `sys.path`), not even a `fedlase/` folder there. Started
  as `python -m` without `-P`, it executes itself again with `-P` before `fedlase.flower` imports anything
  (worker_start), but a `fedlase/` folder in the working folder is imported before any of its code runs. Either
  way it drops its working folder from `sys.path` wherever it stands, so a folder another user can write
  cannot shadow a module (yaml at start-up, secrets at the first message).
- **One run, one partition.** The first TRAIN message of its node that trains, complete and valid, binds the
  worker to its run (Flower's run id and the fedlase config); a message for another run or another partition
  is refused. A ClientApp that finds no worker, is refused, finds it busy for BUSY_WAIT s, hears nothing from
  it for REPLY_TIMEOUT s (a keepalive comes every HEARTBEAT s while its request trains, none while it waits
  behind another) or has no reply by the run's reply_timeout trains in its own process as before (the same
  code, so the same result) and says so once in the node's log (a marker file in DIR, cleared when a worker
  starts).

Wire format, both ways: 8 bytes (big-endian) the length of a JSON header, the header, then the raw blobs it lists
(each array's `.npy` bytes exactly as Flower carries them, so a reply is byte for byte the in-process one); from
the worker, a length of 0 is a keepalive."""
from __future__ import annotations

import argparse
import errno
import hashlib
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

from flwr.app import ArrayRecord, RecordDict

from .worker_link import (  # noqa: F401
    HEADER_MARGIN,
    HEARTBEAT,
    KEEPALIVE,
    MAX_HEADER,
    SOCKET,
    UNBOUND_LIMIT,
    BadFrame,
    Busy,
    Closed,
    WorkerError,
    ask,
    check_private,
    listening,
    pack,
    peer,
    private_problem,
    receive,
    receive_content,
    receive_header,
    say_once,
    send,
    shown,
    too_large,
    unpack,
)
from .worker_start import watch

DEADLINE = 10.0     # seconds a request may take to arrive whole (a ResNet-18 message takes milliseconds)
MAX_CLIENTS = 16    # connections served at once; one more is answered "busy" at once (its ClientApp tries again)
BACKLOG = 256       # connections the kernel queues before the worker accepts them (a burst of connects)
QUIET = 1.0         # seconds between two lines of one kind about callers turned away (a burst: one line a second)
LINE = 300          # characters of such a line at most
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)   # Linux 6.5: a pidfd of the process that connected


# ---- start-up --------------------------------------------------------------------------------------------------
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
        srv.listen(BACKLOG)
        for name in os.listdir(fd):   # a new worker: a later outage is worth saying again
            if name.startswith("in-process-run-"):
                os.unlink(name, dir_fd=fd)
        undo.pop_all()
        return Bound(srv, fd, lock)


# ---- serving ---------------------------------------------------------------------------------------------------
def message_limit(model) -> int:
    """The most payload bytes a TRAIN message for `model` can carry, with the front proxy's margin of 2: per
    trainable parameter or buffer its values (dense), two packed bit masks, its kept indices per dimension (int64)
    and three .npy headers (a LoRA run's frozen base never travels); at least 1 MiB."""
    from ..train import trainable
    from .codec import NPY_HEADER_SLACK
    need = sum(t.numel() * t.element_size() + t.numel() // 4 + 8 * sum(t.shape) + 3 * NPY_HEADER_SLACK
               for t in [*trainable(model).values(), *model.buffers()])
    return max(1 << 20, 2 * need)


def _say(line: str) -> None:
    try:
        print(f"fedlase worker: {line}", file=sys.stderr, flush=True)
    except Exception:   # noqa: BLE001 -- no memory left even to say it: the request is dropped all the same
        pass


class Quiet:
    """Log lines said at most once every QUIET seconds per kind (the caller's refusal, the exception's type), cut
    at LINE characters (what a caller sent may be megabytes); the ones kept back are counted in the next."""

    def __init__(self):
        self.last: dict[str, tuple[float, int]] = {}   # kind -> (when its last line was said, lines kept back)
        self.lock = threading.Lock()

    def say(self, line: str, kind: str = "") -> None:
        with self.lock:
            now = time.monotonic()
            last, held = self.last.get(kind, (-QUIET, 0))
            if now - last < QUIET:
                self.last[kind] = last, held + 1
                return
            self.last[kind] = now, 0
        line = "".join(c if c.isprintable() else "?" for c in line[:LINE + 1])
        if len(line) > LINE:
            line = line[:LINE] + "..."
        _say(line + (f" (and {held} more since the last such line)" if held else ""))


def _digest(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()[:16]


def parent_and_start(pid: int) -> tuple[int, int]:
    """Process `pid`'s parent and its start time (clock ticks after boot), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:   # "pid (comm) state ppid ... starttime (22nd) ...", comm: anything
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[1]), int(fields[19])


def below(pid: int, node: int) -> bool:
    """Whether process `pid` is `node` or runs below it (its parents, read from /proc). A parent always started
    before its child: a pid in the chain that started later is a reused one, not the parent, and ends the walk."""
    child_start = None
    for _ in range(64):   # deeper than any tree a SuperNode makes (it, its SuperExec, a ClientApp)
        if pid == node:
            return True
        if pid <= 1:
            return False
        try:
            parent, start = parent_and_start(pid)
        except (OSError, ValueError, IndexError):   # gone meanwhile
            return False
        if child_start is not None and start > child_start:
            return False
        pid, child_start = parent, start
    return False


def peer_pidfd(conn: socket.socket, pid: int) -> int:
    """A pidfd of the process that connected `conn`: the kernel's (SO_PEERPIDFD), which names that very process,
    or on a kernel before 6.5 one opened on its pid now. ProcessLookupError: it has exited (its pid may be
    another process's by now)."""
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno != errno.ENOPROTOOPT:   # EINVAL, ESRCH: the process that connected is gone
            raise ProcessLookupError(pid) from None
    return os.pidfd_open(pid)   # ProcessLookupError if gone


def exited(pidfd: int) -> bool:
    """Whether the process of `pidfd` has ended (a pidfd becomes readable then)."""
    return bool(select.select([pidfd], [], [], 0)[0])


def discard(content: RecordDict | None) -> None:
    """Drop a request's (or reply's) arrays now. Flower 1.42's `config_records` and `array_records` views refer
    to themselves (a reference cycle), so a content that one of them saw lives on until the cyclic garbage
    collector runs, which allocations of bytes never trigger (3 GB resident after twelve 256 MiB requests).
    Emptying every record frees the payload whoever still holds the records."""
    for rec in (content or {}).values():
        if isinstance(rec, ArrayRecord):
            rec.clear()
    if content is not None:
        content.clear()


class Budget:
    """Bytes in flight, all requests together: a request's header length is taken before a byte of its header is
    read, its payload's declared size when the header has been read (before a byte of the payload), and both are
    given back once its content is discarded."""

    def __init__(self, total: int):
        self.total, self.used, self.lock = total, 0, threading.Lock()

    def take(self, n: int, what: str = "payload") -> None:
        """Reserve `n` bytes, or BadFrame (more than the whole budget) or Busy (not now)."""
        with self.lock:
            if n > self.total:
                raise too_large(n, self.total, what)
            if self.used + n > self.total:
                raise Busy(f"{self.used} of its {self.total} bytes are in flight; this request's {what} needs {n}")
            self.used += n

    def give(self, n: int) -> None:
        with self.lock:
            self.used -= n


class Worker:
    """Serves TRAIN requests for one partition, from its node's ClientApps (process `node` and those below it),
    and from the node's first complete and valid request on, for one run."""

    def __init__(self, partition: int, node: int, deadline: float = DEADLINE, budget: int = UNBOUND_LIMIT):
        self.partition, self.node, self.deadline = partition, node, deadline
        self.run: tuple[int, str] | None = None   # (Flower run id, digest of the fedlase config)
        self.budget = Budget(budget)              # once bound, at most the largest message of the run's model
        self.training = threading.Lock()          # one training at a time; connections are served at once
        self.header_limit = MAX_HEADER           # once bound, HEADER_MARGIN times its run's first header
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.dropped, self.refused, self.failed = Quiet(), Quiet(), Quiet()   # connections, callers, requests

    def refusal(self, header: dict) -> str | None:
        """Why this worker does not train the request `header` (already a well-formed frame), or None."""
        if header.get("op") != "train":
            return f"unknown request {shown(header.get('op'))}"
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
        """Train a request (holding `training`): -> the reply's header and content."""
        from . import client_app
        why = self.refusal(header)   # again: a run may have been bound while this one waited
        if why:
            return {"refused": why}, None
        try:
            pid, rnd = client_app.task_ids(content, self.partition)
            times: dict[str, float] = {}
            cfg = client_app.config_of(header["config"])
            reply = client_app.train_content(cfg, content, pid, rnd, times)
            if self.run is None:   # complete and valid: from now on, this run's
                self.budget.total = min(self.budget.total, message_limit(client_app.trainer_for(cfg, pid).model))
                self.run = (header["run"], _digest(header["config"]))
        except Exception as e:   # reported to the ClientApp, which fails the message as in-process training would
            return {"error": f"{type(e).__name__}: {e}"}, None
        refused = reply.config_records.get("refused")   # the server's frozen base is not this node's
        done = f"refused partition {pid}'s work: {refused['reason']}" if refused else f"trained partition {pid}"
        _say(f"run {header['run']} round {rnd}: {done} ({', '.join(f'{k} {v:.3f} s' for k, v in times.items())})")
        return {"ok": True, "times": times}, reply

    @contextmanager
    def keepalive(self, conn: socket.socket):
        """A keepalive to the ClientApp every HEARTBEAT s while its request trains: it tells a worker that
        trains long from one that is stopped. A request that waits for another's training hears nothing, so its
        ClientApp gives up after its silence timeout rather than wait behind it."""
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

    def stranger(self, conn: socket.socket) -> tuple[bool, str] | None:
        """Why the process that connected `conn` is not one of this worker's node's ClientApps, or None: checked
        at accept, before a slot is taken or a byte read. -> (whether to answer it, why). Another user is
        answered nothing. The process is named by a pidfd (the kernel's own where it gives one), so a pid that
        its caller left and another process took is not taken for it: it must still run when its parents
        have been read."""
        pid, uid = peer(conn)
        if uid != os.getuid():   # the folder's mode already keeps others out
            return False, f"uid {uid} is not this worker's user"
        try:
            fd = peer_pidfd(conn, pid)
        except ProcessLookupError:
            return True, f"pid {pid}, which connected, has exited"
        try:   # (a recent kernel gives a pidfd of a caller that has exited too)
            gone = f"pid {pid}, which connected, has exited"
            if exited(fd):
                return True, gone
            if not below(pid, self.node):
                return True, f"this worker serves the ClientApps of its node (pid {self.node}); pid {pid} is not one"
            if exited(fd):   # its parents read from /proc may have been another process's
                return True, gone
        finally:
            os.close(fd)
        return None

    def serve_one(self, conn: socket.socket) -> None:
        """One connection: its request whole within the deadline, then the reply; whatever fails, the
        connection is closed, the request's memory freed and the worker goes on."""
        content, taken, head = None, 0, 0

        def reserve(n: int) -> None:   # the header's bytes, before they are read
            nonlocal taken, head
            self.budget.take(n, "header")
            taken = head = n
        try:
            with conn:
                end = time.monotonic() + self.deadline
                try:
                    header, sizes = receive_header(conn, end, limit=self.header_limit, reserve=reserve)
                    why = self.refusal(header)
                    if why:   # before a byte of its payload is read
                        conn.settimeout(self.deadline)
                        send(conn, {"refused": why})
                        return
                    self.budget.take(sum(sizes))
                    taken += sum(sizes)
                    content = receive_content(conn, header, sizes, end)
                except Busy as e:
                    conn.settimeout(self.deadline)
                    send(conn, {"busy": str(e)})
                    return
                except BadFrame as e:
                    conn.settimeout(self.deadline)
                    send(conn, {"refused": f"a malformed request: {e}"})
                    raise
                conn.settimeout(self.deadline)
                with self.training:
                    if gone(conn):   # its ClientApp stopped waiting (and trains itself): not trained twice
                        return
                    bound = self.run is not None
                    with self.keepalive(conn):
                        reply_header, reply = self.handle(header, content)
                    if not bound and self.run is not None:   # this run's headers are all about this size
                        self.header_limit = min(MAX_HEADER, max(64 << 10, HEADER_MARGIN * head))
                try:
                    send(conn, reply_header, reply)
                finally:
                    discard(reply)
        except Closed:   # a probe (`listening`)
            pass
        except Exception as e:   # noqa: BLE001 -- MemoryError, a timeout, a reset: this request only
            self.failed.say(f"dropped a request: {type(e).__name__}: {e}", type(e).__name__)
        finally:
            discard(content)
            self.budget.give(taken)
            self.slots.release()

    def turn_away(self, conn: socket.socket, reply: dict | None, log: Quiet, line: str) -> None:
        """Answer a connection that is not served `reply` (None: nothing) without waiting, close it, and say
        `line` quietly."""
        try:
            if reply is not None:
                conn.setblocking(False)
                send(conn, reply)
        except OSError:
            pass
        conn.close()
        log.say(line)

    def serve(self, srv: socket.socket) -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError as e:   # out of descriptors for a moment
                if srv.fileno() < 0:   # closed: the worker stops
                    return
                _say(f"cannot accept a connection: {e}")
                time.sleep(0.1)
                continue
            try:
                stranger = self.stranger(conn)
            except OSError as e:   # the peer vanished while it was looked at, or no descriptor for its pidfd
                stranger = True, f"its caller could not be checked ({e})"
            if stranger:
                answer, why = stranger
                self.turn_away(conn, {"refused": why} if answer else None, self.refused,
                               f"refused a connection: {why}")
                continue
            if not self.slots.acquire(blocking=False):
                why = f"{MAX_CLIENTS} requests already in progress"
                self.turn_away(conn, {"busy": why}, self.dropped, f"dropped a connection: {why}")
                continue
            try:
                threading.Thread(target=self.serve_one, args=(conn,), daemon=True, name="request").start()
            except Exception as e:   # noqa: BLE001 -- no thread or no memory to serve it: this one only
                self.slots.release()
                why = f"{type(e).__name__}: {e}"
                self.turn_away(conn, {"busy": why}, self.dropped, f"dropped a connection: {why}")


def gone(conn: socket.socket) -> bool:
    """Whether the peer of `conn` has closed it: a keepalive cannot be sent (a peer that only shut down its
    sending half is still there)."""
    try:
        conn.sendall(KEEPALIVE)
        return False
    except OSError:
        return True


def warm() -> None:
    """What the worker loads before its first message, so that no ClientApp pays it: torch and fedlase's
    training code. Process-wide settings that must precede CUDA's start belong here, before torch."""
    from .. import determinism
    determinism.cublas_workspace()   # before CUDA starts; the run's `deterministic` is applied by its first message
    import torch  # noqa: F401

    from . import client_app, codec, node_data  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedlase-worker", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, type=Path, help="the node's private worker directory (mode 0700)")
    ap.add_argument("--partition-id", required=True, type=int, help="the partition this node serves")
    ap.add_argument("--watch-pid", required=True, type=int,
                    help="the node's process (the SuperNode): the worker serves its ClientApps and exits when it ends")
    ap.add_argument("--deadline", type=float, default=DEADLINE,
                    help=f"seconds a request may take to arrive whole (default {DEADLINE:g})")
    ap.add_argument("--max-bytes", type=int, default=UNBOUND_LIMIT,
                    help=f"payload bytes in flight, all requests together (default {UNBOUND_LIMIT}); once a run is "
                         f"bound, at most twice its largest message")
    a = ap.parse_args(argv)
    folder = Path(os.path.abspath(a.dir.expanduser()))
    try:
        if a.max_bytes <= 0 or not a.deadline > 0:
            raise WorkerError("--max-bytes and --deadline must be positive")
        watch(a.watch_pid)
        bound = bind(folder)
    except (WorkerError, OSError) as e:
        print(f"fedlase worker: error: {e}", file=sys.stderr)
        return 2

    def stop(*_):   # a signal while torch's threads train: Python's shutdown would abort (and may dump a core)
        bound.close()
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t = time.monotonic()
    warm()
    _say(f"partition {a.partition_id} at {folder / SOCKET} (ready in {time.monotonic() - t:.1f} s)")
    try:
        Worker(a.partition_id, a.watch_pid, a.deadline, a.max_bytes).serve(bound.srv)
    finally:
        bound.close()
    return 0


def console() -> None:
    """The console script `fedlase-worker` (pyproject.toml [project.scripts]). Its node was watched and its
    working folder dropped from sys.path by fedlase/flower/__init__.py before this module was imported."""
    sys.exit(main())


if __name__ == "__main__":
    if not sys.flags.safe_path:   # started some way fedlase/flower/worker_start.py does not know: not safely
        print("fedlase worker: error: start it as `fedlase-worker` or `python -P -m fedlase.flower.worker`",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
