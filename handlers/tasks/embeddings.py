"""Sentence embeddings as sentence-transformers computes them for the model: its pooling (the mean over the attention
mask for all-MiniLM, the CLS token for BGE, ...) and its L2 normalisation, read from the model directory
(handlers/tasks/pooling.py).

Accepted bodies, each answered in the shape its clients expect:

* raw text, or ``{"text": "..."}``            -> ``{"embedding": [...]}``
* ``{"inputs": "..." | ["...", ...]}``         -> ``{"embeddings": [[...], ...]}``
* ``{"input": "..." | ["...", ...]}`` (OpenAI) -> ``{"object": "list", "data": [...], "model", "usage"}``, each
  embedding a list of floats or, with ``"encoding_format": "base64"`` (what the OpenAI SDK sends unless told
  otherwise), the base64 of its float32 bytes, little-endian, as OpenAI's API answers
"""

from __future__ import annotations

import base64
import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from handlers.config import DType, TooLong
from handlers.errors import InvalidInput
from handlers.ladder import QualityError, QualityGate, tensors
from handlers.tasks import open_inference, pooling
from handlers.tasks.base import Encoded, gate_threshold
from handlers.tasks.text import TextTask

logger = logging.getLogger(__name__)

# Keys OpenAI clients send beside "input"; only what changes the answer is checked.
OPENAI_EXTRA_KEYS = frozenset({"model", "encoding_format", "user"})
ENCODING_FORMATS = ("float", "base64")  # OpenAI's two: a list of numbers, or base64 of the float32 bytes


class Style(str, enum.Enum):
    TEXT = "text"
    INPUTS = "inputs"
    OPENAI = "input"


@dataclass(frozen=True)
class EmbeddingRequest:
    texts: tuple[str, ...]
    style: Style
    base64: bool = False  # OpenAI's encoding_format "base64"


class PooledEmbedder(torch.nn.Module):
    """Encoder + the model's pooling (+ its L2 norm), so compile and the quality gate cover what clients receive."""

    def __init__(self, encoder: torch.nn.Module, pooled: pooling.Pooling = pooling.MEAN_NORMALIZED):
        super().__init__()
        self.encoder = encoder
        self.pooling = pooled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        return self.pooling(hidden, attention_mask)


class CosineGate(QualityGate):
    """The smallest cosine similarity between a served embedding and fp32 eager's, over all rows."""

    metric = "min_cosine"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def measure(self, actual: Any, expected: Any) -> float:
        (got,), (want,) = list(tensors(actual)), list(tensors(expected))
        if got.shape != want.shape:
            raise QualityError(f"embeddings have shape {tuple(got.shape)}, fp32 eager {tuple(want.shape)}")
        cosine = torch.nn.functional.cosine_similarity(got.detach().float().cpu(), want.float().cpu(), dim=-1)
        return cosine.nan_to_num(-1.0).min().item()




class EmbeddingsTask(TextTask):
    name = "embeddings"
    open_inference_output = "embedding"
    row_outputs = True  # one pooled vector per text
    encodes_texts = True
    model_class = transformers.AutoModel
    default_too_long = TooLong.TRUNCATE  # as sentence-transformers encodes
    paths = ("v1/embeddings", "embeddings")  # OpenAI clients with base_url .../<version>/v1 (or .../<version>)

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> CosineGate:
        """``min_cosine`` applies to fp32 rungs, ``min_cosine_half`` to bf16/fp16 ones, ``min_cosine_int8`` to
        int8 ones."""
        return CosineGate(gate_threshold(dtype, overrides, cls.facts().gate))

    def __init__(self, *args: Any, model_dir: Path | None = None, **kwargs: Any):
        super().__init__(*args, model_dir=model_dir, **kwargs)
        self.pooling = pooling.read(model_dir) if model_dir is not None else pooling.MEAN_NORMALIZED
        logger.info("embeddings: pooling %s", self.pooling.summary())

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return PooledEmbedder(model, self.pooling).eval()

    def describe_outputs(self) -> dict[str, Any]:
        return {"pooling": self.pooling.describe()}

    def parse(self, body: Any) -> EmbeddingRequest:
        if isinstance(body, str):
            return EmbeddingRequest(self.texts_of(body, "the text"), Style.TEXT)
        if isinstance(body, list):
            return EmbeddingRequest(self.texts_of(body, "the body"), Style.INPUTS)
        if not isinstance(body, Mapping):
            raise InvalidInput(f"expected text or a JSON object, got JSON {type(body).__name__}")
        present = [style for style in Style if style.value in body]
        if len(present) != 1:
            raise InvalidInput('send exactly one of "text", "inputs" or "input" in the JSON object')
        style = present[0]
        allowed = {style.value} | (OPENAI_EXTRA_KEYS if style is Style.OPENAI else set())
        unknown = sorted(str(key) for key in body if key not in allowed)
        if unknown:
            raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; allowed here: {', '.join(sorted(allowed))}")
        encoding = body.get("encoding_format", "float") if style is Style.OPENAI else "float"
        if encoding not in ENCODING_FORMATS:
            raise InvalidInput(f"encoding_format {encoding!r} is not supported; use \"float\" or \"base64\"")
        value = body[style.value]
        if style is Style.TEXT and not isinstance(value, str):
            raise InvalidInput(f'"text" must be a string, got {type(value).__name__}; send a list as "inputs"')
        return EmbeddingRequest(self.texts_of(value, f'"{style.value}"'), style, base64=encoding == "base64")

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        return open_inference.to_tensors(self.open_inference_output, answer["embeddings"])  # FP32 [n, dim]

    def preprocess(self, requests: Sequence[EmbeddingRequest]) -> Encoded:
        return Encoded(self.encode([text for request in requests for text in request.texts]))

    def postprocess(
        self, outputs: torch.Tensor, encoded: Encoded, requests: Sequence[EmbeddingRequest]
    ) -> list[dict[str, Any]]:
        rows = outputs.float().cpu()
        vectors = [] if all(request.base64 for request in requests) else rows.tolist()
        tokens = encoded.inputs["attention_mask"].sum(dim=1).tolist()
        answers, start = [], 0
        for request in requests:
            end = start + len(request.texts)
            served = _base64_rows(rows[start:end]) if request.base64 else vectors[start:end]
            answers.append(self._answer(request, served, sum(tokens[start:end])))
            start = end
        return answers

    def _answer(self, request: EmbeddingRequest, vectors: list[Any], tokens: int) -> dict[str, Any]:
        """``vectors``: a list of floats for each text, or its base64 string."""
        if request.style is Style.TEXT:
            return {"embedding": vectors[0]}
        if request.style is Style.INPUTS:
            return {"embeddings": vectors}
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _base64_rows(rows: torch.Tensor) -> list[str]:
    """Each row as OpenAI's base64 encoding answers it: its float32 values' bytes, little-endian, in base64 (about a
    quarter of the JSON list's size, and the exact float32 values)."""
    return [base64.b64encode(row.numpy().astype("<f4", copy=False).tobytes()).decode("ascii") for row in rows]
