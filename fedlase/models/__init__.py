"""Model zoo; the built-ins register themselves in fedlase.registry here. Every image model exposes
`channel_groups()` so structured (width-slice) methods can cut it."""
from torch import nn

from ..config import BN_MODES
from ..registry import METHODS, register_model
from .cnn import SmallCNN
from .lenet import LeNet5
from .resnet import ResNet18

IMAGE_MODELS = {"cnn": SmallCNN, "resnet18": ResNet18, "lenet": LeNet5}


def build_model(name: str, in_channels: int, num_classes: int, width: float = 1.0, bn: str = "batch",
                image_size: int = 28) -> nn.Module:
    return IMAGE_MODELS[name](in_channels=in_channels, num_classes=num_classes, width=width, bn=bn,
                              image_size=image_size)


def _builder(name: str):
    def build(cfg, data):   # the run's method may add parts of its own (DepthFL's exits; Method.prepare_model)
        model = build_model(name, data.in_channels, data.num_classes, cfg.width, cfg.bn, data.image_size)
        return METHODS.get(cfg.method).prepare_model_for(model, cfg.method_args, cfg.levels)
    return build


register_model("cnn", _builder("cnn"), "image", "small CNN for 28x28 images, first and last layers fit 1/64")
register_model("resnet18", _builder("resnet18"), "image", "the CIFAR ResNet-18 of FIARSE's code")
register_model("lenet", _builder("lenet"), "image", "LeNet-5 of RecipFL's MNIST setting (44k parameters on 28x28)")

__all__ = ["IMAGE_MODELS", "BN_MODES", "build_model", "LeNet5", "SmallCNN", "ResNet18"]
