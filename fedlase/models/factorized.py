"""Low-rank factorized 3x3 convolutions (FedLMT, pFedLMT; fedlase/methods/fedlmt.py).

A 3x3 convolution W (out x in x 3 x 3, stride s, padding 1) becomes a (1x3) convolution in -> r (stride (1, s),
padding (0, 1)) followed by a (3x1) convolution r -> out (stride (s, 1), padding (1, 0)). Their composition is
the 3x3 convolution with

    W[o, i, h, w] = sum_k second[o, k, h, 0] * first[k, i, 0, w],

that is, in the (out*3) x (in*3) layout whose rows are (o, h) and columns (i, w),

    W.permute(0, 2, 1, 3).reshape(out*3, in*3) = U V^T,   U[(o, h), k] = second[o, k, h, 0],
                                                           V[(i, w), k] = first[k, i, 0, w].

(`as_matrix`, `compose`, `decompose`; tests/test_fedlmt.py checks the factorized module against F.conv2d with the
composed W.) The permutation matters: the authors' `decom()` reshapes W (out, in, 3, 3) to (3*out) x (3*in)
without it, which is not the layout the two convolutions compose to, so its SVD is not the best rank-r
approximation of the convolution; `decompose` permutes first.

A layer of rank r holds 3 r (in + out) weights against 9 in out. Which layers are factorized: every 3x3
convolution of the blocks from `decom_rule` on (the authors' hybrid rule; blocks before it stay full-rank), never
the stem, the 1x1 shortcuts, BatchNorm or the classifier. Blocks: ResNet-18's eight BasicBlocks in order (the
authors' `decom_rule` (stage, block) is block 2*stage + block, both counted from 0), the small CNN's conv layers
after its stem. A block's rank is round(alpha * planes), planes its output width (the methods keep alpha where
every rank is at least 1), capped at the matrix's full rank 3 * min(in, out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cnn import SmallCNN
from .resnet import ResNet18

__all__ = ["FactorizedConv2d", "as_matrix", "compose", "decompose", "factor_blocks", "factorize", "layer_plan",
           "rank_for", "budget_share", "block_prefixes"]


class FactorizedConv2d(nn.Module):
    """A 3x3 convolution (padding 1) through rank r: `first` (1x3, in -> r), then `second` (3x1, r -> out).
    Every shape comes from the weights, so a rank slice (first r' rows of `first`, columns of `second`) trains
    on this same module."""

    def __init__(self, cin: int, cout: int, rank: int, stride: int = 1):
        super().__init__()
        self.first = nn.Conv2d(cin, rank, (1, 3), (1, stride), (0, 1), bias=False)
        self.second = nn.Conv2d(rank, cout, (3, 1), (stride, 1), (1, 0), bias=False)
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def compose(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The dense 3x3 weight (out, in, 3, 3) the two factors compute: W[o,i,h,w] = sum_k second[o,k,h] first[k,i,w]."""
    return torch.einsum("okh,kiw->oihw", second[..., 0], first[:, :, 0, :])


def as_matrix(w: torch.Tensor) -> torch.Tensor:
    """W (out, in, 3, 3) in the (out*3) x (in*3) layout whose rank the factorization bounds: rows (o, h), columns
    (i, w)."""
    o, i, kh, kw = w.shape
    return w.permute(0, 2, 1, 3).reshape(o * kh, i * kw)


def decompose(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) of the best rank-`rank` approximation of W (truncated SVD of `as_matrix(w)`, each factor
    taking sqrt of the singular values), columns in decreasing singular value: the first r' of them are the
    rank-r' truncated SVD for every r' <= rank (nested ranks share one decomposition)."""
    o, i = w.shape[:2]
    u, s, vh = torch.linalg.svd(as_matrix(w.double()), full_matrices=False)
    root = s[:rank].sqrt()
    u_r = u[:, :rank] * root                       # (o*3, r): rows (o, h)
    v_r = vh[:rank].T * root                       # (i*3, r): rows (i, w)
    if u_r.shape[1] < rank:                        # rank above the matrix's: zero columns
        pad = rank - u_r.shape[1]
        u_r, v_r = F.pad(u_r, (0, pad)), F.pad(v_r, (0, pad))
    second = u_r.reshape(o, 3, rank).permute(0, 2, 1).unsqueeze(-1)   # (o, r, 3, 1)
    first = v_r.reshape(i, 3, rank).permute(2, 0, 1).unsqueeze(2)     # (r, i, 1, 3)
    return first.to(w.dtype).contiguous(), second.to(w.dtype).contiguous()


# ---- which layers, at which rank ----------------------------------------------------------------------------------
def factor_blocks(model: nn.Module) -> list[list[str]]:
    """The model's blocks in forward order, each the names of its 3x3 convolutions that may be factorized (the
    stem excluded). ValueError for a model fedlase does not know how to factorize."""
    if isinstance(model, ResNet18):
        return [[f"layer{s}.{b}.conv1", f"layer{s}.{b}.conv2"] for s in range(1, 5) for b in range(2)]
    if isinstance(model, SmallCNN):
        convs = [f"features.{i}" for i, m in enumerate(model.features) if isinstance(m, (nn.Conv2d, FactorizedConv2d))]
        return [[c] for c in convs[1:]]
    raise ValueError(f"{type(model).__name__} declares no blocks to factorize (fedlase/models/factorized.py knows "
                     "cnn and resnet18)")


def block_prefixes(model: nn.Module) -> list[tuple[str, ...]]:
    """Each block's parameter-name prefixes, as `factor_blocks` (a ResNet BasicBlock with its BNs and shortcut; a
    CNN conv with its BN)."""
    if isinstance(model, ResNet18):
        return [(f"layer{s}.{b}.",) for s in range(1, 5) for b in range(2)]
    return [(f"{conv}.", f"features.{int(conv.split('.')[1]) + 1}.") for (conv,) in factor_blocks(model)]


def rank_for(alpha: float, cin: int, cout: int) -> int:
    """A block's rank at ratio alpha: max(1, round(alpha * planes)), planes = out, at most 3 min(in, out)."""
    return min(max(1, round(alpha * cout)), 3 * min(cin, cout))


def layer_plan(model: nn.Module, decom_rule: int) -> dict[str, tuple[int, int, int]]:
    """The convolutions factorized under `decom_rule` (blocks from that index on): name -> (in, out, stride)."""
    blocks = factor_blocks(model)
    if not 0 <= decom_rule < len(blocks):
        raise ValueError(f"decom_rule must be 0..{len(blocks) - 1} on {type(model).__name__} ({len(blocks)} blocks)")
    mods = dict(model.named_modules())
    plan = {}
    for block in blocks[decom_rule:]:
        for name in block:
            m = mods[name]
            if isinstance(m, FactorizedConv2d):
                plan[name] = (m.first.in_channels, m.second.out_channels, m.stride)
            else:
                plan[name] = (m.in_channels, m.out_channels, m.stride[0])
    return plan


def budget_share(model: nn.Module, plan: dict, alpha: float, budgeted: list[str]) -> float:
    """The share of the dense model's budgeted parameters (conv and linear weights and biases) the model holds
    with `plan`'s convolutions factorized at ratio alpha: counted, not built. `model`: the dense one or the one
    `factorize` made of it (each FactorizedConv2d counted as the bias-free 3x3 convolution it replaced), so the
    methods plan the same ranks on either."""
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, FactorizedConv2d):   # both factors are budgeted: the dense weight's count in their place
            sizes[f"{name}.first.weight"] = 9 * m.first.in_channels * m.second.out_channels
            sizes[f"{name}.second.weight"] = 0
    dense = sum(sizes[n] for n in budgeted)
    held = dense
    for cin, cout, _ in plan.values():
        held += 3 * rank_for(alpha, cin, cout) * (cin + cout) - 9 * cin * cout
    return held / dense


def factorize(model: nn.Module, plan: dict, alpha: float) -> nn.Module:
    """Replace (in place) each planned dense 3x3 convolution by a FactorizedConv2d at ratio alpha's rank, freshly
    initialised (torch's default for each factor), as the authors' models start."""
    for name, (cin, cout, stride) in plan.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        setattr(parent, child, FactorizedConv2d(cin, cout, rank_for(alpha, cin, cout), stride).to(dense.weight.device))
    return model
