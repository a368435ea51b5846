"""The node worker's first steps (the console script `fedlase-worker`, or `python -P -m fedlase.flower.worker`;
fedlase/flower/worker.py), taken by fedlase/flower/__init__.py before it imports anything: Python imports the
packages `fedlase` and `fedlase.flower` before it runs the worker's code, and the latter imports yaml, json,
psutil and more from sys.path.

- **A safe import path.** The console script `fedlase-worker` (pyproject.toml) has its own folder first on
  sys.path, not the working folder, so not even a `fedlase/` folder there is imported. Without `-P` (or
  PYTHONSAFEPATH) `-m` puts the working folder first on sys.path, so a `yaml.py` there would run as the
  worker's user: the worker executes itself again with `-P` before it imports anything (a `fedlase/` folder
  there has run by then: only the console script or `-P` keeps it out). An empty PYTHONPATH entry ("/a:") adds
  the working folder too, further on: it is removed.
- **Its node watched from the start.** `--watch-pid` (required) names the process the worker serves and dies
  with (the SuperNode). Its pidfd is opened here, before the slow imports (flwr, torch), so a node or launcher
  that dies during start-up takes the worker along, whoever adopts the orphan (init, or a child subreaper such
  as systemd's user manager or tini), and a pid that is already gone ends the worker at once.

Only `os` and `sys` are imported before the path is safe: both are loaded before any of Python's start-up looks at
the working folder. No `from __future__` import either (`__future__` is a module found on sys.path)."""
import os
import sys

MODULE = "fedlase.flower.worker"
SCRIPT = "fedlase-worker"   # the console script (pyproject.toml [project.scripts]: fedlase.flower.worker:console)
_WATCHED = []   # the pid watched, once armed


def started_as_script() -> bool:
    """Whether this process runs the console script `fedlase-worker` (sys.argv[0] is the script's path)."""
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == SCRIPT


def started_as_worker() -> bool:
    """Whether this process runs the worker: the console script, or `python [options] -m fedlase.flower.worker`.
    While Python imports the module's packages sys.argv[0] is only "-m", so the command line is read from
    sys.orig_argv."""
    if started_as_script():
        return True
    argv = sys.orig_argv[1:]

    def m(flag: str) -> bool:   # "-m", or short options that end with it ("-um")
        return flag[:1] == "-" and flag[1:].isalpha() and flag.endswith("m")
    return (any(arg == MODULE and m(prev) for prev, arg in zip(argv, argv[1:]))
            or any(arg.endswith(MODULE) and m(arg[:-len(MODULE)]) for arg in argv))   # -mfedlase.flower.worker


def watched_pid(argv: list) -> int | None:
    """The pid given with --watch-pid in `argv` (the worker's arguments), or None (argparse then says why)."""
    for i, a in enumerate(argv):
        value = a.partition("=")[2] if a.startswith("--watch-pid=") else (
            argv[i + 1] if a == "--watch-pid" and i + 1 < len(argv) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def watch(pid: int) -> None:
    """Exit the moment process `pid` ends (the SuperNode), SIGKILL included: a pidfd becomes readable then, and
    cannot be confused with a later process of the same pid (one already gone: ProcessLookupError). Armed once
    per process."""
    if pid in _WATCHED:
        return
    import select
    import threading
    try:
        fd = os.pidfd_open(pid)
    except OSError as e:
        raise ProcessLookupError(f"--watch-pid {pid}: cannot watch it ({e.strerror})") from None

    def wait():
        select.select([fd], [], [])
        os._exit(0)   # the node is gone: nothing to finish, nothing to flush
    threading.Thread(target=wait, daemon=True, name="watch-node").start()
    _WATCHED.append(pid)


def start_if_worker() -> None:
    """When this process is the worker: -P (by executing itself again), the working folder off sys.path, and its
    node watched; all before anything is imported from sys.path."""
    if not started_as_worker():
        return
    if not sys.flags.safe_path and not started_as_script():   # `-m` put the working folder first: again without
        os.execv(sys.executable, [sys.executable, "-P", *sys.orig_argv[1:]])
    try:
        here = os.getcwd()
    except OSError:   # a working folder that is gone shadows nothing
        here = ""
    sys.path[:] = [p for p in sys.path if p not in ("", ".", here)]
    pid = watched_pid(sys.argv[1:])
    if pid is not None:   # none: the worker's argument parser refuses to start, after the imports
        try:
            watch(pid)
        except ProcessLookupError as e:
            print(f"fedlase worker: error: {e}", file=sys.stderr)
            sys.exit(2)
