"""Where a command's CPU time goes, by kind of process: the figures of docs/benchmarks.md ("The test suite's time").

    python -m tools.cpu_by_process [--every 0.25] -- make test

Runs the command and, until it ends, reads every process's CPU time (user + system, /proc/PID/stat) every
`--every` seconds; then prints the CPU-seconds and process counts per kind (a Ray actor, a SuperNode, a sweep's
child...), recognised by the command line, largest first, with the machine's busy CPU-seconds over the same time
(/proc/stat: every process and the kernel). Counts every process on the machine, so run it on an idle one. A
process shorter than one sample may be missed, and each is counted up to its last sample: the per-kind sums are
a little below the machine's figure. Linux only."""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time

# (a piece of the command line, the kind): the first that matches names a process
KINDS = [("flwr-clientapp", "Flower ClientApp"), ("flwr-serverapp", "Flower ServerApp"),
         ("flower-superlink", "Flower SuperLink"), ("flower-superexec", "Flower SuperExec"),
         ("flower-supernode", "Flower SuperNode"), ("fedlase.flower.worker", "fedlase node worker"),
         ("bin/fedlase-worker", "fedlase node worker"),
         ("nginx", "nginx"), ("default_worker.py", "Ray worker or actor"), ("ray::", "Ray worker or actor"),
         ("gcs_server", "Ray GCS"), ("/raylet", "Ray raylet"), ("dashboard", "Ray dashboard or agent"),
         ("runtime_env", "Ray runtime-env agent"), ("log_monitor", "Ray log monitor"), ("monitor.py", "Ray monitor"),
         ("_child_main", "fedlase sweep child"), ("fedlase run", "fedlase run"), ("-m fedlase", "fedlase (other)"),
         ("exec(eval(sys.stdin", "pytest-xdist worker"), ("-m pytest", "pytest"), ("bin/flwr", "flwr CLI"),
         ("ray start", "ray CLI")]
TICK = os.sysconf("SC_CLK_TCK")


def kind(cmdline: str) -> str:
    return next((k for piece, k in KINDS if piece in cmdline), "other")


def busy_seconds() -> float:
    """The machine's busy CPU time so far: user, nice, system, irq, softirq."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / TICK


def sample(seen: dict, base: dict, first: bool) -> None:
    """Each process's CPU time now, keyed by (pid, start time) so that a reused pid is another process."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():   # not this sampler itself
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            key, cpu = (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICK
            if first:
                base[key] = cpu   # running before the command: count only what it uses from now on
            if key not in seen:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())   # one line
                if not line:
                    continue   # a kernel thread
                seen[key] = [kind(line), 0.0, line]
            seen[key][1] = cpu - base.get(key, 0.0)
        except (OSError, IndexError, ValueError):
            pass   # ended meanwhile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--others", type=int, default=0, metavar="N",
                    help="also print the command lines of the N costliest processes of kind 'other'")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the command to measure after --")
    seen, base, done = {}, {}, threading.Event()
    sample(seen, base, first=True)
    busy0, t0 = busy_seconds(), time.monotonic()

    def watch() -> None:
        while not done.wait(a.every):
            sample(seen, base, first=False)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    rc = subprocess.call(command)
    done.set()
    thread.join()
    sample(seen, base, first=False)
    wall, busy = time.monotonic() - t0, busy_seconds() - busy0
    per = collections.defaultdict(lambda: [0, 0.0])
    for k, cpu, _ in seen.values():
        if cpu > 0:
            per[k][0] += 1
            per[k][1] += cpu
    print(f"\n{wall:.0f} s wall, {busy:.0f} busy CPU-s on the machine (exit status {rc})")
    for k, (n, cpu) in sorted(per.items(), key=lambda x: -x[1][1]):
        if cpu >= 0.5:
            print(f"{cpu:8.1f} CPU-s  {n:4d} processes  {k}")
    others = sorted((x for x in seen.values() if x[0] == "other" and x[1] > 0), key=lambda x: -x[1])[:a.others]
    for _, cpu, line in others:
        print(f"{cpu:8.1f} CPU-s  other: {line[:150]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
