"""ResNet-50 as a ``model.py`` for TorchServe's model.py + state_dict archives: transformers' ResNet, whose default
configuration is ResNet-50 (25.6 M parameters, 4.1 GFLOPs at 224 x 224), returning the logits as torchvision's does.
The benchmarks serve it with random weights (``benchmarks.vision_networks``): compute-bound, and no download."""

import torch
from transformers import ResNetConfig, ResNetForImageClassification


class ResNet50(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = ResNetForImageClassification(ResNetConfig(num_labels=1000))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values).logits
