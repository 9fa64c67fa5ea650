"""The text tasks' base: a tokenizer reads each request, the model is a Hugging Face ``save_pretrained`` directory, and
the shape policy pads each batch's sequence to its bucket behind the attention mask.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from handlers.config import DType, TooLong
from handlers.config.shapes import ShapePolicy
from handlers.errors import InvalidInput, ModelLoadError
from handlers.ladder import Calibration
from handlers.models.files import Form
from handlers.models.pretrained import load_pretrained, resolve_max_length
from handlers.tasks import calibration, open_inference
from handlers.tasks.base import WARMUP_WORDS, ScoreGate, Task, TaskSettings, score_gate, softmax_scores
from handlers.tasks.batch_encoder import BatchEncoder


class TextTask(Task, ABC):
    """A task whose requests are text. Subclasses set ``name``, ``model_class`` (a transformers Auto* class) and
    ``default_too_long``, and implement the hooks."""

    model_class: ClassVar[Any]  # a transformers Auto* class
    default_too_long: ClassVar[TooLong] = TooLong.REJECT  # a text past max_length, unless the YAML says
    encodes_texts: ClassVar[bool] = False  # preprocess tokenizes a batch of plain texts through the BatchEncoder
    pads_sequence = True
    reads_tensors = False

    def __init__(self, tokenizer: Any, max_length: int, max_inputs: int, model_name: str,
                 too_long: TooLong | None = None, model_dir: Path | None = None,
                 setup: TaskSettings | None = None):
        """``model_dir``: the save_pretrained directory, for what a task reads there beside the weights and the
        tokenizer (embeddings: its pooling); None reads nothing there."""
        self.setup = setup
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_inputs = max_inputs
        self.model_name = model_name
        self.too_long = too_long or self.default_too_long
        # ~20 ms at load (a copy of the Rust tokenizer), for the tasks whose serving path calls encode()
        self._encoder = BatchEncoder.of(tokenizer, max_length) if self.encodes_texts else None

    @classmethod
    def load(cls, setup: TaskSettings, device: torch.device) -> tuple[Task, torch.nn.Module]:
        """The save_pretrained directory ``pt2_handlers.model_dir`` of the archive: its model and tokenizer."""
        if setup.files.form is not Form.PRETRAINED:
            raise ModelLoadError(f"{cls.name} serves a Hugging Face save_pretrained directory (pt2_handlers.model_dir)"
                                 f", not a {setup.files.form.value} model; serve it with task: tensor or a task of "
                                 "your own")
        settings, root = setup.settings, setup.model_root
        model_dir = (root / settings.model_dir).resolve()
        if not model_dir.is_relative_to(root.resolve()):  # "../x" or a link out of the archive
            raise ModelLoadError(f"pt2_handlers.model_dir {settings.model_dir!r} leads outside the model archive "
                                 f"({root}); name a directory inside it, e.g. model")
        # fp32 first: it is the reference every rung is judged against, and the eager fallback.
        model, tokenizer = load_pretrained(model_dir, cls.model_class, torch.float32, device)
        max_length = resolve_max_length(model_dir, model, tokenizer, settings.max_length)
        return cls(tokenizer, max_length, setup.max_inputs, setup.model_name, settings.too_long, model_dir=model_dir,
                   setup=setup), model

    def fit_shapes(self, shapes: ShapePolicy) -> ShapePolicy:
        return shapes.fitted(self.max_length)

    def calibration(self, shapes: Sequence[tuple[int, int]], warmup: list[Any]) -> Calibration:
        """The archive's calibration file (``pt2_handlers.int8_calibration``), else the warmup batches and a
        seeded sample of the vocabulary's words (handlers/tasks/calibration.py)."""
        relative = self.setup.settings.int8_calibration if self.setup else None
        if relative is None:
            return calibration.held_out_sample(self, shapes, warmup)
        return calibration.from_texts(self, shapes, calibration.read_texts(self.setup.model_root, relative), relative)

    def from_open_inference(self, request: open_inference.InferRequest) -> Any:
        """Text tasks read BYTES inputs only (``from_texts``)."""
        return self.from_texts(request.texts, request.parameters)

    def from_texts(self, texts: Mapping[str, list[str]], parameters: Mapping[str, Any]) -> Any:
        """This task's own body for an Open Inference request's strings: by default the strings of its one BYTES
        input as ``"inputs"``, the request's parameters as options."""
        return open_inference.with_options({"inputs": open_inference.only_input(texts, self.name)}, parameters)

    def describe_inputs(self) -> dict[str, Any]:
        """The input limits a client must respect, for describe."""
        return {"max_length": self.max_length, "too_long": self.too_long.value, "max_per_request": self.max_inputs}

    def texts_of(self, value: Any, where: str) -> tuple[str, ...]:
        """A string or a non-empty list of at most ``max_inputs`` strings, as a tuple, each within the length
        policy; InvalidInput naming ``where`` otherwise."""
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts:
            raise InvalidInput(f"{where} must be a string or a non-empty list of strings")
        if len(texts) > self.max_inputs:
            raise InvalidInput(f"{where} has {len(texts)} texts; at most {self.max_inputs} per request")
        bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if bad is not None:
            raise InvalidInput(f"{where}[{bad}] must be a string, got {type(texts[bad]).__name__}")
        # A client that sends nothing almost always has a bug: answering it (e.g. the embedding of "") hides it.
        blank = next((i for i, text in enumerate(texts) if not text.strip()), None)
        if blank is not None:
            raise InvalidInput(f"{where if isinstance(value, str) else f'{where}[{blank}]'} is empty; send some text")
        if self.too_long is TooLong.REJECT:
            self.check_lengths(texts, where if isinstance(value, str) else f"{where}[{{}}]")
        return tuple(texts)

    def check_lengths(self, texts: Sequence[str], where: str) -> None:
        """InvalidInput for the first text with more than ``max_length`` tokens (special tokens included);
        ``where`` may hold ``{}`` for the text's index."""
        indexes: Sequence[int] = range(len(texts))
        if self._encoder is not None:  # the Rust tokenizer finds the first over-long text; transformers counts it
            first = self._encoder.first_too_long(texts)
            if first is None:
                return
            indexes = [first]
        lengths = self.tokenizer([texts[i] for i in indexes], add_special_tokens=True, return_length=True)["length"]
        for index, length in zip(indexes, lengths, strict=True):
            if length > self.max_length:
                raise InvalidInput(
                    f"{where.format(index)} is {length} tokens long; this model reads at most {self.max_length}. "
                    "Shorten it, or serve the model with pt2_handlers.too_long: truncate")

    @property
    def pad_values(self) -> dict[str, int]:  # type: ignore[override]
        """What each model input is padded with when the shape policy pads a batch up to a bucket."""
        return {"input_ids": self.tokenizer.pad_token_id or 0, "attention_mask": 0, "token_type_ids": 0}

    def tokenize(self, texts: list[str], **kwargs: Any) -> dict[str, torch.Tensor]:
        # NumPy arrays, then shared as tensors: return_tensors="pt" builds each tensor from nested lists, a sixth
        # of the tokenizer's time on a batch of 8 texts of 120 words (2.26 -> 1.90 ms)
        encoded = self.tokenizer(
            texts, truncation=True, max_length=kwargs.pop("max_length", self.max_length), return_tensors="np", **kwargs
        )
        return {name: torch.from_numpy(encoded[name]) for name in self.tokenizer.model_input_names if name in encoded}

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The serving path's ``tokenize(texts, padding=True)``: the same tensors, through the tokenizer's backend
        directly where it allows (``BatchEncoder``)."""
        return self._encoder(texts) if self._encoder else self.tokenize(texts, padding=True)

    def warmup_batches(self, shapes: Sequence[tuple[int, int]],
                       texts: Sequence[str] | None = None) -> list[dict[str, torch.Tensor]]:
        """Real tokenized text at each (batch, sequence) shape; rows of different lengths exercise padding. The
        warmup words, or the first words of each of ``texts`` in turn (int8's held-out batches)."""
        batches, turn = [], 0
        for batch_size, seq_len in shapes:
            rows = []
            for row in range(batch_size):
                count = max(1, seq_len * (row + 1) // batch_size)
                rows.append(self._words(count) if texts is None else " ".join(texts[turn % len(texts)].split()[:count]))
                turn += 1
            batches.append(self.tokenize(rows, padding="max_length", max_length=seq_len))
        return batches

    def text_batches(self, texts: Sequence[str], batch_size: int) -> list[dict[str, torch.Tensor]]:
        """``texts`` tokenized in batches of ``batch_size``, shortest first so that a batch holds texts of about
        one length: int8's calibration, whose scales padding would widen (padded rows ruined MiniLM's: cosine
        0.971 on held-out texts of 128 words, 0.993 with length-sorted batches; docs/ladder.md)."""
        ordered = sorted(texts, key=lambda text: len(self.tokenize([text])["input_ids"][0]))
        return [self.tokenize(ordered[start:start + batch_size], padding=True)
                for start in range(0, len(ordered), batch_size)]

    @staticmethod
    def _words(count: int) -> str:
        return " ".join(WARMUP_WORDS[i % len(WARMUP_WORDS)] for i in range(count))




class ScoredTask(TextTask, ABC):
    """A text task judged by the score gate. Its module returns logits (softmaxed for the gate) unless
    ``outputs_are_scores``."""

    outputs_are_scores: ClassVar[bool] = False

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> ScoreGate:
        return score_gate(dtype, overrides, None if cls.outputs_are_scores else softmax_scores)
