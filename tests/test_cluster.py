"""Sweeps and Flower simulations on a running Ray cluster, tested on a real one: a head and a second node on
loopback (`ray start`, 1 CPU each, their own temp folders), started once for the module. Select with
`-m ray`, skip with `-m "not ray"`.

The nodes are ended by pid at the end (their processes are found by their temp folder): `ray stop` would
stop every Ray of this user on the machine, other programs' included."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from fedlase.config import load_config  # noqa: E402
from fedlase.engine import run_experiment  # noqa: E402
from fedlase.sweep import run_sweep  # noqa: E402

# one worker runs the whole module under `pytest -n 2 --dist loadgroup` (make test): its tests share one cluster
pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("ray-cluster")]

RAY = str(Path(sys.executable).with_name("ray"))
# Tiny runs on the bundled digits: a quarter-width CNN, 4 clients, 2 local steps, one thread.
BASE = {"dataset": "digits", "model": "cnn", "width": 0.25, "system": "{1,1/4}_{2,2}", "participation": 0.5,
        "local_steps": 2, "batch_size": 16, "rounds": 2, "eval_every": 1, "device": "cpu", "checkpoint_every": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_processes(root: Path) -> set:
    """Every live process of the nodes whose temp folder is `root`: those naming it on their command line
    (gcs, raylet, monitors, workers) and everything below them (the raylet's agents and workers)."""
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        if str(root) in " ".join(p.info["cmdline"] or []):
            found.add(p)
            with contextlib.suppress(psutil.Error):
                found.update(p.children(recursive=True))
    return {p for p in found if p.is_running()}


def end(procs) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=5)   # the gcs server may not end on SIGTERM
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture(scope="module")
def cluster():
    """A two-node Ray cluster on loopback: {'address', 'env', 'nodes': {'a': head node id, 'b': other}}."""
    root = Path(tempfile.mkdtemp(prefix="flr", dir="/tmp"))   # short: Ray's socket paths have a length limit
    os.environ["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] = "0"   # this driver: no notice about a future default
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "FEDLASE_CACHE": str(root / "cache")}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--object-store-memory", str(100 * 2 ** 20),
              "--disable-usage-stats"]
    head = [RAY, "start", "--head", "--port", str(port), "--temp-dir", str(root / "a"), "--resources",
            '{"node_a": 1}', "--include-dashboard", "false", "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-port", str(free_port()), *common]
    other = [RAY, "start", "--address", f"127.0.0.1:{port}", "--temp-dir", str(root / "b"), "--resources",
             '{"node_b": 1}', "--dashboard-agent-listen-port", str(free_port()), *common]
    try:
        for cmd in (head, other):
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        address = f"127.0.0.1:{port}"
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            deadline = time.monotonic() + 60
            while len(alive := [n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            nodes = {k: n["NodeID"] for n in alive for k in ("a", "b") if f"node_{k}" in n["Resources"]}
        finally:
            ray.shutdown()
        assert len(nodes) == 2, alive
        yield {"address": address, "env": env, "nodes": nodes, "root": root}
    finally:
        end(node_processes(root))
        left = node_processes(root)
        assert not left, f"Ray processes left behind: {sorted(p.pid for p in left)}"
        shutil.rmtree(root, ignore_errors=True)


def write_sweep(path: Path, out: Path, **spec) -> Path:
    path.write_text(yaml.safe_dump({"base": BASE, "out": str(out), **spec}, sort_keys=False))
    return path


def sweep_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "sweep.jsonl").read_text().splitlines()]


def params(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)["params"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sweep_spreads_over_both_nodes_and_records_each_runs_node(cluster, tmp_path):
    out = tmp_path / "out"
    path = write_sweep(tmp_path / "s.yaml", out, grid={"seed": [0, 1, 2, 3]})
    res = run_sweep(path, progress=False, ray=cluster["address"])
    assert sorted(res["done"]) == [f"seed={s}" for s in range(4)] and res["failed"] == []
    lines = sweep_lines(out)
    assert len(lines) == 4 and all(x["status"] == "done" for x in lines)
    # with one CPU per node and one thread per run, two runs go at once: one on each node
    assert {x["node"] for x in lines} == set(cluster["nodes"].values())
    for x in lines:   # the node the task says it ran on is the one recorded
        assert json.loads((out / x["run"] / "worker.json").read_text())["node"] == x["node"]
        assert (out / x["run"] / "summary.json").is_file()
    # the same sweep again: everything is done, nothing runs
    again = run_sweep(path, progress=False, ray=cluster["address"])
    assert again["done"] == [] and len(again["skipped"]) == 4


def start_sweep(path: Path, cluster: dict, log_path: Path) -> subprocess.Popen:
    """`fedlase sweep PATH --ray` as a process, its output in a file: a pipe read only at the end can fill up
    and stall the driver."""
    with open(log_path, "w") as log:   # the child holds its own copy of the file
        return subprocess.Popen([sys.executable, "-m", "fedlase", "sweep", str(path), "--quiet", "--ray",
                                 cluster["address"]], env=cluster["env"], stdout=log, stderr=subprocess.STDOUT)


def test_a_run_whose_worker_is_killed_resumes_and_ends_bit_identical(cluster, tmp_path):
    out = tmp_path / "out"
    long = {"rounds": 20, "eval_every": 10, "seed": 3}   # killed after its first checkpoint, far from its end
    path = write_sweep(tmp_path / "s.yaml", out, runs=[{"name": "long", **long}])
    run = out / "long"
    log_path = tmp_path / "sweep.out"
    proc = start_sweep(path, cluster, log_path)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "worker.json").is_file() and (run / "checkpoint.pt").is_file()):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        pid = json.loads((run / "worker.json").read_text())["pid"]
        worker = psutil.Process(pid)
        assert worker in node_processes(cluster["root"])   # a worker of our cluster, nothing else
        worker.kill()
        assert not (run / "summary.json").exists(), "the run ended before its worker was killed; make it longer"
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    log = (run / "sweep.log").read_text()
    assert log.count("sweep: run long on node") == 2 and "resuming" in log, log[-3000:]   # Ray ran it again
    assert [x["status"] for x in sweep_lines(out)] == ["done"]
    # the same run, never interrupted, in this process with the same thread count
    ref = run_experiment(load_config(None, [f"{k}={v}" for k, v in {**BASE, **long}.items()]
                                     + ["threads=1", f"out={tmp_path / 'ref'}"]), progress=False)
    assert same(params(run), params(tmp_path / "ref"))
    timeless = lambda final: {k: v for k, v in final.items() if not k.endswith("_time")}   # noqa: E731
    assert timeless(json.loads((run / "summary.json").read_text())["final"]) == timeless(ref["final"])


def test_flower_sim_on_the_cluster_equals_the_embedded_engine(cluster, tmp_path):
    args = [f"{k}={v}" for k, v in {**BASE, "participation": 1}.items()] + ["threads=1"]
    res = subprocess.run([sys.executable, "-m", "fedlase", "run", *args, f"out={tmp_path / 'sim'}",
                          "engine=flower-sim", f"ray_address={cluster['address']}", "--quiet"],
                         env=cluster["env"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    run_experiment(load_config(None, [*args, f"out={tmp_path / 'emb'}"]), progress=False)
    assert same(params(tmp_path / "sim"), params(tmp_path / "emb"))
    # fedlase joined the cluster and left it running: both nodes are still there, and the ClientApps ran in
    # actors on both (the GCS keeps ended actors; its actor table is a debugging API of Ray's)
    ray.init(address=cluster["address"], logging_level="ERROR", log_to_driver=False)
    try:
        assert sum(n["Alive"] for n in ray.nodes()) == 2
        clients = [a for a in ray._private.state.actors().values() if "ClientAppActor" in a["ActorClassName"]]
        assert {a["Address"]["NodeID"] for a in clients} == set(cluster["nodes"].values()), clients
    finally:
        ray.shutdown()


def test_bad_addresses_are_one_line_errors_in_seconds(tmp_path, capsys):
    """Nothing there, something else there (an HTTP server: Ray would retry for minutes), no address."""
    import http.server
    import threading

    from fedlase.cli import main
    path = write_sweep(tmp_path / "s.yaml", tmp_path / "out", grid={"seed": [0]})
    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):   # the server's own lines would go to the stderr under test
            pass
    web = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        for address, needle in ((f"127.0.0.1:{free_port()}", "no Ray cluster answers"),
                                (f"127.0.0.1:{web.server_address[1]}", "answers but is not a Ray cluster's head"),
                                ("nonsense", "is not host:port")):
            t0 = time.monotonic()
            assert main(["sweep", str(path), "--quiet", "--ray", address]) == 2
            err = capsys.readouterr().err
            assert needle in err and len(err.strip().splitlines()) == 1 and time.monotonic() - t0 < 10, err
    finally:
        web.shutdown()
        web.server_close()
    assert main(["sweep", str(path), "--quiet", "--ray", "127.0.0.1:1", "--jobs", "2"]) == 2
    assert "do not go together" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_node_without_the_sweep_folder_is_a_clear_error(cluster, tmp_path, monkeypatch, capsys):
    """A folder the driver has and the nodes do not (here: the nodes' processes see no such path, because
    the probe looks for a marker the driver wrote elsewhere) stops the sweep before any run starts."""
    import fedlase.cluster as cl
    real = cl._probe
    monkeypatch.setattr(cl, "_probe", lambda folder, token: real(folder + "-elsewhere", token))
    from fedlase.cli import main
    path = write_sweep(tmp_path / "s.yaml", tmp_path / "out", grid={"seed": [0]})
    assert main(["sweep", str(path), "--quiet", "--ray", cluster["address"]]) == 2
    err = capsys.readouterr().err
    assert "cannot use the sweep folder" in err and "shares" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / "seed=0" / "summary.json").exists()


def test_ctrl_c_cancels_the_tasks_and_the_rerun_resumes_them(cluster, tmp_path):
    # the runs are far too long to end on their own (rounds does not change a run's result, so the rerun may
    # shorten them): however slow the machine, both are still running when Ctrl-C comes
    out = tmp_path / "out"
    spec = {"grid": {"seed": [0, 1]}, "runs": [{"name": "r", "rounds": 10 ** 6, "eval_every": 10 ** 6}]}
    path = write_sweep(tmp_path / "s.yaml", out, **spec)
    runs = [out / f"r,seed={s}" for s in (0, 1)]
    going = lambda r: (r / "worker.json").is_file() and (r / "checkpoint.pt").is_file()   # noqa: E731
    log_path = tmp_path / "sweep.out"
    proc = start_sweep(path, cluster, log_path)
    try:
        deadline = time.monotonic() + 180
        while not all(going(r) for r in runs):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        workers = [psutil.Process(json.loads((r / "worker.json").read_text())["pid"]) for r in runs]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert proc.returncode == 130 and "run the same command again" in text, text[-3000:]
    # nothing is recorded for a cancelled run, and its worker is gone
    assert not any((r / "summary.json").exists() for r in runs)
    assert not (out / "sweep.jsonl").exists() or not (out / "sweep.jsonl").read_text().strip()
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive
    # the rerun (finding the cluster through RAY_ADDRESS), one round past where the runs stopped, resumes
    # them from their checkpoints
    stopped_at = [torch.load(r / "checkpoint.pt", map_location="cpu", weights_only=True)["round"] for r in runs]
    spec["runs"][0].update(rounds=max(stopped_at) + 1, eval_every=1)
    write_sweep(path, out, **spec)
    res = subprocess.run([sys.executable, "-m", "fedlase", "sweep", str(path), "--quiet", "--ray", "auto"],
                         env={**cluster["env"], "RAY_ADDRESS": cluster["address"]}, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert all("resuming" in (r / "sweep.log").read_text() for r in runs)
    assert sorted(json.loads(x)["run"] for x in (out / "sweep.jsonl").read_text().splitlines()) == \
        ["r,seed=0", "r,seed=1"]
