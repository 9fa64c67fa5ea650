"""A task of one's own: scores a request's candidates with the Ranker (model.py beside it) and answers them ranked,
best first (docs/tasks/your-own.md)."""

from typing import Any

import torch

from handlers.errors import InvalidInput
from handlers.tasks.base import Encoded, Task

FEATURES = 16


class RankingTask(Task):
    """Candidates' feature vectors in, their indexes ranked by score out."""

    def parse(self, body: Any) -> list[list[float]]:
        candidates = body.get("candidates") if isinstance(body, dict) else None
        if not isinstance(candidates, list) or not candidates:
            raise InvalidInput('send {"candidates": [[16 numbers], ...]}')
        if any(not isinstance(row, list) or len(row) != FEATURES for row in candidates):
            raise InvalidInput(f"each candidate is a list of {FEATURES} numbers")
        return candidates

    def preprocess(self, requests: list[list[list[float]]]) -> Encoded:
        rows = [row for candidates in requests for row in candidates]
        return Encoded({"x": torch.tensor(rows, dtype=torch.float32)}, [len(candidates) for candidates in requests])

    def postprocess(self, outputs: torch.Tensor, encoded: Encoded, requests: list[Any]) -> list[Any]:
        answers = []
        for scores in outputs.float().split(encoded.extras):
            order = scores.argsort(descending=True)
            answers.append([{"index": int(i), "score": round(float(scores[i]), 6)} for i in order])
        return answers

    def warmup_batches(self, shapes: list[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(0)
        return [{"x": torch.randn(batch, FEATURES, generator=generator)} for batch, _ in shapes]
