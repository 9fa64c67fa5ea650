"""A small model of one's own, as torch-model-archiver's --model-file packs it: one nn.Module class, built without
arguments. It scores a candidate from 16 features (docs/tasks/your-own.md)."""

import torch


class Ranker(torch.nn.Module):
    def __init__(self, features: int = 16):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def forward(self, x):
        return self.body(x).squeeze(-1)
