"""The loopback deployment attacked as issue 19 did, on one federation shared by the module (tools/flower_local.py:
the SuperLink on 127.0.0.1, nginx in front with mutual TLS and only the Fleet API, each SuperNode behind its own
sidecar). Partitions 0 and 1 are the legitimate nodes; key pair 2 is registered and has a valid client
certificate but is pinned to no partition; key pair 3 has a client certificate but was never registered.

- an outsider holding only the CA certificate cannot list runs, register a key, submit a run or reach the
  Fleet API;
- a client holding a node's certificate reaches the Fleet API and nothing else (no /openapi.json, no /docs,
  no Control or Runtime route);
- in one run (`attacked_run`): a registered node with a valid certificate claiming partition 0 is refused, gets
  no message, and the refusal is in metrics.jsonl and the log; an unregistered one is turned away at activation;
  node 1's worker is killed after round 1 (fedlase/flower/worker.py), and node 1 trains in its ClientApp
  processes from then on; the run finishes with the embedded engine's weights bit for bit."""
from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

os.environ.setdefault("FEDLASE_CACHE", tempfile.mkdtemp(prefix="fedlase-cache-"))
pytest.importorskip("flwr")

from test_flower import SMALL, TEST_POLL, _env, _logs, _metrics, _params, _submit, _wait, same_params  # noqa: E402
from test_worker import connect_as_nobody  # noqa: E402

from fedlase.catalog import load_builtins  # noqa: E402
from fedlase.config import load_config  # noqa: E402
from fedlase.engine import run_experiment  # noqa: E402
from fedlase.errors import UserError  # noqa: E402
from fedlase.flower.launch import write_app, write_connection  # noqa: E402
from fedlase.flower.processes import descendants  # noqa: E402
from fedlase.flower.proxy import body_limit, largest_request, nginx_binary  # noqa: E402
from fedlase.flower.security import fingerprint, make_credentials, make_node_key, node_cert  # noqa: E402

pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("deployment")]   # one module-scoped federation
# with dp (fedlase/privacy.py): the nodes clip in their reply path, the server adds the seeded noise, so the
# deployment still equals the embedded run bit for bit and records epsilon in every line
ARGS = [*SMALL, "system={1,1/4}_{1,1}", "rounds=2", "reply_timeout=150", "dp.clip=0.05", "dp.noise_multiplier=0.5"]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    """The federation: SuperLink, proxy, nodes 0 and 1 online, keys 0-2 registered. Stopped at the end of the
    module, whatever happened; no Flower or nginx process may outlive it."""
    try:
        nginx_binary()
    except Exception as e:
        pytest.fail(str(e))   # CI must have the proxy: `make setup` installs it
    from tools.flower_local import LocalFederation
    load_builtins()
    root = tmp_path_factory.mktemp("deployment")
    out = root / "dep"
    fed = LocalFederation(out, nodes=4)
    fed.env.update({"PYTHONPATH": _env()["PYTHONPATH"], **TEST_POLL})
    fed.runs = []
    try:
        max_body = body_limit(load_config(None, ARGS))   # what `start_all` gives the proxy for this run's model
        fed.start_superlink(max_body=max_body)
        for i in range(3):
            fed.register(Path(f"{fed.creds.nodes[i]}.pub"))
        nodes = {0: fed.start_node(0, "1"), 1: fed.start_node(1, "1/4")}
        yield SimpleNamespace(fed=fed, out=out, root=root, nodes=nodes, max_body=max_body)
    finally:
        for p in fed.runs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
        ours = set().union(*(descendants(p.pid) | {psutil.Process(p.pid)} for p in fed.procs.values()
                             if p.poll() is None))   # what it started, nginx workers and ClientApps included
        fed.stop()
        deadline = time.monotonic() + 20
        while (left := _alive(ours, root)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes left behind: {left}"


def _alive(procs, root: Path) -> list[str]:
    """Those of `procs` still running, and any process naming the module's folder (other sessions' runs on
    the same machine are not ours to count)."""
    left = []
    for p in {*procs, *psutil.process_iter()}:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            line = " ".join(p.cmdline())
            if p in procs or str(root) in line:
                left.append(f"{p.pid} {line[:120]}")
        except psutil.Error:
            pass
    return left


def _https(address: str, method: str, path: str, ca: Path, cert: tuple[Path, Path] | None = None,
           host: str = "localhost") -> tuple[int, str]:
    """One HTTPS request (verifying the server with the CA, presenting `cert` if given): (status, body)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert:
        ctx.load_cert_chain(*map(str, cert))
    port = int(address.rsplit(":", 1)[1])
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=30)
    try:
        conn.request(method, path, body=b"" if method == "POST" else None)
        res = conn.getresponse()
        return res.status, res.read().decode(errors="replace")
    finally:
        conn.close()


def _outsider(dep) -> dict:
    """An environment whose `flwr` knows one connection, `outsider`: the proxy's address and the CA, nothing else."""
    home = dep.root / "outsider-home"
    home.mkdir(exist_ok=True)
    write_connection(home, dep.fed.proxy, str(dep.fed.creds.ca), insecure=False)
    (home / "config.toml").write_text((home / "config.toml").read_text().replace("fedlase", "outsider"))
    return {**dep.fed.env, "FLWR_HOME": str(home)}


def _runs(dep) -> list:
    res = dep.fed.flwr("ls", "fedlase", "--format", "json")
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout[res.stdout.index("{"):])["runs"]


def test_an_outsider_with_the_ca_certificate_only_gets_nothing(dep):
    fed, env = dep.fed, _outsider(dep)
    # The SuperLink itself listens on loopback only; the proxy is the one address a node machine reaches.
    link = next(p for name, p in fed.procs.items() if name.startswith("superlink#"))
    listening = {c.laddr.ip for c in psutil.Process(link.pid).net_connections("tcp") if c.status == "LISTEN"}
    assert listening == {"127.0.0.1"}, listening
    runs_before = _runs(dep)

    listed = fed.flwr("ls", "outsider", env=env)
    assert listed.returncode != 0 and "400" in listed.stdout + listed.stderr, listed.stdout + listed.stderr
    attacker_key = dep.root / "attacker.key"
    make_node_key(attacker_key)
    reg = fed.flwr("supernode", "register", f"{attacker_key}.pub", "outsider", env=env)
    assert reg.returncode != 0, reg.stdout
    app = write_app(dep.root / "attacker-app", load_config(None, [*ARGS, f"out={dep.root / 'attacker-run'}"]),
                    False, False)
    run = fed.flwr("run", str(app), "outsider", env=env, timeout=120)
    assert run.returncode != 0, run.stdout

    # The Fleet API without a client certificate: nginx answers 400 itself, nothing reaches Flower.
    status, body = _https(fed.proxy, "POST", "/v1/fleet/pull-messages", fed.creds.ca)
    assert status == 400 and "No required SSL certificate" in body, (status, body)
    # Seen from the SuperLink's host: no new key, no new run.
    nodes = json.loads((r := fed.flwr("supernode", "list", "fedlase", "--format", "json")).stdout[
        r.stdout.index("{"):])["nodes"]
    assert len(nodes) == 3, nodes
    assert len(_runs(dep)) == len(runs_before)


def test_a_node_certificate_reaches_the_fleet_api_and_nothing_else(dep):
    fed = dep.fed
    cert = node_cert(fed.creds.folder, 0)
    # Every route the SuperLink serves, read on its own host (where its OpenAPI document is).
    status, body = _https(fed.address, "GET", "/openapi.json", fed.creds.ca)
    assert status == 200
    paths = sorted(json.loads(body)["paths"])
    fleet = [p for p in paths if p.startswith("/v1/fleet/")]
    other = [p for p in paths if not p.startswith("/v1/fleet/")] + ["/openapi.json", "/docs", "/redoc"]
    assert fleet and any(p.startswith("/v1/control/") for p in other)
    for path in other + ["/v1/fleet/../control/list-runs", "/v1/fleet/%2e%2e/control/list-runs"]:
        for method in ("GET", "POST"):
            status, _ = _https(fed.proxy, method, path, fed.creds.ca, cert)
            assert status == 404, (method, path, status)
    for path in fleet:   # reaches Flower, which refuses an empty body (nginx's 404 would mean not forwarded)
        status, _ = _https(fed.proxy, "POST", path, fed.creds.ca, cert)
        assert status != 404 and 400 <= status < 500, (path, status)
    status, _ = _https(fed.proxy, "GET", fleet[0], fed.creds.ca, cert)
    assert status == 403   # POST only


def _post(address: str, path: str, ca: Path, cert: tuple[Path, Path], length: int, body: bytes = b"") -> int:
    """A POST announcing a body of `length` bytes and sending `body` (b"": headers only); its status."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(*map(str, cert))
    conn = http.client.HTTPSConnection("localhost", int(address.rsplit(":", 1)[1]), context=ctx, timeout=60)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/protobuf")
        conn.putheader("Content-Length", str(length))
        conn.endheaders(body or None)
        return conn.getresponse().status
    finally:
        conn.close()


def test_the_body_limit_is_the_models_largest_request():
    """The limit grows with the model up to Flower's array chunk (a larger array travels in chunks), and is
    never below one full reply of a small model."""
    small = largest_request({"w": (1000,), "b": (10,)})
    assert small > 4 * 1010   # the arrays' float32 bytes and Flower's framing
    assert largest_request({"w": (200_000,)}) > 4 * 200_000 > small
    chunked = largest_request({"w": (20_000_000,)})   # 80 MB: chunks of at most 5 MiB
    assert chunked < 6 * 2**20 and body_limit() >= chunked
    cfg = load_config(None, ARGS)
    assert 2**20 <= body_limit(cfg) < 2**30


def test_a_body_beyond_the_limit_is_refused_by_the_proxy_before_the_superlink(dep):
    """nginx answers 413 to a request announcing one byte more than the limit: it is refused on its headers,
    before a byte of its body is sent, so nothing reaches the SuperLink; a body at the limit is forwarded
    (Flower itself then refuses the garbage)."""
    fed, cert = dep.fed, node_cert(dep.fed.creds.folder, 0)
    assert dep.max_body == body_limit(load_config(None, ARGS))
    assert _post(fed.proxy, "/v1/fleet/push-object", fed.creds.ca, cert, dep.max_body + 1) == 413
    status = _post(fed.proxy, "/v1/fleet/push-object", fed.creds.ca, cert, dep.max_body, b"\0" * dep.max_body)
    assert 400 <= status < 500 and status not in (404, 413), status


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_credentials_tool_keeps_keys_private_and_never_writes_through_a_link(tmp_path):
    """Over a world-readable key and a key that is a symlink: refused without --force (nothing written);
    with it, every private key ends 0600, the link is replaced by a file of its own and its target is untouched."""
    folder, target = tmp_path / "creds", tmp_path / "elsewhere"
    folder.mkdir()
    target.write_text("not a key")
    target.chmod(0o644)
    (folder / "superlink.key").write_text("old key")
    (folder / "superlink.key").chmod(0o644)
    (folder / "ca.key").symlink_to(target)
    tool = [sys.executable, "-m", "fedlase.flower.security", str(folder), "--nodes", "1"]
    res = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "--force" in res.stderr, res.stderr
    assert (folder / "superlink.key").read_text() == "old key" and not (folder / "ca.crt").exists()
    res = subprocess.run([*tool, "--force"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert target.read_text() == "not a key" and _mode(target) == 0o644   # the link's target: untouched
    assert not (folder / "ca.key").is_symlink() and b"PRIVATE KEY" in (folder / "ca.key").read_bytes()
    private = ["ca.key", "superlink.key", "node-0.key", "node-0.tls.key"]
    assert all(_mode(folder / n) == 0o600 for n in private), {n: oct(_mode(folder / n)) for n in private}
    assert all(_mode(folder / n) == 0o644 for n in ("ca.crt", "superlink.crt", "node-0.crt", "node-0.key.pub"))
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]   # no temporary file left behind
    with pytest.raises(UserError):   # the library function refuses the same way
        make_credentials(folder, nodes=1)


def _embedded(dep) -> dict:
    """The embedded engine's final weights for ARGS, run once for the module."""
    emb = dep.root / "emb"
    if not (emb / "summary.json").exists():
        run_experiment(load_config(None, [*ARGS, f"out={emb}"]), progress=False)
    return _params(emb)


LOGS = ("supernode-0.log", "supernode-1.log", "worker-supernode-0.log", "worker-supernode-1.log")


@pytest.fixture(scope="module")
def attacked_run(dep):
    """The module's one fedlase run (a worker binds to the first run it serves, so it must be the first): key 2,
    registered with a valid client certificate but pinned to no partition, claims partition 0, and key 3, with a
    certificate the SuperLink never registered, tries to join; neither gets a worker, as no message may reach
    them. After round 1, node 1's worker is SIGKILLed (its round-2 message needs seconds to arrive: Flower's 3 s
    idle poll). One run for both attacks: a deployment run costs about as much CPU as the federation's start."""
    fed, out, logs = dep.fed, dep.out / "run", dep.fed.logs
    before = {n: len((logs / n).read_text()) for n in LOGS}   # the federation's start wrote there too
    intruder = fed.start_node(0, "1", key=fed.creds.nodes[2], cert=node_cert(fed.creds.folder, 2), name="intruder",
                              worker=False)
    stranger = fed.start_node(0, "1", key=fed.creds.nodes[3], cert=node_cert(fed.creds.folder, 3), name="stranger",
                              worker=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:   # the intruder online before the run starts, so round 1 meets it
        if "SuperNode ID:" not in (logs / "intruder.log").read_text():
            time.sleep(0.2)   # not activated yet: no `flwr` process (2 s of CPU each) to ask the SuperLink
            continue
        res = fed.flwr("supernode", "list", "fedlase", "--format", "json")
        if res.returncode == 0 and sum(n["status"] == "online" for n in json.loads(
                res.stdout[res.stdout.index("{"):])["nodes"]) == 3:
            break
        time.sleep(1)
    else:
        pytest.fail("the intruder never came online\n" + _logs(dep.out))
    out.mkdir(parents=True, exist_ok=True)
    (out / "flower-logs").symlink_to(logs)
    run = _submit(fed, ARGS, out)
    deadline = time.monotonic() + 400
    while not _metrics(out) and run.poll() is None:
        assert time.monotonic() < deadline, "round 1 did not end\n" + _logs(out)
        time.sleep(0.1)
    w1 = fed.worker("supernode-1")
    assert w1 is not None, "node 1 has no worker"
    w1.kill()
    w1.wait()
    _wait(run, 400, out)
    new = {n: (logs / n).read_text()[before[n]:] for n in LOGS}
    return SimpleNamespace(out=out, intruder=intruder, stranger=stranger, new=new)


def test_a_worker_killed_mid_run_leaves_training_to_the_clientapp(dep, attacked_run):
    """The run finishes with the embedded engine's weights bit for bit, node 1's later messages train in their
    ClientApp processes with one line in its log saying so, node 0's worker trains every round, and (the
    module's end checks it) nothing is left running."""
    fed, out, new = dep.fed, attacked_run.out, attacked_run.new
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [1, 2] and all(x["clients"] == 2 and not x["failed"] for x in lines)
    assert same_params(_params(out), _embedded(dep))
    said = "this node trains in its ClientApp processes"
    assert new["supernode-1.log"].count(said) == 1 and said not in new["supernode-0.log"]
    assert new["worker-supernode-0.log"].count("trained partition 0") == 2
    assert new["worker-supernode-1.log"].count("trained partition 1") == 1
    if os.getuid() == 0:   # a node's worker, as the deployment made it, is closed to another user
        assert connect_as_nobody(Path(fed.deployment["nodes"]["supernode-0"]["worker"])) == "PermissionError"


def test_a_node_claiming_another_partition_is_refused_and_the_run_matches_embedded(dep, attacked_run):
    """The intruder is refused (in metrics.jsonl and the log) and never gets a message; the stranger is turned
    away at activation; the run finishes with the embedded engine's weights bit for bit."""
    fed, out = dep.fed, attacked_run.out
    assert same_params(_params(out), _embedded(dep))
    lines = _metrics(out)
    assert [x["round"] for x in lines] == [1, 2] and all(x["clients"] == 2 and not x["failed"] for x in lines)
    assert 0 < lines[0]["epsilon"] < lines[1]["epsilon"] and all(not x["rejected"] for x in lines)   # dp, clipped
    refused = [r for x in lines for r in x["refused"].values()]
    key2 = fingerprint(Path(f"{fed.creds.nodes[2]}.pub").read_bytes())
    assert len(refused) == 1 and key2 in refused[0]["reason"], refused
    assert all(x["moved"] == {} for x in lines)
    assert "refused node" in (out.parent / "run-run.log").read_text()
    # The intruder never got a message (no model, no query); the stranger was turned away and exited.
    assert "Receiving:" in (dep.out / "flower-logs" / "supernode-0.log").read_text()   # what a message leaves
    log = (dep.out / "flower-logs" / "intruder.log").read_text()
    assert "Receiving:" not in log and attacked_run.intruder.poll() is None, log
    assert attacked_run.stranger.wait(timeout=60) != 0
    assert "Failed to activate SuperNode" in (dep.out / "flower-logs" / "stranger.log").read_text()


def test_without_nginx_the_deployment_stops_in_one_line(tmp_path, monkeypatch):
    """No proxy on the machine: one line saying how to install it, before any process starts; never an open
    setup instead."""
    from fedlase.errors import UserError
    from fedlase.flower import proxy
    from tools.flower_local import LocalFederation
    monkeypatch.setattr(proxy.shutil, "which", lambda name: None)
    monkeypatch.setattr(proxy.os, "access", lambda path, mode: False)
    with pytest.raises(UserError) as e:
        LocalFederation(tmp_path / "dep", nodes=1)
    assert "apt-get install nginx" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "dep" / "flower-tls").exists()   # nothing made, nothing started
