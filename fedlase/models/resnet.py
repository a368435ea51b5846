"""The CIFAR-style ResNet-18 of the FIARSE code: 3x3 stem (stride 1, no max-pool), BasicBlocks [2,2,2,2],
widths 64/128/256/512 times a multiplier, 1x1 conv + BN shortcuts, global average pool, one linear layer.
All convolutions are bias-free."""
import torch
from torch import nn

from .exits import exits_forward


def make_bn(channels: int, mode: str) -> nn.BatchNorm2d:
    """`batch`: batch statistics in training and test, no running stats (as FIARSE).
    `static`: running stats, recomputed on training data before evaluation (HeteroFL's sBN)."""
    if mode == "batch":
        return nn.BatchNorm2d(channels, track_running_stats=False)
    # momentum=None: a cumulative average, so a recompute pass gives the exact mean over its batches
    return nn.BatchNorm2d(channels, momentum=None)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, bn: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = make_bn(cout, bn)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = make_bn(cout, bn)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), make_bn(cout, bn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x
        if len(self.shortcut):
            short = self.shortcut[1](self.shortcut[0](x))
        return torch.relu(out + short)


class ResNet18(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: float = 1.0, bn: str = "batch",
                 image_size: int = 32):
        super().__init__()
        w = [max(1, round(c * width)) for c in (64, 128, 256, 512)]
        self.conv1 = nn.Conv2d(in_channels, w[0], 3, 1, 1, bias=False)
        self.bn1 = make_bn(w[0], bn)
        stages, cin = [], w[0]
        for i, cout in enumerate(w):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride, bn), BasicBlock(cout, cout, 1, bn)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(w[3], num_classes)
        self.widths, self.num_classes, self.bn_mode = w, num_classes, bn
        self.input_shape = (in_channels, image_size, image_size)   # one sample's (C, H, W)
        self.exit_heads = None   # DepthFL's exits, once attached (fedlase/models/exits.py)

    # every shape comes from the tensors (residual adds within one channel group, global pooling feeds the
    # classifier): a width slice can train as the gathered smaller tensors on this same module
    sliceable = True

    def forward(self, x: torch.Tensor, depth: int | None = None, all_exits: bool = False) -> torch.Tensor:
        if self.exit_heads is not None:   # a depth-scaled network with exits (DepthFL)
            return exits_forward(self, x, depth, all_exits)
        out = torch.relu(self.bn1(self.conv1(x)))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                out = block(out)                                         # last: (B, 8w, H/8, W/8)
        return self.linear(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))

    # ---- exits (fedlase/models/exits.py): stage 1 is the stem and layer1, stages 2-4 are layer2-layer4 ----------
    def stages(self) -> list:
        return [lambda x: self.layer1(torch.relu(self.bn1(self.conv1(x)))), self.layer2, self.layer3, self.layer4]

    def stage_widths(self) -> list[int]:
        return list(self.widths)

    def stage_prefixes(self) -> list[list[str]]:
        return [["conv1.", "bn1.", "layer1."], ["layer2."], ["layer3."], ["layer4."]]

    def final_exit(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    def final_prefixes(self) -> list[str]:
        return ["linear."]

    def norm(self, channels: int) -> nn.BatchNorm2d:
        """A BN layer of this model's mode (the exit heads')."""
        return make_bn(channels, self.bn_mode)

    def scaler_names(self) -> list[str]:
        """The parameters of the layers whose outputs HeteroFL's scaler multiplies: every conv (stem, block
        convs, shortcut convs; bias-free), before its BN as in the official code."""
        return [f"{n}.{p}" for n, m in self.named_modules() if isinstance(m, nn.Conv2d)
                for p, _ in m.named_parameters()]

    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Parameter name -> (output group, input group). A residual stage shares one group across its
        blocks' outputs and shortcut (they are added); the inner conv of each block has its own group."""
        g = {"conv1.weight": ("stage0", None), "bn1.weight": ("stage0", None), "bn1.bias": ("stage0", None)}
        prev = "stage0"
        for s in range(1, 5):
            out = f"stage{s}"
            for b in range(2):
                p, inner = f"layer{s}.{b}", f"stage{s}.{b}.inner"
                cin = prev if b == 0 else out
                g[f"{p}.conv1.weight"] = (inner, cin)
                g[f"{p}.bn1.weight"] = g[f"{p}.bn1.bias"] = (inner, None)
                g[f"{p}.conv2.weight"] = (out, inner)
                g[f"{p}.bn2.weight"] = g[f"{p}.bn2.bias"] = (out, None)
                if b == 0 and s > 1:
                    g[f"{p}.shortcut.0.weight"] = (out, prev)
                    g[f"{p}.shortcut.1.weight"] = g[f"{p}.shortcut.1.bias"] = (out, None)
            prev = out
        # stage1's first block has an identity shortcut, so stage1 must share stage0's channels
        g = {k: tuple("stage0" if x == "stage1" else x for x in v) for k, v in g.items()}
        g["linear.weight"] = (None, "stage0" if prev == "stage1" else prev)
        g["linear.bias"] = (None, None)
        return g
