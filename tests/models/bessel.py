"""A model OpenVINO cannot convert: a Bessel function, which its PyTorch frontend has no conversion for."""

import torch


class Bessel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.linear(torch.special.bessel_j0(x))
