"""A small CNN for 28x28 (or any small) images that trains in seconds a round on a CPU."""
import torch
from torch import nn

from .exits import exits_forward
from .resnet import make_bn


class SmallCNN(nn.Module):
    """Four conv blocks (conv3x3 -> BN -> ReLU) with widths c, 2c, 4c, 8c, max-pooled after the first two,
    then global average pooling and one linear classifier. On 28x28 inputs the first conv has stride 2, so
    the maps are 14, 7, 3, 3 pixels: about 4.3M multiply-adds an image.

    The last conv block holds most of the parameters while running on a 3x3 map, so the model is cheap to
    train yet its first and last layers are a small share of it (FedLASE keeps those two layers whole and
    pays for them from the smallest client's budget: 2.9k of 390k parameters, under 1/64 of the model).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0, bn: str = "batch",
                 image_size: int = 28):
        super().__init__()
        chans = [max(1, round(c * width)) for c in (32, 64, 128, 256)]
        layers, prev = [], in_channels
        for i, c in enumerate(chans):
            stride = 2 if i == 0 and image_size >= 24 else 1
            layers += [nn.Conv2d(prev, c, 3, stride, padding=1, bias=False), make_bn(c, bn), nn.ReLU(inplace=True)]
            if i < 2:
                layers.append(nn.MaxPool2d(2))
            prev = c
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(prev, num_classes)
        self.chans, self.num_classes, self.bn_mode = chans, num_classes, bn
        self.input_shape = (in_channels, image_size, image_size)   # one sample's (C, H, W)
        self.exit_heads = None   # DepthFL's exits, once attached (fedlase/models/exits.py)

    # every shape comes from the tensors (global pooling feeds the classifier): a width slice can train as
    # the gathered smaller tensors on this same module
    sliceable = True

    def forward(self, x: torch.Tensor, depth: int | None = None, all_exits: bool = False) -> torch.Tensor:
        if self.exit_heads is not None:   # a depth-scaled network with exits (DepthFL)
            return exits_forward(self, x, depth, all_exits)
        x = self.features(x)                          # (B, 8c, h, w)
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    # ---- exits (fedlase/models/exits.py): a stage is one conv block, with its max-pool ----------------------
    def _stage_bounds(self) -> list[tuple[int, int]]:
        starts = [i for i, m in enumerate(self.features) if isinstance(m, nn.Conv2d)]
        return list(zip(starts, starts[1:] + [len(self.features)]))

    def stages(self) -> list:
        return [self.features[a:b] for a, b in self._stage_bounds()]

    def stage_widths(self) -> list[int]:
        return list(self.chans)

    def stage_prefixes(self) -> list[list[str]]:
        return [[f"features.{i}." for i in range(a, b)] for a, b in self._stage_bounds()]

    def final_exit(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    def final_prefixes(self) -> list[str]:
        return ["classifier."]

    def norm(self, channels: int) -> nn.BatchNorm2d:
        """A BN layer of this model's mode (the exit heads')."""
        return make_bn(channels, self.bn_mode)

    def scaler_names(self) -> list[str]:
        """The parameters of the layers whose outputs HeteroFL's scaler multiplies (every conv, before its BN,
        as the official code): a method folds the factor into them (fedlase/methods/heterofl.py)."""
        return [f"features.{i}.{p}" for i, m in enumerate(self.features) if isinstance(m, nn.Conv2d)
                for p, _ in m.named_parameters()]

    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Parameter name -> (output channel group, input channel group) for width slicing.

        Group None means "never sliced" (the image channels, the classes)."""
        groups, prev, idx = {}, None, 0
        for name, mod in self.features.named_children():
            if isinstance(mod, nn.Conv2d):
                group = f"block{idx}"
                groups[f"features.{name}.weight"] = (group, prev)
                prev, idx = group, idx + 1
            elif isinstance(mod, nn.BatchNorm2d):
                groups[f"features.{name}.weight"] = (prev, None)
                groups[f"features.{name}.bias"] = (prev, None)
        groups["classifier.weight"] = (None, prev)
        groups["classifier.bias"] = (None, None)
        return groups
