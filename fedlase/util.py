"""Small helpers that several layers need, each written once: an atomic file write, fedlase's cache folder, a run
folder's check, host:port addresses and whether an optional package is installed. Imports nothing of fedlase but
its errors, so any module may import it (the config included)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

from .errors import RunExists, UserError

CACHE_ENV = "FEDLASE_CACHE"            # the cache folder
DEPRECATED_CACHE_ENV = "FEDLASE_CACHE_DIR"   # its old name (the text track's), still read when CACHE_ENV is unset


def installed(package: str) -> bool:
    """Whether `package` can be imported (an optional extra's), without importing it."""
    return importlib.util.find_spec(package) is not None


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence (its first paragraph may wrap over several lines): what `fedlase methods` and
    README.md's method table say of a method."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    end = para.find(". ")
    return para if end < 0 else para[:end + 1]


def yaml_problem(path, text: str, error: Exception) -> str:
    """Where and why `text` (the file `path`) is not valid YAML, for a one-line error: its line and column (from 1)
    and the parser's words, and a hint for the mistakes a config meets most: an unquoted value that starts with
    `{` or `[` (YAML reads `system: {1,1/4}_{4,4}` as a mapping, then stumbles), one never closed, a wrong indent."""
    problem_mark, context_mark = getattr(error, "problem_mark", None), getattr(error, "context_mark", None)
    mark = problem_mark or context_mark
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    msg = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    msg += f": not valid YAML: {problem}"
    if context:
        began = context_mark is not None and mark is not None and context_mark.line != mark.line
        msg += f" ({context}{f' that begins on line {context_mark.line + 1}' if began else ''})"
    lines = text.splitlines()
    for m in (problem_mark, context_mark):   # the line of the problem first, then where its construct began
        line = lines[m.line] if m is not None and m.line < len(lines) else ""
        key, colon, value = line.partition(":")
        value = value.split(" #")[0].strip()
        if not colon or value[:1] not in ("{", "["):
            continue
        close = "}" if value[0] == "{" else "]"
        if not value.endswith(close):
            return f"{msg}; the {value[0]} of line {m.line + 1} is never closed: close it, or quote the value"
        return (f"{msg}; YAML reads a value that starts with {value[0]} as its own "
                f"{'mapping' if close == '}' else 'list'}: quote it, {key.strip()}: '{value}'")
    if "mapping values are not allowed" in problem or "expected <block end>" in problem:
        return f"{msg}; check that line's indent against the lines above it, and quote a value that holds ': '"
    return msg


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` fills a temporary sibling of `path` (a file or a folder), which then replaces `path` in one
    step, so a crash never leaves half a file and a reader never sees one. The temporary name holds the pid, so
    processes writing the same path at once (Flower nodes, sweep runs) never share one. A folder that another
    process put in place first is kept (its contents are the same by construction) and ours is dropped."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        if not (tmp.is_dir() and path.is_dir()):   # os.replace refuses a non-empty folder: a racing writer won
            raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def lines_up_to(path: Path, key: str, last: int) -> list[str]:
    """The lines of a JSON-lines file (a run's metrics.jsonl or arrivals.jsonl) whose `key` is at most `last`: a
    resumed run drops those written after its checkpoint, and a line cut short by a kill. None without the file."""
    def at(line: str) -> float:
        try:
            return json.loads(line)[key]
        except (ValueError, KeyError, TypeError):
            return math.inf
    return [ln for ln in path.read_text().splitlines() if at(ln) <= last] if path.exists() else []


def cache_dir() -> Path:
    """fedlase's cache folder: `$FEDLASE_CACHE`, else `$XDG_CACHE_HOME/fedlase`, else `~/.cache/fedlase`. The text
    track's tokens lie in it, a Flower node's partitions in its `clients/` folder. `$FEDLASE_CACHE_DIR` is the
    deprecated name of `$FEDLASE_CACHE`, read (with a warning) when only it is set."""
    root = os.environ.get(CACHE_ENV)
    if not root and os.environ.get(DEPRECATED_CACHE_ENV):
        warnings.warn(f"{DEPRECATED_CACHE_ENV} is deprecated: set {CACHE_ENV} instead", DeprecationWarning,
                      stacklevel=2)
        root = os.environ[DEPRECATED_CACHE_ENV]
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedlase"


def run_folder(out, resume: bool) -> Path:
    """The run folder `out`, refused with a one-line UserError when it is a file, or when it already holds a run
    (a checkpoint or a summary) and `resume` is false: every engine checks it so before it starts."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"out: {out} is a file, not a folder; choose another out")
    if not resume and ((out / "checkpoint.pt").exists() or (out / "summary.json").exists()):
        raise RunExists(out)   # worded for the command line; fedlase.run rewords it for Python
    return out


def split_host_port(address: str) -> tuple[str, int] | None:
    """'host:port' -> (host, port); an IPv6 host may be bracketed ('[::1]:8000' -> ('::1', 8000)). None when
    `address` is not that: no host, a host with blanks or slashes, a port that is not a number in 1..65535.
    Callers raise their own error, which names their key or option."""
    host, sep, port = str(address).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if any(c.isspace() or c == "/" for c in host):
        return None
    return host, int(port)
