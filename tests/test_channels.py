"""analysis.channels: empty conv channels / linear rows per level and the multiply-adds they cost."""
import json

import numpy as np
import torch
from torch import nn

from fedlase.analysis import empty_rows, row_macs
from fedlase.engine import run_experiment
from fedlase.masks import Submodel


def test_empty_rows_by_hand():
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    macs = row_macs(model, torch.zeros(1, 1, 4, 4))
    assert macs == {"0.weight": 16 * 9, "2.weight": 48}   # 16 positions x 1*3*3; one row: 48 inputs
    conv = torch.ones(3, 1, 3, 3, dtype=torch.bool)
    conv[1] = False                                        # channel 1 keeps nothing
    lin = torch.ones(2, 48, dtype=torch.bool)
    lin[0, 5:] = False                                     # row 0 keeps 5 inputs: not empty
    empty, rows, share = empty_rows(Submodel({"0.weight": conv, "2.weight": lin}), macs)
    assert (empty, rows) == (1, 5)
    assert share == 144 / (3 * 144 + 2 * 48)


def test_tracker_records_every_evaluation_and_resumes(tiny_cfg, tmp_path):
    args = ["method=fiarse", "system={1,1/4,1/16}_{2,2,2}", "rounds=4", "eval_every=2", "analysis.channels=true"]
    run_experiment(tiny_cfg(*args, out=str(tmp_path / "whole")), progress=False)
    run_experiment(tiny_cfg(*args, "rounds=2", out=str(tmp_path / "cut")), progress=False)
    run_experiment(tiny_cfg(*args, out=str(tmp_path / "cut")), resume=True, progress=False)
    a, b = (np.load(tmp_path / d / "analysis" / "channels.npz") for d in ("whole", "cut"))
    assert list(a["rounds"]) == [2, 4] and list(a["levels"]) == ["1", "1/4", "1/16"]
    assert all(np.array_equal(a[k], b[k]) for k in ("rounds", "empty", "rows", "macs_share"))
    assert (a["empty"][:, 0] == 0).all()                  # the full level keeps every row
    lines = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    shares = [line["empty_channels"] for line in lines if "empty_channels" in line]
    assert len(shares) == 2 and shares[-1]["1/16"] == round(float(a["macs_share"][-1, 2]), 6)


def test_forward_uses_agree_with_torchs_flop_counter():
    """The one per-layer compute figure (fedlase.layers.forward_uses, behind row_macs and fedlase_width's
    budget=both) against torch's FlopCounterMode (what fedlase/cost.py counts): each conv and linear layer's
    forward FLOPs are 2 x batch x uses x its weight's size."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedlase.layers import forward_uses
    from fedlase.models import ResNet18, SmallCNN
    for model in (SmallCNN(width=0.25, image_size=8), ResNet18(width=0.0625, image_size=16)):
        x = torch.randn(3, *model.input_shape)
        uses = forward_uses(model, x)
        assert uses == forward_uses(model)   # the default zero batch of input_shape: the same positions
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
        flops = {key.split(".", 1)[1] + ".weight": sum(ops.values()) for key, ops in counter.get_flop_counts().items()
                 if "." in key and isinstance(model.get_submodule(key.split(".", 1)[1]), (nn.Conv2d, nn.Linear))}
        params = dict(model.named_parameters())
        assert len(flops) >= 5 and set(flops) == set(uses)
        assert all(flops[n] == 2 * len(x) * uses[n] * params[n].numel() for n in flops), model
        assert row_macs(model, x[:1]) == {n: uses[n] * params[n][0].numel() for n in uses}
