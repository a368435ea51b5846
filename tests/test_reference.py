"""A 2-round run of each of the six methods the engine's restructure had to keep (FedLASE, FIARSE, HeteroFL,
FedRolex, FedAvg, FedAvg-small; the methods added since have their own tests), both BN modes, reproduces the
stored reference (tests/reference/two_rounds.json, written by the code before the engine was restructured, on
another machine): the restructure changed no result. scripts/reference_runs.py runs the same 12 and says how far
a machine is from the stored values (or, with --write, stores its own).

The stored numbers come from another CPU, so they are compared with tolerances, not bit for bit. How they were
chosen (2026-12-01, an AVX-512 Xeon; the 12 runs under ATEN_CPU_CAPABILITY=default, avx2 and avx512, plus the
stored values, written on an AVX2 machine):
- train_loss: every method but FedAvg spread by at most 7.1e-8 (relative) over the four; FedAvg by 3.1e-4. FedAvg
  trains the whole width-0.5 CNN, whose last conv block sees a 2x2 map per image: its batch-statistics BN is
  ill-conditioned there, and the kernels' last-bit differences grow to 3e-4 of its weights after two steps.
  One-line changes to an algorithm move the loss by far more than the first bound: FedLASE without the log
  8.5e-2, score=max 3.9e-3, without overlap 7.2e-3, ste=fixed 3.8e-4; FIARSE ste=paper 4.4e-3; FedAvg with
  momentum 0.01 4.2e-4 (inside FedAvg's bound: its training and aggregation code is shared with, and held by,
  the other methods' tight bound).
- accuracies: every method but FedAvg equal on all four; FedAvg apart by 3 of 360 test images. The same changes
  move some level by 5-99 images (ste=fixed: 0.05; score=max: 0.017).
- `kept` (coordinates a level holds): equal on all four, compared exactly.

The stored runs were made under the plain mean after the 100x screen, the default rule until issue 39; they run
under it by name (`robust=screen`), so the stored numbers stay those of the other machine. The default rule
(`bounded`) clips updates before that mean: under it 10 of these 12 runs leave their tolerances (FedAvg's two
stay inside its looser ones). Its server step is tested in tests/test_robust.py.
"""
import json
import math
from pathlib import Path

import pytest

from fedlase.config import load_config
from fedlase.engine import run_experiment

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics

REFERENCE = json.loads((Path(__file__).parent / "reference" / "two_rounds.json").read_text())
LOSS_RTOL = {"fedavg": 3e-3}   # 10x the measured spread; the others' 1e-5 is 140x theirs, 38x under ste=fixed
LOSS_RTOL_DEFAULT = 1e-5
ACC_ATOL = {"fedavg": 8 / 360}  # the measured 3 images, with room; the others: 1 image of 360 (spread 0)
ACC_ATOL_DEFAULT = 1.5 / 360



@pytest.mark.parametrize("key", sorted(REFERENCE["runs"]))
def test_two_rounds_match_reference(key, tmp_path):
    ref = REFERENCE["runs"][key]
    method = key.split("/")[0]
    # the masked path of structured methods: sliced training equals it only up to float rounding (test_sliced.py)
    cfg = load_config(None, [*REFERENCE["base"], *ref["args"], "sliced=false", "coverage=mask", "robust=screen",
                             f"out={tmp_path / 'r'}"])
    final = run_experiment(cfg, progress=False)["final"]
    rtol, atol = LOSS_RTOL.get(method, LOSS_RTOL_DEFAULT), ACC_ATOL.get(method, ACC_ATOL_DEFAULT)
    assert math.isclose(final["train_loss"], ref["train_loss"], rel_tol=rtol), (key, final["train_loss"])
    for level, want in ref["levels"].items():
        got = final["levels"][level]
        assert got["kept"] == want["kept"], (key, level)
        for k in want.keys() - {"kept"}:
            assert abs(got[k] - want[k]) <= atol, (key, level, k, got[k], want[k])
