"""Tests for fedlase.aggregate: per-coordinate coverage averaging and the `mean` (divide by |A|) rule,
checked against hand-computed values."""
import pytest
import torch

from fedlase.aggregate import Aggregator, aggregate
from fedlase.masks import Submodel

# floats computed in different ways are compared here: .ci/run runs these again on torch's portable kernels
pytestmark = pytest.mark.numerics

T = torch.tensor


def three_clients():
    """Global params: 'w' (masked by every client) and 'bn' (never masked, like a BatchNorm parameter).

    coordinate of w:   0        1          2        3
    client 1 mask      x        x          .        .     delta w = [2, 4, 0, 0]   delta bn = [1,  1]
    client 2 mask      .        x          x        .     delta w = [0, 0, 6, 0]   delta bn = [3, -1]
    client 3 mask      x        .          x        .     delta w = [4, 0, 3, 0]   delta bn = [2,  0]
    Client 2 trained coordinate 1 but its delta there is exactly 0: it still counts."""
    glob = {"w": T([10.0, 20.0, 30.0, 40.0]), "bn": T([1.0, 2.0])}
    updates = [
        ({"w": T([2.0, 4.0, 0.0, 0.0]), "bn": T([1.0, 1.0])}, Submodel({"w": T([True, True, False, False])})),
        ({"w": T([0.0, 0.0, 6.0, 0.0]), "bn": T([3.0, -1.0])}, Submodel({"w": T([False, True, True, False])})),
        ({"w": T([4.0, 0.0, 3.0, 0.0]), "bn": T([2.0, 0.0])}, Submodel({"w": T([True, False, True, False])})),
    ]
    return glob, updates


def test_coverage_average_by_hand():
    # Prepare
    glob, updates = three_clients()
    before = {k: v.clone() for k, v in glob.items()}
    # Execute
    new = aggregate(glob, updates, "coverage")
    # Assert
    # w0: clients 1, 3 -> (2 + 4) / 2 = 3;  w1: clients 1, 2 -> (4 + 0) / 2 = 2 (not 4: the zero delta counts)
    # w2: clients 2, 3 -> (6 + 3) / 2 = 4.5;  w3: nobody -> unchanged
    assert torch.equal(new["w"], T([13.0, 22.0, 34.5, 40.0]))
    # bn: no mask, averaged over all three clients: (1 + 3 + 2) / 3 = 2, (1 - 1 + 0) / 3 = 0
    assert torch.equal(new["bn"], T([3.0, 2.0]))
    # the global parameters passed in are not modified
    assert all(torch.equal(glob[k], before[k]) for k in glob)


def test_mean_mode_divides_by_the_number_of_clients():
    # Prepare
    glob, updates = three_clients()
    # Execute
    new = aggregate(glob, updates, "mean")
    # Assert: sum of masked deltas / |A| = [6, 4, 9, 0] / 3
    assert torch.allclose(new["w"], T([12.0, 20 + 4 / 3, 33.0, 40.0]))
    assert torch.equal(new["bn"], T([3.0, 2.0]))


def test_two_clients_on_a_matrix():
    # Prepare: a 2x2 weight; client A trains the first row, client B the diagonal
    glob = {"k": torch.zeros(2, 2)}
    a = ({"k": T([[1.0, -1.0], [0.0, 0.0]])}, Submodel({"k": T([[True, True], [False, False]])}))
    b = ({"k": T([[3.0, 0.0], [0.0, 5.0]])}, Submodel({"k": T([[True, False], [False, True]])}))
    # Execute
    new = aggregate(glob, [a, b])
    # Assert: (0,0) both -> 2; (0,1) only A -> -1; (1,0) nobody -> 0; (1,1) only B -> 5
    assert torch.equal(new["k"], T([[2.0, -1.0], [0.0, 5.0]]))


def test_single_client_full_model_takes_its_delta():
    glob = {"w": T([1.0, 2.0])}
    new = aggregate(glob, [({"w": T([0.5, -0.5])}, Submodel())])
    assert torch.equal(new["w"], T([1.5, 1.5]))


def test_threshold_submodel_counts_its_start_mask():
    # Coverage comes from the mask sent at the start of the round, also for threshold submodels.
    glob = {"w": T([0.0, 0.0])}
    sub = Submodel({"w": T([True, False])}, thresholds={"w": 0.5})
    other = Submodel({"w": T([True, True])})
    new = aggregate(glob, [({"w": T([2.0, 0.0])}, sub), ({"w": T([4.0, 6.0])}, other)])
    assert torch.equal(new["w"], T([3.0, 6.0]))


def test_no_clients_leaves_the_model_unchanged():
    glob, _ = three_clients()
    for mode in ("coverage", "mean"):
        new = aggregate(glob, [], mode)
        assert all(torch.equal(new[k], glob[k]) for k in glob)


def test_unknown_mode():
    with pytest.raises(ValueError):
        Aggregator({"w": torch.zeros(1)}, "median")
