"""Plain eager TorchServe handler for all-MiniLM-L6-v2 embeddings: a comparison baseline, not product code.

Why it exists: benchmarks/e2e.py measures pt2-handlers against what a TorchServe user writes without it,
modelled on TorchServe's Hugging Face example (examples/Huggingface_Transformers): AutoModel + AutoTokenizer
from the archive, fp32 eager, every batch padded to a fixed max_length. No compile, no ladder, no parity
checks, no input validation beyond what is needed to answer.

Body: raw text or JSON ``{"text": "..."}``; answer: ``{"embedding": [...]}`` (mean pooled, L2 normalised).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from ts.torch_handler.base_handler import BaseHandler

logger = logging.getLogger(__name__)

MAX_LENGTH = 128


class BaselineEmbeddingHandler(BaseHandler):
    """fp32 eager MiniLM; the archive's ``model/`` dir holds the save_pretrained files."""

    def initialize(self, context: Any) -> None:
        model_dir = Path(context.system_properties["model_dir"]) / "model"
        self.device = torch.device("cpu")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                                            dtype=torch.float32).eval()
        logger.info("baseline loaded %s: fp32 eager, %d torch threads", model_dir, torch.get_num_threads())
        self.initialized = True

    def preprocess(self, data: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [_text(row.get("data") or row.get("body")) for row in data]
        return self.tokenizer(texts, padding="max_length", max_length=MAX_LENGTH, truncation=True,
                              return_tensors="pt")

    def inference(self, data: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model(**data).last_hidden_state
            mask = data["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    def postprocess(self, data: torch.Tensor) -> list[dict[str, list[float]]]:
        return [{"embedding": row} for row in data.tolist()]


def _text(body: Any) -> str:
    """The text of one request: a JSON ``{"text": ...}`` object, else the body itself as UTF-8 text."""
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return body
    if isinstance(body, dict):
        return str(body["text"])
    return str(body)
