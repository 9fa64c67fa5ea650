"""Text classification, answered as transformers' ``text-classification`` pipeline answers.

Accepted bodies:

* raw text, or ``{"text": "...", "top_k": k}``      -> ``[{"label": ..., "score": ...}, ...]``
* ``{"inputs": "..." | ["...", ...], "top_k": k}``  -> one such list per text

``top_k``: how many labels, best first (default 1, as the pipeline); ``null`` means all of them.
Scores: softmax over the labels for single-label models, a sigmoid per label for multi-label ones
(``problem_type: multi_label_classification``) or a single logit, as the pipeline decides. Labels come from
the model config's ``id2label``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from handlers.errors import InvalidInput
from handlers.tasks import open_inference
from handlers.tasks.base import Encoded
from handlers.tasks.text import ScoredTask

DEFAULT_TOP_K = 1


@dataclass(frozen=True)
class ClassificationRequest:
    texts: tuple[str, ...]
    top_k: int | None  # None: every label
    many: bool  # "inputs": one list of labels per text


class ScoredClassifier(torch.nn.Module):
    """The classification model plus the pipeline's score function, so the gate judges the scores clients get."""

    def __init__(self, model: torch.nn.Module, multi_label: bool):
        super().__init__()
        self.model = model
        self.multi_label = multi_label

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits.float()
        return logits.sigmoid() if self.multi_label else logits.softmax(dim=-1)


class TextClassificationTask(ScoredTask):
    name = "text-classification"
    open_inference_output = "labels"
    row_outputs = True  # one score row per text
    encodes_texts = True
    model_class = transformers.AutoModelForSequenceClassification
    outputs_are_scores = True  # the module applies the pipeline's softmax / sigmoid itself

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        config = model.config
        self.labels = [config.id2label[index] for index in range(config.num_labels)]
        multi_label = config.problem_type == "multi_label_classification" or config.num_labels == 1
        return ScoredClassifier(model, multi_label).eval()

    def parse(self, body: Any) -> ClassificationRequest:
        if isinstance(body, str):
            return ClassificationRequest(self.texts_of(body, "the text"), DEFAULT_TOP_K, many=False)
        if not isinstance(body, Mapping):
            raise InvalidInput(f"expected text or a JSON object, got JSON {type(body).__name__}")
        present = [key for key in ("text", "inputs") if key in body]
        if len(present) != 1:
            raise InvalidInput('send exactly one of "text" or "inputs" in the JSON object')
        key = present[0]
        unknown = sorted(str(name) for name in body if name not in (key, "top_k"))
        if unknown:
            raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; allowed here: {key}, top_k")
        top_k = self._top_k(body.get("top_k", DEFAULT_TOP_K))
        value = body[key]
        if key == "text" and not isinstance(value, str):
            raise InvalidInput(f'"text" must be a string, got {type(value).__name__}; send a list as "inputs"')
        return ClassificationRequest(self.texts_of(value, f'"{key}"'), top_k, many=key == "inputs")

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        return open_inference.to_tensors(self.open_inference_output, answer, record_lists=True)  # label, score [n, k]

    def _top_k(self, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInput(f'"top_k" must be a positive integer or null (all labels), got {value!r}')
        return value

    def preprocess(self, requests: Sequence[ClassificationRequest]) -> Encoded:
        return Encoded(self.encode([text for request in requests for text in request.texts]))

    def postprocess(self, outputs: torch.Tensor, encoded: Encoded,
                    requests: Sequence[ClassificationRequest]) -> list[Any]:
        scores = outputs.float().cpu()
        answers, start = [], 0
        for request in requests:
            rows = [self._ranked(scores[start + offset], request.top_k) for offset in range(len(request.texts))]
            answers.append(rows if request.many else rows[0])
            start += len(request.texts)
        return answers

    def _ranked(self, row: torch.Tensor, top_k: int | None) -> list[dict[str, Any]]:
        count = len(self.labels) if top_k is None else min(top_k, len(self.labels))
        values, indices = row.topk(count)
        return [{"label": self.labels[index], "score": value}
                for value, index in zip(values.tolist(), indices.tolist(), strict=True)]
