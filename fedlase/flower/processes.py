"""Processes a Flower run leaves behind: the live processes below one, and reaping a set of them (the
Simulation Engine's Ray workers, tools/flower_local.py's federation)."""
from __future__ import annotations

import psutil


def children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def is_ray(p: psutil.Process) -> bool:
    try:
        return "ray" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def descendants(root: int) -> set[psutil.Process]:
    """All live processes below `root` (psutil handles: a pid reused later is not mistaken for them)."""
    try:
        return set(children(psutil.Process(root)))
    except psutil.Error:
        return set()


def reap(procs, grace: float = 15.0) -> None:
    """Wait up to `grace` seconds for these processes (psutil handles) to end, then SIGKILL what is left."""
    procs = [p for p in procs if isinstance(p, psutil.Process)]
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
