"""Where a Deployment Engine message's time goes: a loopback deployment (tools/flower_local.py) whose nodes run a
timing ClientApp, then a table of the per-message medians.

    python -m tools.flower_profile [CONFIG] key=value ... [--no-worker]   (the arguments of `fedlase run`; from
                                                                          the repo root)
    python -m tools.flower_profile --imports OUT/flower-app/pyproject.toml     (a ClientApp's loads, one by one)

The timing ClientApp (`app` below) does exactly what fedlase's does, through fedlase/flower/client_app.py's
`train_content`, which times its own steps, and writes one line per message to stderr (the node's
log): `start` (process start -> this module imported: interpreter, Flower's imports, pulling the message,
the app bundle's install), `wait` (-> the handler), then either, with the node's warm worker (the default),
`handover` (the arrays to the worker and the reply back, the worker's own steps not counted) and the worker's
`trainer`, `decode`, `train`, `encode`; or, with `--no-worker`, `imports` (fedlase's training code and torch),
`config`, `trainer` (the partition from the node cache, the model), `decode`, `train`, `encode`; then `reply`
(pushing the reply and the process's exit), `total`, and `torch` (1 if the ClientApp process imported torch).
Timers only: the weights are the ones fedlase's own ClientApp gives, and the run is compared with the embedded
engine's at the end. Flower's polling intervals are tools/flower_local.py's (`launch.NODE_ENV`) unless the
environment sets them (`FLWR_SUPEREXEC_TASK_POLL_INTERVAL`), passed on to the nodes as set."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

_IMPORTED = time.time()

from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedlase.flower import client_app as fedlase_app  # noqa: E402

app = ClientApp()


class Clock:
    def __init__(self, msg: Message):
        self.t0 = self.t = time.time()
        self.steps: dict[str, float] = {}
        self.kind = f"{msg.metadata.message_type} round={msg.metadata.group_id or '-'}"

    def __call__(self, step: str) -> None:
        now = time.time()
        self.steps[step], self.t = now - self.t, now

    def done(self) -> None:
        """Write the line at the process's exit, so that `reply` holds the reply's push."""
        import atexit

        import psutil
        created = psutil.Process().create_time()
        first = {"start": _IMPORTED - created, "wait": self.t0 - _IMPORTED}
        end = time.time()

        def write():
            steps = {**first, **self.steps, "reply": time.time() - end, "total": time.time() - created,
                     "torch": float("torch" in sys.modules)}
            line = " ".join(f"{k}={v:.3f}" for k, v in steps.items())
            print(f"fedlase-profile pid={os.getpid()} {self.kind} {line}", file=sys.stderr, flush=True)
        atexit.register(write)


@app.query()
def query(msg: Message, context: Context) -> Message:
    clock = Clock(msg)
    reply = fedlase_app.query(msg, context)
    clock("answer")
    clock.done()
    return reply


@app.train()
def train(msg: Message, context: Context) -> Message:
    clock = Clock(msg)
    pid, rnd = fedlase_app.task_of(msg, context)
    if context.node_config.get("worker-dir"):
        warm = fedlase_app.via_worker(msg, context, pid)
        if warm is not None:
            clock("handover")
            header, content = warm
            worker = header.get("times", {})
            clock.steps["handover"] -= sum(worker.values())
            clock.steps.update(worker)
            clock.done()
            return Message(content, reply_to=msg)
    import torch  # noqa: F401

    import fedlase.flower.codec  # noqa: F401
    import fedlase.flower.node_data  # noqa: F401
    clock("imports")
    cfg = fedlase_app.context_config(context)
    clock("config")
    content = fedlase_app.train_content(cfg, msg.content, pid, rnd, times=clock.steps)   # trainer ... encode
    clock.done()
    return Message(content, reply_to=msg)


def read_lines(logs) -> list[dict]:
    """The `fedlase-profile` lines of the nodes' logs as {kind, round, step: seconds}."""
    out = []
    for f in logs:
        for line in f.read_text().splitlines():
            if line.startswith("fedlase-profile "):
                parts = line.split()
                row = {"kind": parts[2], "round": parts[3].split("=")[1]}
                row.update({k: float(v) for k, v in (p.split("=") for p in parts[4:])})
                out.append(row)
    return out


def table(rows: list[dict]) -> str:
    """Median seconds per step, one line per message kind (TRAIN of round 1 apart: it writes the node cache)."""
    import statistics
    groups: dict[str, list[dict]] = {}
    for r in rows:
        key = r["kind"] if r["kind"] != "train" else ("train, round 1" if r["round"] == "1" else "train, later")
        groups.setdefault(key, []).append(r)
    lines = []
    for key, rs in groups.items():
        steps = [k for k in rs[0] if k not in ("kind", "round")]
        med = " ".join(f"{k}={statistics.median(r.get(k, 0.0) for r in rs):.2f}" for k in steps)
        lines.append(f"{key} ({len(rs)} messages): {med}")
    return "\n".join(lines)


# One fresh interpreter, timing in order what a ClientApp process loads: Flower's runtime (the floor of every
# message), Flower's app API, fedlase's ClientApp module (all a message needs with a worker), the training code
# with torch, then the run's config read (as the ClientApp does without a worker) and validated (as before).
_STAGES = """
import json, sys, time, tomllib
t = time.perf_counter(); out = {}
def stage(name):
    global t
    now = time.perf_counter(); out[name] = now - t; t = now
import flwr.supernode.cli; stage("flower runtime")   # what `flwr-clientapp` imports before it pulls the message
import flwr.app, flwr.clientapp; stage("flower")
import fedlase.flower.client_app; stage("clientapp")
import torch, fedlase.flower.codec, fedlase.flower.node_data; stage("torch+training")
from fedlase.catalog import load_builtins; from fedlase.config import config_from_dict
raw = json.loads(tomllib.loads(open(sys.argv[1]).read())["tool"]["flwr"]["app"]["config"]["fedlase-config"])
load_builtins(); config_from_dict(raw, validate_=False); stage("config read")
config_from_dict(raw); stage("config validated")
print(json.dumps(out))
"""


def import_costs(app_toml: Path, reps: int = 5) -> str:
    """Median seconds of each stage over `reps` fresh interpreters (`python -m tools.flower_profile --imports
    OUT/flower-app/pyproject.toml`)."""
    import json
    import statistics
    import subprocess
    def bare() -> float:   # an interpreter that does nothing: start and exit
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        return time.perf_counter() - t
    runs = [{"python": bare(), **json.loads(subprocess.run([sys.executable, "-c", _STAGES, str(app_toml)],
                                                         capture_output=True, text=True, check=True).stdout)}
            for _ in range(reps)]
    return " ".join(f"{k}={statistics.median(r[k] for r in runs):.2f}" for k in runs[0])


def same_as_embedded(config: str | None, argv: list[str], out: Path) -> str:
    """Whether the run's final weights are the embedded engine's for the same config, bit for bit."""
    import shutil

    import torch

    from fedlase import checkpoint
    from fedlase.config import load_config
    from fedlase.engine import run_experiment
    emb = out.with_name(out.name + "-embedded")
    shutil.rmtree(emb, ignore_errors=True)
    run_experiment(load_config(config, [*argv, f"out={emb}"]), progress=False)
    a, b = (checkpoint.load(d / "checkpoint.pt")["params"] for d in (out, emb))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return "identical to the embedded engine's" if same else "DIFFERENT from the embedded engine's"


def main(argv: list[str]) -> int:
    import json
    import signal

    from fedlase.catalog import load_builtins
    from fedlase.config import load_config
    from fedlase.errors import UserError
    from fedlase.flower.launch import partition_pins, quiet_env, submit, write_app
    from tools.flower_local import LocalFederation

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    quiet_env()
    if argv[:1] == ["--imports"]:
        print(import_costs(Path(argv[1])))
        return 0
    workers = "--no-worker" not in argv
    argv = [a for a in argv if a != "--no-worker"]
    config = argv.pop(0) if argv and "=" not in argv[0] else None
    root = str(Path(__file__).resolve().parents[1])
    try:
        load_builtins()
        base = load_config(config, argv)
        out = Path(base.out).resolve()
        with LocalFederation(out, nodes=base.num_clients, workers=workers) as fed:
            fed.env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])   # nodes import tools
            fed.env["FEDLASE_CACHE"] = os.environ.get("FEDLASE_CACHE", str(out / "node-cache"))
            fed.start_all(base)
            cfg = load_config(config, [*argv, *fed.run_args(), f"out={out}"])
            app_dir = write_app(out / "flower-app", cfg, False, False, partition_pins(cfg),
                                client_app="tools.flower_profile:app")
            os.environ.update({k: fed.env[k] for k in ("FLWR_HOME", "PYTHONPATH")})
            t = time.time()
            submit(cfg, app_dir)
            wall = time.time() - t
        rows = read_lines(sorted((out / "flower-logs").glob("supernode-*.log")))
        times = [json.loads(x)["train_time"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        rounds = [round(b - a, 2) for a, b in zip([0.0, *times], times)]
        print(f"run: {wall:.1f} s submitted to finished ({'with' if workers else 'without'} workers, "
              f"FLWR_SUPEREXEC_TASK_POLL_INTERVAL={fed.env.get('FLWR_SUPEREXEC_TASK_POLL_INTERVAL', '1.0 (Flower)')}"
              f"); train_time per round (s): {rounds}")
        print(table(rows))
        print(f"weights: {same_as_embedded(config, argv, out)}")
        return 0
    except UserError as e:
        print(f"flower_profile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
