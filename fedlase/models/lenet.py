"""LeNet-5 as RecipFL's MNIST setting builds it (two conv blocks conv5x5 -> BN -> ReLU -> 2x2 average pool,
then fully connected layers), and its slim David variant.

On 28x28 inputs the full model has 44,470 parameters: conv 1->6 and 6->16, fc 256->120, fc 120->84, classifier
84->10. The slim model (RecipFL's depth-and-width scaled LeNet-5, 5,593 parameters) keeps the first block, cuts the
second conv to 3 channels and drops the 120-unit layer: fc 48->84, classifier 84->10. Both end in an 84-value
feature, which RecipFL's distillation compares."""
from __future__ import annotations

import torch
from torch import nn

from .resnet import make_bn


class LeNet5(nn.Module):
    """LeNet-5 (`slim=False`) or its slim variant (`slim=True`). `width` scales every hidden layer (rounded, at
    least 1); the classifier keeps the classes."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: float = 1.0, bn: str = "batch",
                 image_size: int = 28, slim: bool = False):
        super().__init__()
        c1, c2 = (max(1, round(c * width)) for c in ((6, 3) if slim else (6, 16)))
        # two 5x5 convs, each followed by a 2x2 pool: unpadded as RecipFL's (28 -> 24 -> 12 -> 8 -> 4); on images
        # under 16 pixels (the tests' 8x8 digits) padded by 2, so that they keep a 2x2 map
        pad = 0 if image_size >= 16 else 2
        side = ((image_size + 2 * pad - 4) // 2 + 2 * pad - 4) // 2
        if side < 1:
            raise ValueError(f"LeNet-5 needs images of at least 4x4 pixels, got {image_size}")
        self.layer1 = nn.Sequential(nn.Conv2d(in_channels, c1, 5, padding=pad), make_bn(c1, bn), nn.ReLU(),
                                    nn.AvgPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(c1, c2, 5, padding=pad), make_bn(c2, bn), nn.ReLU(), nn.AvgPool2d(2))
        hidden = [max(1, round(h * width)) for h in ((84,) if slim else (120, 84))]
        dims = [c2 * side * side, *hidden]
        # fc (and fc1 in the full model): named as in RecipFL's code, so the two models' names line up
        self.fc = nn.Linear(dims[0], dims[1])
        self.fc1 = nn.Linear(dims[1], dims[2]) if not slim else None
        self.classifier = nn.Linear(dims[-1], num_classes)
        self.slim, self.width, self.bn_mode, self.side = slim, width, bn, side
        self.in_channels, self.num_classes, self.image_size = in_channels, num_classes, image_size
        self.input_shape = (in_channels, image_size, image_size)

    # every shape comes from the tensors (the flatten reads the kept channels' positions): a width slice trains
    # as the gathered smaller tensors on this same module
    sliceable = True

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden layer's output (84 values in both variants): what distillation compares."""
        x = torch.flatten(self.layer2(self.layer1(x)), 1)
        x = torch.relu(self.fc(x))
        return torch.relu(self.fc1(x)) if self.fc1 is not None else x

    def forward(self, x: torch.Tensor, with_features: bool = False):
        """The logits; with `with_features`, (the last hidden features, the logits)."""
        feat = self.features(x)
        return (feat, self.classifier(feat)) if with_features else self.classifier(feat)

    def twin(self) -> LeNet5:
        """The slim variant with this model's input, classes, width and BN mode (RecipFL's David model)."""
        return LeNet5(self.in_channels, self.num_classes, self.width, self.bn_mode, self.image_size, slim=True)

    # ---- width slicing (HeteroFL, FedRolex, FedAvg-small on LeNet) -------------------------------------------
    def channel_groups(self) -> dict[str, tuple[str | None, str | None]]:
        """Parameter name -> (output group, input group). The flatten turns each of layer2's channels into
        side*side consecutive inputs of fc: that input group is cut in units of side*side (`group_units`), so
        its window keeps exactly the kept channels' positions."""
        groups = {"layer1.0.weight": ("conv1", None), "layer1.0.bias": ("conv1", None),
                  "layer1.1.weight": ("conv1", None), "layer1.1.bias": ("conv1", None),
                  "layer2.0.weight": ("conv2", "conv1"), "layer2.0.bias": ("conv2", None),
                  "layer2.1.weight": ("conv2", None), "layer2.1.bias": ("conv2", None),
                  "fc.weight": ("fc", "conv2_flat"), "fc.bias": ("fc", None)}
        last = "fc"
        if self.fc1 is not None:
            groups.update({"fc1.weight": ("fc1", "fc"), "fc1.bias": ("fc1", None)})
            last = "fc1"
        groups["classifier.weight"] = (None, last)
        groups["classifier.bias"] = (None, None)
        return groups

    def group_units(self) -> dict[str, int]:
        return {"conv2_flat": self.side * self.side}

    def scaler_names(self) -> list[str]:
        """The layers whose outputs HeteroFL's scaler multiplies: the convs, before their BN (as on the CNN)."""
        return ["layer1.0.weight", "layer1.0.bias", "layer2.0.weight", "layer2.0.bias"]
