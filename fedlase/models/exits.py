"""Exit classifiers for depth-scaled submodels (DepthFL, Kim et al., ICLR 2023): one classifier after each
stage of a model but the last, whose own classifier ends the last stage.

A model offers exits by declaring, besides its plain forward:
    `stages()`          the stage callables, in forward order (a depth-d network runs the first d);
    `stage_widths()`    each stage's output channels;
    `stage_prefixes()`  per stage, the name prefixes of its parameters (and buffers);
    `final_exit(h)`     its own classifier on the last stage's output, and `final_prefixes()` its names;
    `num_classes` (an attribute) and `norm(channels)` (a BN layer of the model's own mode) for the heads.
`attach_exits(model, kind)` then adds `exit_heads` (one per stage but the last) and a buffer `exit_depth`
whose length is the depth the model runs: a depth-d submodel slices it to d entries (fedlase/methods/
depthfl.py), so the evaluated network's depth comes from the tensors, like a width slice's shapes. Without
`attach_exits` a model has no exits and its forward is the plain one.

Heads (`kind`):
    bottleneck: DepthFL's own (BYOT style, as in Flower's DepthFL baseline, baselines/depthfl/resnet.py): an
        attention mask (a stride-2 separable conv, BN, ReLU, upsampled back, sigmoid) multiplies the stage's
        features; separable convs of stride 2 then widen them stage by stage to the last stage's width; global
        average pooling; a linear classifier.
    linear: global average pooling and one linear classifier on the stage's own channels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXIT_KINDS = ("bottleneck", "linear")
EXIT_PREDICTIONS = ("ensemble", "last")


class SepConv(nn.Module):
    """Depthwise 3x3 (stride s), pointwise, BN, ReLU, depthwise 3x3, pointwise to `cout`, BN, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, make_bn):
        super().__init__()
        self.ops = nn.Sequential(
            nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False), nn.Conv2d(cin, cin, 1, bias=False),
            make_bn(cin), nn.ReLU(),
            nn.Conv2d(cin, cin, 3, 1, 1, groups=cin, bias=False), nn.Conv2d(cin, cout, 1, bias=False),
            make_bn(cout), nn.ReLU())

    def forward(self, x):
        return self.ops(x)


class BottleneckExit(nn.Module):
    """DepthFL's exit after a stage of `widths[0]` channels; `widths`: this and the later stages' widths."""

    def __init__(self, widths: list[int], num_classes: int, make_bn):
        super().__init__()
        c = widths[0]
        self.attention = nn.Sequential(SepConv(c, c, 2, make_bn), make_bn(c), nn.ReLU())
        self.widen = nn.Sequential(*[SepConv(a, b, 2, make_bn) for a, b in zip(widths, widths[1:])])
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        # upsampled to the features' own size (the reference's x2 upsampling, which needs even sizes)
        mask = torch.sigmoid(F.interpolate(self.attention(x), size=x.shape[-2:], mode="bilinear", align_corners=False))
        h = self.widen(x * mask)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class LinearExit(nn.Module):
    """Global average pooling and a linear classifier on the stage's channels."""

    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def attach_exits(model: nn.Module, kind: str, predict: str = "ensemble") -> nn.Module:
    """Add exit heads of `kind` after every stage but the last (initialised from torch's global stream, after
    the model's own parameters, which keep their values). `predict`: what the plain forward returns, the mean
    of the exits' logits (ensemble, DepthFL's inference) or the deepest exit's (last)."""
    if kind not in EXIT_KINDS:
        raise ValueError(f"exit kind must be one of {EXIT_KINDS}, got {kind!r}")
    if predict not in EXIT_PREDICTIONS:
        raise ValueError(f"exit prediction must be one of {EXIT_PREDICTIONS}, got {predict!r}")
    widths, num_classes, bn = model.stage_widths(), model.num_classes, model.norm   # BN of the model's own mode
    device = next(model.parameters()).device
    heads = [BottleneckExit(widths[s:], num_classes, bn) if kind == "bottleneck" else LinearExit(widths[s], num_classes)
             for s in range(len(widths) - 1)]
    model.exit_heads = nn.ModuleList(heads).to(device)
    model.register_buffer("exit_depth", torch.zeros(len(widths), device=device))
    model.exit_predict = predict
    return model


def exits_forward(model: nn.Module, x: torch.Tensor, depth: int | None = None, all_exits: bool = False) -> torch.Tensor:
    """The exits' logits of a depth-`depth` network (default: the length of `exit_depth`), stacked (depth, B,
    classes) with `all_exits`, else combined as the model's `exit_predict` says."""
    stages = model.stages()
    depth = depth or model.exit_depth.numel()
    outs = []
    for s, stage in enumerate(stages[:depth]):
        x = stage(x)
        outs.append(model.final_exit(x) if s == len(stages) - 1 else model.exit_heads[s](x))
    z = torch.stack(outs)
    if all_exits:
        return z
    return z.mean(0) if model.exit_predict == "ensemble" else z[-1]


def depth_names(model: nn.Module, depth: int) -> set[str]:
    """Prefixes of the parameters and buffers a depth-`depth` network holds: its stages, the exits after them
    (the model's own classifier only at full depth)."""
    stages = model.stage_prefixes()
    names = {p for s in range(depth) for p in stages[s]}
    names |= {f"exit_heads.{s}." for s in range(min(depth, len(stages) - 1))}
    if depth == len(stages):
        names |= set(model.final_prefixes())
    return names
