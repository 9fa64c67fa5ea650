"""MobileNetV2 for ImageNet-1k classification, in plain PyTorch.

This is the architecture of torchvision's ``mobilenet_v2`` with the same module
names, so torchvision's ImageNet state_dict (``mobilenet_v2-b0353104.pth``)
loads as is with ``load_state_dict(..., strict=True)``. It is written out here
so that the serving host needs no torchvision.

Input: float tensor ``[N, 3, 224, 224]``, RGB scaled to [0, 1] and normalized
with mean (0.485, 0.456, 0.406) and std (0.229, 0.224, 0.225).
Output: logits ``[N, 1000]``.

TorchServe loads the one class defined at the top level of this file
(``--model-file model.py``), so the building blocks are functions or nested in
``MobileNetV2``.
"""

import torch
from torch import nn


def _make_divisible(v: float, divisor: int, min_value: int | None = None) -> int:
    """Round ``v`` to the nearest multiple of ``divisor``, never going below 90% of ``v``."""
    if min_value is None:
        min_value = divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _conv_bn_relu6(
    in_channels: int,
    out_channels: int,
    kernel_size: int = 3,
    stride: int = 1,
    groups: int = 1,
) -> nn.Sequential:
    """Conv2d (no bias) -> BatchNorm2d -> ReLU6, named ``0``, ``1``, ``2``."""
    padding = (kernel_size - 1) // 2
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class MobileNetV2(nn.Module):
    class InvertedResidual(nn.Module):
        """Expand (1x1) -> depthwise (3x3) -> project (1x1), with a skip when shapes match."""

        def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
            super().__init__()
            if stride not in (1, 2):
                raise ValueError(f"stride should be 1 or 2, got {stride}")
            hidden_dim = int(round(inp * expand_ratio))
            self.use_res_connect = stride == 1 and inp == oup

            layers: list[nn.Module] = []
            if expand_ratio != 1:
                layers.append(_conv_bn_relu6(inp, hidden_dim, kernel_size=1))
            layers.extend(
                [
                    _conv_bn_relu6(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
                    nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
                    nn.BatchNorm2d(oup),
                ]
            )
            self.conv = nn.Sequential(*layers)
            self.out_channels = oup

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.use_res_connect:
                return x + self.conv(x)
            return self.conv(x)

    def __init__(
        self,
        num_classes: int = 1000,
        width_mult: float = 1.0,
        round_nearest: int = 8,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()
        input_channel = 32
        last_channel = 1280
        # t: expansion factor, c: output channels, n: repeats, s: stride of first repeat
        inverted_residual_setting = [
            [1, 16, 1, 1],
            [6, 24, 2, 2],
            [6, 32, 3, 2],
            [6, 64, 4, 2],
            [6, 96, 3, 1],
            [6, 160, 3, 2],
            [6, 320, 1, 1],
        ]

        input_channel = _make_divisible(input_channel * width_mult, round_nearest)
        self.last_channel = _make_divisible(last_channel * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [_conv_bn_relu6(3, input_channel, stride=2)]
        for t, c, n, s in inverted_residual_setting:
            output_channel = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(self.InvertedResidual(input_channel, output_channel, stride, expand_ratio=t))
                input_channel = output_channel
        features.append(_conv_bn_relu6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)

        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(self.last_channel, num_classes),
        )

        # Same initialization as torchvision (only matters when not loading weights).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)
