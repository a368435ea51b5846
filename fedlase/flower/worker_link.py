"""The ClientApp's half of the warm worker (fedlase/flower/worker.py): the wire format, the private-folder
and peer checks, `ask` and `say_once`. It imports only Flower and the standard library, so a ClientApp that
hands its message to a worker never imports torch; the worker imports this module, never the other way."""
from __future__ import annotations

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
MAX_HEADER = 8 << 20     # a header holds the config text and the array list: kilobytes
MAX_DEPTH = 16           # a header's JSON nests 6 deep; deeper is refused before json.loads recurses
UNBOUND_LIMIT = 4 << 30  # the payload of a message before a run is bound (a ResNet-18 submodel is 45 MB)
MAX_BLOBS = 16 << 30     # the payload of a reply the worker sends a ClientApp
CHUNK = 1 << 20          # bytes read at a time: memory grows with the bytes that arrived, never with a claim
CONNECT_TIMEOUT = 5.0    # connecting to a listening Unix socket is immediate; a full backlog is not a worker
HEARTBEAT = 1.0          # while a request waits for training or trains, the worker sends this often a keepalive
REPLY_TIMEOUT = 20.0     # a worker silent this long (no keepalive) is stopped or hung: the ClientApp trains itself
KEEPALIVE = bytes(8)     # a zero header length: "still training", never a frame


class WorkerError(RuntimeError):
    """The worker could not be used (no socket, another user's, a refusal); the message says why."""


class Closed(WorkerError):
    """The peer closed the connection before sending a byte (a probe: `listening`)."""


class BadFrame(WorkerError):
    """A frame that is not a well-formed message (its header's shape, types, sizes or nesting); said to the peer."""


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
                raise BadFrame(f"array record {e['name']!r} has no list of `arrays`")
            for a in arrays:
                if not (isinstance(a, list) and len(a) == 5 and isinstance(a[0], str) and isinstance(a[1], str)
                        and isinstance(a[2], list) and all(map(_size, a[2])) and isinstance(a[3], str)
                        and _size(a[4])):
                    raise BadFrame(f"array record {e['name']!r}: an entry must be [key, dtype, shape (sizes), "
                                   f"stype, bytes (an integer >= 0)]")
                sizes.append(a[4])
        else:
            items = e.get("items")
            if not (isinstance(items, dict) and all(
                    _scalar(v) or (isinstance(v, list) and all(map(_scalar, v))) for v in items.values())):
                raise BadFrame(f"{e['kind']} record {e['name']!r}: `items` must map names to values or lists")
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


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None, first: bool = False) -> bytes:
    """`n` bytes, read as they arrive (the buffer grows with them, so a claim costs nothing until it is sent),
    all of them by `deadline` (time.monotonic()) if one is given, whatever the pace of each recv."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("the request missed its deadline")
            conn.settimeout(left)
        chunk = conn.recv(min(n - len(buf), CHUNK))
        if not chunk:
            if first and not buf:
                raise Closed("the connection closed")
            raise WorkerError("the connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def send(conn: socket.socket, header: dict, records: RecordDict | None = None) -> None:
    conn.sendall(b"".join(pack(header, records)))


def receive(conn: socket.socket, limit: int = MAX_BLOBS, deadline: float | None = None,
            keepalive: bool = False) -> tuple[dict, RecordDict]:
    """One frame: its header, checked (`array_sizes`, at most MAX_HEADER bytes and MAX_DEPTH deep), and its
    content, at most `limit` payload bytes, all by `deadline`. `keepalive`: skip the worker's keepalives."""
    while True:
        (n,) = struct.unpack(">Q", _recv_exact(conn, 8, deadline, first=True))
        if not (keepalive and n == 0):
            break
    if n > MAX_HEADER:
        raise BadFrame(f"a header of {n} bytes is larger than {MAX_HEADER}")
    raw = _recv_exact(conn, n, deadline)
    if _depth(raw) > MAX_DEPTH:
        raise BadFrame(f"a header nested deeper than {MAX_DEPTH}")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError too
        raise BadFrame(f"a header that is not JSON ({type(e).__name__})") from None
    sizes = array_sizes(header)
    if sum(sizes) > limit:
        raise BadFrame(f"a payload of {sum(sizes)} bytes is larger than this run's messages can be ({limit})")
    blobs = [_recv_exact(conn, s, deadline) for s in sizes]
    try:
        return header, unpack(header, blobs)
    except (TypeError, ValueError) as e:   # values Flower's records do not take
        raise BadFrame(f"records Flower cannot build ({e})") from None


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (the kernel's word, SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


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
def ask(folder: str | Path, run_id: int, partition: int, config_text: str,
        content: RecordDict, timeout: float | None = None) -> tuple[dict, RecordDict]:
    """Hand a TRAIN message's content to the worker in `folder`; -> (the reply's header, its content). Raises
    WorkerError if there is no usable worker (the caller then trains itself), among them one silent for `timeout`
    seconds (default REPLY_TIMEOUT: a worker that trains sends a keepalive every HEARTBEAT s, so silence means it
    is stopped or hung); a training error in the worker comes back as RuntimeError, as it would in-process."""
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
            conn.settimeout(REPLY_TIMEOUT if timeout is None else timeout)
            if peer_uid(conn) != os.getuid():
                raise WorkerError(f"{folder / SOCKET} is served by another user; not handing it the model")
            try:
                send(conn, {"op": "train", "run": int(run_id), "partition": int(partition),
                            "config": config_text}, content)
            except (BrokenPipeError, ConnectionResetError):
                pass   # refused before it read the whole request (e.g. too large): its reply says why
            header, reply = receive(conn, keepalive=True)
        except OSError as e:   # a timeout too
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
