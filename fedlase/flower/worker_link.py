"""The ClientApp's half of the warm worker (fedlase/flower/worker.py): the wire format, the private-folder
and peer checks, `ask` and `say_once`. It imports only Flower and the standard library, so a ClientApp that
hands its message to a worker never imports torch; the worker imports this module, never the other way."""
from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

SOCKET = "worker.sock"
MAX_HEADER = 64 << 20    # a header holds the config text and the array list: far below this
MAX_BLOBS = 16 << 30     # the payload of one message (a ResNet-18 submodel is 45 MB)
CONNECT_TIMEOUT = 5.0    # connecting to a listening Unix socket is immediate; a full backlog is not a worker



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
