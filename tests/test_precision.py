"""The local steps' precision (`precision`), the channels-last layout and `batched_clients=auto`
(fedlase/train.py, fedlase/engine.py): bf16 autocasts the forward and loss only, fp32 stays what it was, and on
a CPU neither the layout nor `auto` changes anything."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedlase.engine import BatchedRounds, Experiment, SequentialRounds, trains_batched
from fedlase.train import _training_module, channels_last

ALL = ["participation=1.0", "rounds=1"]


def _round(tiny_cfg, *overrides):
    """The params after one round, and the dtypes the first conv's output had in the local steps."""
    exp = Experiment.from_config(tiny_cfg(*ALL, *overrides))
    seen = set()
    conv = next(m for m in exp.trainer.model.modules() if isinstance(m, nn.Conv2d))
    conv.register_forward_hook(lambda mod, inp, out: seen.add(out.dtype) if mod.training else None)
    exp.run_round(1)
    return exp, seen


@pytest.mark.numerics
@pytest.mark.parametrize("method", ["fedlase", "fedavg"])   # the masked forward, and the whole model's own copy
def test_bf16_autocasts_the_local_steps_and_keeps_fp32_state(tiny_cfg, method):
    start = Experiment.from_config(tiny_cfg(*ALL, f"method={method}")).params
    fp32, fp32_seen = _round(tiny_cfg, f"method={method}")
    bf16, bf16_seen = _round(tiny_cfg, f"method={method}", "precision=bf16")
    assert fp32.cfg.precision == "fp32" and fp32_seen == {torch.float32}
    assert bf16_seen == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in bf16.params.values())   # parameters and aggregation: fp32
    moved = max(float((fp32.params[n] - start[n]).abs().max()) for n in start)
    apart = max(float((fp32.params[n] - bf16.params[n]).abs().max()) for n in start)
    assert moved > 1e-3 and 0 < apart < moved   # bf16 rounds differently, but trains the same way


def test_bf16_trains_batched_clients(tiny_cfg):
    exp, seen = _round(tiny_cfg, "method=fiarse", "precision=bf16", "batched_clients=true")
    assert isinstance(exp.runner, BatchedRounds) and seen == {torch.bfloat16}
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in exp.params.values())


def test_channels_last_leaves_a_cpu_run_alone():
    x = torch.randn(2, 3, 4, 4)
    assert channels_last(x) is x   # on a CPU: the same tensor, not a copy in another layout
    net = _training_module(nn.Sequential(nn.Conv2d(3, 4, 3)))[0]
    assert net[0].weight.is_contiguous()


def test_batched_clients_auto_batches_on_cuda_only_where_allowed(tiny_cfg):
    cfg = tiny_cfg()
    assert cfg.batched_clients == "auto"   # the default
    # a CPU run: sequential, bit for bit as before
    assert isinstance(Experiment.from_config(cfg).runner, SequentialRounds)
    plain = nn.Sequential(nn.Linear(2, 2))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")   # a device name only: nothing runs on it
    assert trains_batched(cfg, SimpleNamespace(device=cuda, model=plain))
    assert not trains_batched(cfg, SimpleNamespace(device=cpu, model=plain))
    assert not trains_batched(cfg, SimpleNamespace(device=cuda, model=nn.Sequential(nn.Dropout(0.5))))
    assert not trains_batched(tiny_cfg("method=fjord"), SimpleNamespace(device=cuda, model=plain))   # runs_on
    assert trains_batched(tiny_cfg("label_split=true"), SimpleNamespace(device=cuda, model=plain))   # batches too
    assert trains_batched(tiny_cfg("batched_clients=true"), SimpleNamespace(device=cpu, model=plain))
    assert not trains_batched(tiny_cfg("batched_clients=false"), SimpleNamespace(device=cuda, model=plain))
