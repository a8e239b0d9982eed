"""A small ResNet-style CNN with BatchNorm, and synthetic, learnable images (also used by hf-vit/hf-resnet).

The basic residual block follows He et al. 2015 ("Deep Residual Learning for Image Recognition", the
CIFAR variant: 3x3 stem, stages that double the width and halve the resolution). It is the preset with
BatchNorm, whose running statistics are buffers updated in place on every training forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import teacher

LATENT_GRID = 4
"""Images are a smooth upsampling of a ``(channels, 4, 4)`` latent: the pattern of their class."""


class BasicBlock(nn.Module):
    """conv3x3-bn-relu-conv3x3-bn plus a shortcut (1x1 conv-bn when the shape changes), then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Images ``(b, channels, h, w)`` -> logits ``(b, classes)``.

    ``stages`` stages of ``blocks`` basic blocks; stage ``s`` has ``width * 2**s`` channels and every
    stage after the first halves the resolution. Global average pooling makes any image size work.
    """

    def __init__(
        self,
        channels: int = 3,
        width: int = 16,
        stages: int = 3,
        blocks: int = 2,
        classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers: list[nn.Module] = []
        in_ch = width
        for s in range(stages):
            out_ch = width * 2**s
            for i in range(blocks):
                layers.append(BasicBlock(in_ch, out_ch, stride=2 if s > 0 and i == 0 else 1))
                in_ch = out_ch
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(in_ch, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))  # (b, c, h', w')
        x = self.pool(x).flatten(1)  # (b, c)
        return self.head(self.drop(x))  # (b, classes)


def image_batch(b: int, channels: int, image_size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (default dtype) and labels of the right shapes, for tracing."""
    x = torch.randn(b, channels, image_size, image_size)  # (b, c, h, w)
    y = torch.randint(0, classes, (b,))  # (b,)
    return x, y


def image_item(
    gen: torch.Generator, channels: int, image_size: int, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image of a uniformly drawn class: that class's fixed smooth pattern, jittered, plus noise.

    The pattern of class ``c`` is a bilinear upsampling of a ``(channels, 4, 4)`` latent drawn by the
    teacher (the same for every seed), so the label is readable from the coarse content of the image by
    convolutions and patch embeddings alike, and the training loss of a demo visibly goes down.
    """
    grid = min(LATENT_GRID, image_size)
    label = torch.randint(0, classes, (), generator=gen)  # ()
    pattern = teacher(classes, channels * grid * grid)[int(label)].view(channels, grid, grid)  # (c, g, g)
    latent = pattern + 0.5 * torch.randn(channels, grid, grid, generator=gen, dtype=torch.float32)
    noise = torch.randn(channels, image_size, image_size, generator=gen, dtype=torch.float32)  # (c, h, w)
    image = F.interpolate(latent[None], size=(image_size, image_size), mode="bilinear", align_corners=False)
    image = image[0] + 0.1 * noise  # (c, h, w)
    return image.to(torch.get_default_dtype()), label
