"""Model zoo. Every model exposes `channel_groups()` so structured (width-slice) methods can cut it."""
from torch import nn

from .cnn import SmallCNN
from .resnet import BN_MODES, ResNet18

MODELS = {"cnn": SmallCNN, "resnet18": ResNet18}


def build_model(name: str, in_channels: int, num_classes: int, width: float = 1.0, bn: str = "batch",
                image_size: int = 28) -> nn.Module:
    return MODELS[name](in_channels=in_channels, num_classes=num_classes, width=width, bn=bn, image_size=image_size)


__all__ = ["MODELS", "BN_MODES", "build_model", "SmallCNN", "ResNet18"]
