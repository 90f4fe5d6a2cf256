"""A BiT-style ResNet: pre-activation bottleneck ResNet v2, as in Big Transfer (Kolesnikov et
al., 2020), but with BatchNorm2d in place of GroupNorm + weight standardisation, so the model
keeps BatchNorm running statistics (buffers updated in place during training).

Plain PyTorch (no torchvision). `bit_resnet(depth, width)` gives BiT-R{depth}x{width};
`blocks=` and `base_channels=` override the stage depths and widths for tiny test models.
"""

from __future__ import annotations

import torch
from torch import nn

# Bottleneck units per stage, as in BiT (and ResNet v1/v2).
STAGE_BLOCKS: dict[int, tuple[int, ...]] = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}

# A bottleneck's output has this many times its middle (3x3 conv) channels.
EXPANSION = 4


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """A 3x3 convolution with padding 1 and no bias (a BatchNorm follows)."""
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """A 1x1 convolution with no bias."""
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class PreActBottleneck(nn.Module):
    """A pre-activation bottleneck unit: (BN, ReLU, conv) x 3 plus an identity/projection skip.

    As in BiT, the projection shortcut (when the shape changes) is taken from the pre-activated
    input, and the stride sits on the 3x3 convolution.
    """

    def __init__(self, cin: int, cout: int, cmid: int, stride: int = 1) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.conv1 = conv1x1(cin, cmid)
        self.norm2 = nn.BatchNorm2d(cmid)
        self.conv2 = conv3x3(cmid, cmid, stride)
        self.norm3 = nn.BatchNorm2d(cmid)
        self.conv3 = conv1x1(cmid, cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = (
            conv1x1(cin, cout, stride) if stride != 1 or cin != cout else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the unit to an NCHW tensor."""
        out = self.relu(self.norm1(x))
        residual = self.downsample(out) if self.downsample is not None else x
        out = self.conv1(out)
        out = self.conv2(self.relu(self.norm2(out)))
        out = self.conv3(self.relu(self.norm3(out)))
        return out + residual


class ResNetStage(nn.Module):
    """A stage of bottleneck units; the first one changes channels and (maybe) resolution."""

    def __init__(self, cin: int, cout: int, cmid: int, num_blocks: int, stride: int) -> None:
        super().__init__()
        units = [PreActBottleneck(cin, cout, cmid, stride)]
        units += [PreActBottleneck(cout, cout, cmid) for _ in range(num_blocks - 1)]
        self.units = nn.Sequential(*units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the stage's units in order."""
        return self.units(x)


class BiTResNet(nn.Module):
    """BiT ResNet v2 with BatchNorm: root (7x7/2 conv, 3x3/2 max pool), stages, head.

    The head is BN, ReLU, global average pooling and a linear classifier. (BiT zero-initialises
    the classifier for fine-tuning; here it keeps PyTorch's default initialisation, so gradients
    reach the whole network from the first step.)
    """

    def __init__(
        self,
        blocks: tuple[int, ...],
        width: int = 1,
        num_classes: int = 1000,
        base_channels: int = 64,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if not blocks or any(b < 1 for b in blocks):
            raise ValueError(f"blocks must be a non-empty tuple of positive counts, got {blocks}")
        root = base_channels * width
        self.root = nn.Sequential(
            nn.Conv2d(in_channels, root, kernel_size=7, stride=2, padding=3, bias=False),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        cin = root
        for i, n in enumerate(blocks):
            cmid = base_channels * width * 2**i
            cout = cmid * EXPANSION
            stages.append(ResNetStage(cin, cout, cmid, n, stride=1 if i == 0 else 2))
            cin = cout
        self.body = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cin, num_classes)
        self.num_features = cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map an NCHW image batch to (N, num_classes) logits."""
        x = self.body(self.root(x))
        x = self.pool(self.relu(self.norm(x)))
        return self.head(torch.flatten(x, 1))


def bit_resnet(
    depth: int = 50,
    width: int = 1,
    num_classes: int = 1000,
    *,
    blocks: tuple[int, ...] | None = None,
    base_channels: int = 64,
) -> nn.Module:
    """Build BiT-R{depth}x{width} with BatchNorm (depth 50, 101 or 152; width 1 to 8).

    `blocks` overrides the per-stage bottleneck counts (then `depth` is not used), and
    `base_channels` the root width (64 in BiT); e.g. `bit_resnet(blocks=(1, 1),
    base_channels=8, num_classes=10)` is a tiny net for 16x16 images on a CPU.
    """
    if blocks is None:
        if depth not in STAGE_BLOCKS:
            raise ValueError(f"depth must be one of {sorted(STAGE_BLOCKS)}, got {depth}")
        blocks = STAGE_BLOCKS[depth]
    if not 1 <= width <= 8:
        raise ValueError(f"width must be in 1..8, got {width}")
    if base_channels < 1 or num_classes < 1:
        raise ValueError(
            f"base_channels and num_classes must be positive, got {base_channels}, {num_classes}"
        )
    return BiTResNet(tuple(blocks), width=width, num_classes=num_classes,
                     base_channels=base_channels)


__all__ = ["BiTResNet", "PreActBottleneck", "ResNetStage", "STAGE_BLOCKS", "bit_resnet"]
