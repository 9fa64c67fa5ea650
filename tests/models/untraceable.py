"""A model dynamo cannot trace whole: its forward enters a context manager dynamo does not know."""

import os

import torch


class Untraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x):
        with open(os.devnull) as sink:  # dynamo cannot enter a file's context manager
            del sink
            return self.linear(x)
