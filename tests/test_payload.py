"""A client's payload in torch alone (fedlase/payload.py): its bytes are those the Flower codec sends, and the
simulated clock that counts them gives the same time whether or not `flwr` can be imported."""
import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fedlase.dispatch import run_config
from fedlase.engine import build_parts
from fedlase.payload import delta_arrays, payload_bytes, submodel_arrays

CLOCKED = ["device_model.speed=1e9", "device_model.bandwidth=1e5"]   # a clock on which the bytes weigh


@pytest.mark.flower
@pytest.mark.parametrize("method", ["fiarse", "heterofl", "fedavg"])   # thresholds, slices, no masks at all
def test_the_payload_is_what_the_codec_sends(tiny_cfg, method):
    pytest.importorskip("flwr")
    from fedlase.flower.codec import encode_delta, encode_submodel, record_bytes
    p = build_parts(tiny_cfg(f"method={method}"))
    params = {n: t.detach() for n, t in p.model.named_parameters()}
    buffers = {n: t.detach() for n, t in p.model.named_buffers()}
    dense = sum(t.numel() * t.element_size() for t in params.values())
    for lvl in p.levels:
        sub = p.method.submodel(params, lvl, 1)
        down = payload_bytes(submodel_arrays(params, buffers, sub))
        assert down == record_bytes(*encode_submodel(params, buffers, sub).array_records.values())
        assert down > dense or (method != "fedavg" and lvl.index > 0)   # a smaller level travels smaller
        delta = {n: t + 1 for n, t in params.items()}
        assert payload_bytes(delta_arrays(delta, sub)) == record_bytes(encode_delta(delta, sub))


def hide_flower(monkeypatch) -> None:
    """Make `import flwr` (and flwr.*, and fedlase.flower.*) raise ImportError in this process, as where the
    `flower` extra is not installed, until the test ends."""
    for name in [m for m in sys.modules if m.split(".")[0] == "flwr" or m.startswith("fedlase.flower")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("flwr", "fedlase.flower"):
        monkeypatch.setitem(sys.modules, name, None)


def _sim_times(out: Path) -> list[float]:
    return [json.loads(line)["sim_time"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sim_time_is_the_same_with_and_without_flwr(tiny_cfg, tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    cfg = [*CLOCKED, "rounds=1", "method=fiarse"]
    run_config(tiny_cfg(*cfg, out=str(tmp_path / "with")), progress=False)
    with monkeypatch.context() as m:
        hide_flower(m)
        with pytest.raises(ImportError):
            import flwr  # noqa: F401
        run_config(tiny_cfg(*cfg, out=str(tmp_path / "without")), progress=False)
    with_flwr, without = _sim_times(tmp_path / "with"), _sim_times(tmp_path / "without")
    assert len(without) == 1 and without[0] > 0 and without == with_flwr


def test_the_payload_module_needs_no_flower_and_leaves_the_environment(monkeypatch):
    before = dict(os.environ)
    hide_flower(monkeypatch)
    monkeypatch.delitem(sys.modules, "fedlase.payload")
    fresh = importlib.import_module("fedlase.payload")
    assert fresh.payload_bytes({"w": torch.zeros(3)}) > 12 and dict(os.environ) == before


@pytest.mark.flower
@pytest.mark.parametrize("method", ["fjord", "depthfl method_args.heads=linear", "feddse"])
def test_a_local_objective_is_charged_what_the_codec_sends(tiny_cfg, method):
    """A submodel with its method's own local objective travels as any other (the node rebuilds the objective):
    the clock charges each level the bytes of the message its client is sent and of the reply it sends back (a
    FedDSE client's channel choice included), not the dense model each way."""
    pytest.importorskip("flwr")
    from fedlase.cost import level_costs
    from fedlase.flower.codec import encode_delta, encode_submodel, record_bytes
    name, *args = method.split()
    p = build_parts(tiny_cfg(f"method={name}", *args))
    params = {n: t.detach() for n, t in p.model.named_parameters()}
    buffers = {n: t.detach() for n, t in p.model.named_buffers()}
    costs = level_costs(p.model, p.method, p.trainer, p.levels, p.level_clients, params, buffers)
    dense = sum(t.numel() * t.element_size() for t in params.values())
    for lvl, cost in zip(p.levels, costs):
        client = p.level_clients[lvl][0]
        sub = p.trainer.submodel(client, p.method.submodel(params, lvl, 1), params)
        assert sub.local is not None or lvl.index == 0
        assert cost.down_bytes == record_bytes(*encode_submodel(params, buffers, sub).array_records.values())
        reply, _ = p.trainer.update(client, params, buffers, sub, 1)   # what the node trains and sends
        assert cost.up_bytes == record_bytes(encode_delta(reply, sub))
        if name == "feddse" and lvl.index > 0:   # the dense delta and, beside it, one bool per channel chosen from
            assert cost.up_bytes > dense and set(reply) - set(params) == set(p.method.own_reply(lvl))
        elif name == "fjord" and lvl.index > 0:   # its level's slice, smaller than the dense model
            assert cost.up_bytes < dense and cost.down_bytes < dense
