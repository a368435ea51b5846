"""The ClientApp's half of the warm worker (fedlase/flower/worker.py): the wire format, the private-folder
and peer checks, `ask` and `say_once`. It imports only Flower and the standard library, so a ClientApp that
hands its message to a worker never imports torch; the worker imports this module, never the other way."""
from __future__ import annotations

import io
import json
import os
import re
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

SOCKET = "worker.sock"
MAX_HEADER = 1 << 20     # a header holds the config text (1.4 KB) and ~90 bytes an array: ResNet-18's is 9 KB
HEADER_MARGIN = 4        # a bound worker's headers: at most this times its run's first one (at least 64 KiB)
SHOWN = 40               # characters of a caller's name that a refusal or a log line repeats
MAX_DEPTH = 16           # a header's JSON nests 6 deep; deeper is refused before json.loads recurses
UNBOUND_LIMIT = 4 << 30  # payload bytes in flight, all requests together, by default (a ResNet-18 submodel: 45 MB)
MAX_BLOBS = 16 << 30     # the payload of a reply the worker sends a ClientApp
CONNECT_TIMEOUT = 5.0    # connecting to a listening Unix socket is immediate; a full backlog is not a worker
HEARTBEAT = 1.0          # while a request trains, the worker sends this often a keepalive
REPLY_TIMEOUT = 20.0     # a worker silent this long (no keepalive) is stopped, hung or busy with another request
ASK_DEADLINE = 600.0     # the longest `ask` waits for a reply in all, if the run's config has no reply_timeout
BUSY_WAIT = 5.0          # how long `ask` tries again a worker that is busy (connections, bytes in flight) or full
KEEPALIVE = bytes(8)     # a zero header length: "still training", never a frame


class WorkerError(RuntimeError):
    """The worker could not be used (no socket, another user's, a refusal); the message says why."""


class Closed(WorkerError):
    """The peer closed the connection before sending a byte (a probe: `listening`)."""


class BadFrame(WorkerError):
    """A frame that is not a well-formed message (its header's shape, types, sizes or nesting); said to the peer."""


class Busy(WorkerError):
    """The worker has no room for the request now (connections or payload bytes in flight): `ask` tries again."""


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


def _size(x) -> bool:
    return type(x) is int and x >= 0   # not a bool, a float (1e30) or a string


def _scalar(x) -> bool:
    return type(x) in (int, float, str, bool)


def shown(x) -> str:
    """A caller's value as a refusal or a log line repeats it: its repr, cut at SHOWN characters (a record
    name may be megabytes long)."""
    text = repr(x[:SHOWN + 1] if isinstance(x, (str, bytes, list)) else x)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


def array_sizes(header) -> list[int]:
    """The payload's array sizes, once the header is known to be a dict whose `records` are as `pack` writes
    them (names, kinds, array entries [key, dtype, shape, stype, size], flat config and metric items); else
    BadFrame, before anything is read or built from it."""
    if not isinstance(header, dict):
        raise BadFrame(f"a header must be a JSON object, not {type(header).__name__}")
    records = header.get("records", [])
    if not isinstance(records, list):
        raise BadFrame("`records` must be a list")
    sizes = []
    for e in records:
        if not (isinstance(e, dict) and isinstance(e.get("name"), str)
                and e.get("kind") in ("array", "config", "metric")):
            raise BadFrame("a record must be an object with a `name` and a `kind` (array, config or metric)")
        if e["kind"] == "array":
            arrays = e.get("arrays")
            if not isinstance(arrays, list):
                raise BadFrame(f"array record {shown(e['name'])} has no list of `arrays`")
            for a in arrays:
                if not (isinstance(a, list) and len(a) == 5 and isinstance(a[0], str) and isinstance(a[1], str)
                        and isinstance(a[2], list) and all(map(_size, a[2])) and isinstance(a[3], str)
                        and _size(a[4])):
                    raise BadFrame(f"array record {shown(e['name'])}: an entry must be [key, dtype, shape (sizes), "
                                   f"stype, bytes (an integer >= 0)]")
                sizes.append(a[4])
        else:
            items = e.get("items")
            if not (isinstance(items, dict) and all(
                    _scalar(v) or (isinstance(v, list) and all(map(_scalar, v))) for v in items.values())):
                raise BadFrame(f"{e['kind']} record {shown(e['name'])}: `items` must map names to values or lists")
    return sizes


def _depth(raw: bytes) -> int:
    """How deep `raw`'s JSON nests: its brackets outside strings, counted without recursion (json.loads recurses
    once a level, so a header 100,000 deep is refused before it is parsed)."""
    import numpy as np
    bare = raw.replace(rb"\\", b"").replace(rb'\"', b"")   # escapes, left to right as JSON reads them
    bare = _STRING.sub(b"", bare).translate(None, _NOT_BRACKETS)
    opens = np.frombuffer(bare, np.uint8)
    return int(np.cumsum(np.where((opens == ord("[")) | (opens == ord("{")), 1, -1)).max(initial=0))


_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


class _Until(io.RawIOBase):
    """A socket as a raw stream whose every recv ends by `deadline` (time.monotonic()) and, if `idle` is given,
    after at most `idle` seconds of silence."""

    def __init__(self, conn: socket.socket, deadline: float | None, idle: float | None):
        self.conn, self.deadline, self.idle = conn, deadline, idle

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        wait = self.idle
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("the deadline passed")
            wait = left if wait is None else min(wait, left)
        if wait is not None:
            self.conn.settimeout(wait)
        try:
            return self.conn.recv_into(buf)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise WorkerError("the deadline passed") from None
            raise


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None, first: bool = False,
                idle: float | None = None) -> bytes:
    """`n` bytes, all of them by `deadline` whatever the pace of each recv. BufferedReader.read(n) makes the
    bytes object once and has the socket fill it in place (with a 1-byte buffer it reads nothing ahead), so
    there is no copy, and its pages become resident only as the bytes arrive: a claim costs address space, not
    memory, until it is sent."""
    data = io.BufferedReader(_Until(conn, deadline, idle), 1).read(n)
    if len(data) < n:
        if first and not data:
            raise Closed("the connection closed")
        raise WorkerError("the connection closed mid-frame")
    return data


def send(conn: socket.socket, header: dict, records: RecordDict | None = None) -> None:
    conn.sendall(b"".join(pack(header, records)))


def receive_header(conn: socket.socket, deadline: float | None = None, keepalive: bool = False,
                   idle: float | None = None, limit: int = MAX_HEADER, reserve=None) -> tuple[dict, list[int]]:
    """A frame's header, checked (`array_sizes`, at most `limit` bytes and MAX_DEPTH deep), and its payload's
    array sizes; the payload is still to be read (`receive_content`). `keepalive`: skip the worker's keepalives.
    `reserve(n)` is called with the header's length before a byte of it is read (the worker's byte budget)."""
    while True:
        (n,) = struct.unpack(">Q", _recv_exact(conn, 8, deadline, first=True, idle=idle))
        if not (keepalive and n == 0):
            break
    if n > limit:
        raise BadFrame(f"a header of {n} bytes is larger than {limit}")
    if reserve is not None:
        reserve(n)
    raw = _recv_exact(conn, n, deadline, idle=idle)
    if _depth(raw) > MAX_DEPTH:
        raise BadFrame(f"a header nested deeper than {MAX_DEPTH}")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError too
        raise BadFrame(f"a header that is not JSON ({type(e).__name__})") from None
    return header, array_sizes(header)


def too_large(size: int, limit: int, what: str = "payload") -> BadFrame:
    return BadFrame(f"a {what} of {size} bytes is larger than this run's messages can be ({limit})")


def receive_content(conn: socket.socket, header: dict, sizes: list[int], deadline: float | None = None,
                    idle: float | None = None) -> RecordDict:
    """The records of a frame whose header `receive_header` read."""
    blobs = [_recv_exact(conn, s, deadline, idle=idle) for s in sizes]
    try:
        return unpack(header, blobs)
    except (TypeError, ValueError) as e:   # values Flower's records do not take
        raise BadFrame(f"records Flower cannot build ({e})") from None


def receive(conn: socket.socket, limit: int = MAX_BLOBS, deadline: float | None = None,
            keepalive: bool = False, idle: float | None = None) -> tuple[dict, RecordDict]:
    """One frame: its header and its content, at most `limit` payload bytes, all by `deadline`."""
    header, sizes = receive_header(conn, deadline, keepalive, idle)
    if sum(sizes) > limit:
        raise too_large(sum(sizes), limit)
    return header, receive_content(conn, header, sizes, deadline, idle)


def peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (the kernel's word, SO_PEERCRED,
    as of its connect)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def private_problem(st: os.stat_result) -> str | None:
    """Why a folder with this stat is not private to this user (a directory of its own, mode 0700), or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        return f"it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
    return None


def check_private(folder: Path) -> None:
    """DIR must be a directory of this user that nobody else may enter (else anyone could swap the socket)."""
    why = private_problem(os.lstat(folder))
    if why:
        raise WorkerError(f"{folder} must be a directory owned by uid {os.getuid()} with mode 0700 ({why})")


# ---- the ClientApp's half (no torch) ---------------------------------------------------------------------------
def run_deadline(config_text: str) -> float:
    """The run's reply_timeout (the server waits no longer for a round's replies), else ASK_DEADLINE."""
    try:
        return float(json.loads(config_text)["reply_timeout"])
    except (ValueError, TypeError, KeyError):
        return ASK_DEADLINE


def ask(folder: str | Path, run_id: int, partition: int, config_text: str, content: RecordDict,
        timeout: float | None = None, deadline: float | None = None) -> tuple[dict, RecordDict]:
    """Hand a TRAIN message's content to the worker in `folder`; -> (the reply's header, its content). Raises
    WorkerError if there is no usable worker (the caller then trains itself): none listens, it is another user's,
    it refuses, it stays busy for BUSY_WAIT s (tried again meanwhile), it is silent for `timeout` s (default
    REPLY_TIMEOUT: it sends a keepalive every HEARTBEAT s only while it trains this request, so silence means
    it is stopped, hung or training another), or it has not replied `deadline` s after the call (default: the
    run's reply_timeout). A training error in the worker comes back as RuntimeError, as it would in-process."""
    folder = Path(folder)
    try:
        check_private(folder)
    except OSError as e:
        raise WorkerError(f"no worker directory at {folder} ({e.strerror or e})") from None
    start = time.monotonic()
    end = start + (run_deadline(config_text) if deadline is None else deadline)
    frame = b"".join(pack({"op": "train", "run": int(run_id), "partition": int(partition), "config": config_text},
                          content))
    pause = 0.05
    while True:
        try:
            header, reply = _ask_once(folder / SOCKET, frame, end, REPLY_TIMEOUT if timeout is None else timeout)
            break
        except Busy as e:
            if time.monotonic() + pause > min(end, start + BUSY_WAIT):
                raise WorkerError(f"the worker is busy ({e})") from None
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
    if "refused" in header:
        raise WorkerError(f"the worker refused: {header['refused']}")
    if "error" in header:
        raise RuntimeError(f"the node's worker failed to train: {header['error']}")
    return header, reply


def _ask_once(sock: Path, frame: bytes, end: float, idle: float) -> tuple[dict, RecordDict]:
    """One try of `ask`: its frame sent to the worker at `sock` and the reply read, by `end`, with at most
    `idle` seconds of silence. Busy if the worker has no room for it now."""
    def left(most: float) -> float:
        rest = end - time.monotonic()
        if rest <= 0:
            raise WorkerError(f"no worker answers at {sock} (the deadline passed)")
        return min(most, rest)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(left(CONNECT_TIMEOUT))
        try:
            conn.connect(str(sock))
        except BlockingIOError:   # a full listen backlog (a burst of connections) refuses at once
            raise Busy("its listen backlog is full") from None
        except OSError as e:
            raise WorkerError(f"no worker answers at {sock} ({e.strerror or e})") from None
        if peer(conn)[1] != os.getuid():
            raise WorkerError(f"{sock} is served by another user; not handing it the model")
        conn.settimeout(left(idle))
        try:
            try:
                conn.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                pass   # refused before it read the whole request (too large, busy): its reply says why
            header, reply = receive(conn, deadline=end, keepalive=True, idle=idle)
        except (OSError, WorkerError) as e:   # a timeout too
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise WorkerError(f"no worker answers at {sock} ({why})") from None
    if "busy" in header:
        raise Busy(header["busy"])
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
