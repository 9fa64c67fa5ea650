"""Load a Hugging Face ``save_pretrained`` directory: local files only, safetensors only."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from handlers.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Tokenizers report this (or larger) when they know no limit.
UNBOUNDED_TOKENIZER_LENGTH = 1_000_000


def load_pretrained(model_dir: Path, model_class: Any, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)``; the model in eval mode on ``device``."""
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a save_pretrained directory (no config.json)")
    if not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(
            f"{model_dir} has no .safetensors weights; pt2-handlers loads safetensors only "
            "(re-save with model.save_pretrained(dir), which writes safetensors by default)"
        )
    started = time.perf_counter()
    try:
        model = model_class.from_pretrained(model_dir, local_files_only=True, use_safetensors=True, dtype=dtype)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model_dir}: {exc}") from exc
    model = model.to(device).eval()
    seconds = time.perf_counter() - started
    logger.info("loaded %s (%s) from %s in %.1fs", type(model).__name__, dtype, model_dir, seconds)
    return model, tokenizer


def resolve_max_length(model_dir: Path, model: Any, tokenizer: Any, requested: int | None) -> int:
    """The configured length, else sentence-transformers' max_seq_length, else the tokenizer's, capped by the model."""
    limit = getattr(model.config, "max_position_embeddings", None) or UNBOUNDED_TOKENIZER_LENGTH
    if requested is not None:
        if requested > limit:
            raise ModelLoadError(f"pt2_handlers.max_length {requested} exceeds the model's {limit} positions")
        return requested
    sbert = model_dir / "sentence_bert_config.json"
    if sbert.is_file():
        length = json.loads(sbert.read_text()).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            return min(length, limit)
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and 0 < length < UNBOUNDED_TOKENIZER_LENGTH:
        return min(length, limit)
    return min(512, limit)
