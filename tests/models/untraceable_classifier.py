"""An image classifier dynamo cannot trace whole: its forward enters a context manager dynamo does not know."""

import os

import torch


class UntraceableClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, stride=4)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        with open(os.devnull) as sink:  # dynamo cannot enter a file's context manager
            del sink
            return self.head(self.conv(x).mean(dim=(2, 3)))
