"""ResNets for small grayscale images (FashionMNIST-sized, 1x28x28), written out so the demo
needs nothing beyond torch.

The stem is a 3x3 stride-1 convolution without max-pooling (the CIFAR variant): on 28x28
inputs ImageNet's 7x7/2 stem plus pooling would leave 7x7 maps before the first block.
Stages run at 28, 14, 7 and 4 pixels. ``width`` is the channel count of the first stage
(64 in the original networks); the demo uses a narrow one so CPUs train it in minutes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet10", "resnet18", "resnet50", "build_model"]


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet-18/34).

    >>> block = BasicBlock(16, 32, stride=2)
    >>> block(torch.randn(2, 16, 28, 28)).shape
    torch.Size([2, 32, 14, 14])
    """

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_channels, channels, stride)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = _shortcut(in_channels, channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual connection (ResNet-50/101/152).

    >>> block = Bottleneck(64, 16)
    >>> block(torch.randn(2, 64, 7, 7)).shape
    torch.Size([2, 64, 7, 7])
    """

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet for small images: 3x3 stem, four stages, global average pooling, linear head.

    >>> model = ResNet(BasicBlock, [2, 2, 2, 2], width=16)
    >>> model(torch.randn(4, 1, 28, 28)).shape
    torch.Size([4, 10])
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks_per_stage: list[int],
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 64,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages = []
        channels_in = width
        for index, count in enumerate(blocks_per_stage):
            channels = width * 2**index
            stride = 1 if index == 0 else 2
            blocks = []
            for _ in range(count):
                blocks.append(block(channels_in, channels, stride))
                channels_in = channels * block.expansion
                stride = 1
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels_in, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        # Zero-init the last BN of each residual branch: every block starts as the identity,
        # which makes the first epochs stable (Goyal et al., "Accurate, Large Minibatch SGD").
        for module in self.modules():
            if isinstance(module, BasicBlock):
                nn.init.zeros_(module.bn2.weight)
            elif isinstance(module, Bottleneck):
                nn.init.zeros_(module.bn3.weight)

    def forward(self, x: Tensor) -> Tensor:
        features = self.stages(self.stem(x))
        return self.head(torch.flatten(features.mean(dim=(2, 3)), 1))


def resnet10(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> ResNet:
    """ResNet-18's layout with one BasicBlock per stage instead of two: half its convolutions,
    for CPUs whose half-precision convolutions are slow (the demo's budget picks it there).

    >>> resnet10(width=8)(torch.randn(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes, in_channels, width)


def resnet18(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> ResNet:
    """ResNet-18 layout (BasicBlock x [2, 2, 2, 2]) for small images.

    >>> resnet18(width=8)(torch.randn(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, width)


def resnet50(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> ResNet:
    """ResNet-50 layout (Bottleneck x [3, 4, 6, 3]) for small images.

    >>> resnet50(width=8)(torch.randn(2, 1, 28, 28)).shape
    torch.Size([2, 10])
    """
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, in_channels, width)


MODELS: dict[str, Callable[..., ResNet]] = {"resnet10": resnet10, "resnet18": resnet18, "resnet50": resnet50}


def build_model(name: str, num_classes: int = 10, in_channels: int = 1, width: int = 64) -> ResNet:
    """The model called ``name`` (a key of :data:`MODELS`).

    >>> build_model("resnet18", width=8).head.out_features
    10
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](num_classes=num_classes, in_channels=in_channels, width=width)
