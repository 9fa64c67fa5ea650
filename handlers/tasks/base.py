"""What every task adapter provides, pipeline-style: parse -> preprocess -> module -> postprocess.

The ladder optimizes the ``torch.nn.Module`` a task builds around the Hugging Face model, so the quality gate is
checked on what the client receives (e.g. pooled, normalized embeddings), not on hidden states.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from handlers.config import DType, TooLong
from handlers.config.shapes import ShapePolicy
from handlers.config.task_facts import SCORE_GATE, TASK_FACTS, GateFacts, TaskFacts
from handlers.errors import ConfigError, InvalidInput
from handlers.ladder import Forward, Quality, QualityError, QualityGate, tensors
from handlers.tasks import open_inference
from handlers.tasks.batch_encoder import BatchEncoder

WARMUP_WORDS = "the quick brown fox jumps over the lazy dog while a cat watches from the warm window".split()


@dataclass(frozen=True)
class Encoded:
    """One batch as the module takes it (``inputs``), plus what postprocess needs to map rows back to
    requests (``extras``: e.g. character offsets per token, or which request each row belongs to)."""

    inputs: dict[str, torch.Tensor]
    extras: Any = None


# Streamed chunks, one per request index (the request's position in the batch): JSON-able objects.
Emit = Callable[[Mapping[int, Any]], None]


class Served(Protocol):
    """What a task runs a batch through once READY (the engine provides it)."""

    shapes: ShapePolicy

    def forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """The whole batch through the accepted rung: in chunks of the largest batch bucket, each padded up to
        its bucket, outputs sliced back to the real rows."""

    def forward_step(self, **inputs: Any) -> Any:
        """One guarded call of the accepted rung at exactly these shapes (a failure is retried eagerly)."""


class Task(ABC):
    """One task. Subclasses set ``name``, ``model_class`` and ``default_too_long``, and implement the hooks. What
    configuration checks about a task (its gate keys and their defaults, default shapes, what it refuses) is in
    ``handlers.config.task_facts``, under its name: ``facts()``."""

    name: ClassVar[str]
    model_class: ClassVar[Any]  # a transformers Auto* class
    default_too_long: ClassVar[TooLong] = TooLong.REJECT  # a text past max_length, unless the YAML says
    open_inference_output: ClassVar[str]  # the v2 output's name where an answer is one tensor
    # One output row per text, with no sequence axis, that the rows beside it do not change: the engine may then run
    # a batch's rows in groups of similar length (handlers.serving.length_groups).
    row_outputs: ClassVar[bool] = False
    encodes_texts: ClassVar[bool] = False  # preprocess tokenizes a batch of plain texts through the BatchEncoder
    runs_one_forward: ClassVar[bool] = True  # ``run`` is one forward of ``inputs`` (generation loops: False)
    # Paths under the model's URL the task also answers, for clients that append their own (OpenAI's SDK posts to
    # <base_url>/embeddings); a request to any other is refused (404) rather than answered as if sent to the URL.
    paths: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def facts(cls) -> TaskFacts:
        return TASK_FACTS[cls.name]

    @classmethod
    @abstractmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> QualityGate:
        """The acceptance metric for a rung serving in ``dtype``, with configured thresholds applied;
        ConfigError for a threshold out of range."""

    def __init__(self, tokenizer: Any, max_length: int, max_inputs: int, model_name: str,
                 too_long: TooLong | None = None, model_dir: Path | None = None):
        """``model_dir``: the save_pretrained directory, for what a task reads there beside the weights and the
        tokenizer (embeddings: its pooling); None reads nothing there."""
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_inputs = max_inputs
        self.model_name = model_name
        self.too_long = too_long or self.default_too_long
        # ~20 ms at load (a copy of the Rust tokenizer), for the tasks whose serving path calls encode()
        self._encoder = BatchEncoder.of(tokenizer, max_length) if self.encodes_texts else None

    @abstractmethod
    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the ladder optimizes: the HF model plus the task's tensor-side head."""

    @abstractmethod
    def parse(self, body: Any) -> Any:
        """Validate one request body (already through ``decode_body``: text or JSON) into a request object; raise
        InvalidInput naming the problem."""

    @abstractmethod
    def preprocess(self, requests: Sequence[Any]) -> Encoded:
        """Collate parsed requests into one batch of model inputs (CPU tensors)."""

    @abstractmethod
    def postprocess(self, outputs: Any, encoded: Encoded, requests: Sequence[Any]) -> list[Any]:
        """Split the batch outputs into one JSON-serializable answer per request."""

    def from_open_inference(self, texts: Mapping[str, list[str]], parameters: Mapping[str, Any]) -> Any:
        """This task's own body for an Open Inference (KServe v2) request: by default the strings of its one BYTES
        input as ``"inputs"``, the request's parameters as options."""
        return open_inference.with_options({"inputs": open_inference.only_input(texts, self.name)}, parameters)

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        """The v2 output tensors of the answer to ``body`` (what ``from_open_inference`` made): by default one
        row per input string (see handlers/tasks/open_inference.py)."""
        return open_inference.to_tensors(self.open_inference_output, answer)

    def run(self, served: Served, encoded: Encoded, emit: Emit | None) -> Any:
        """The batch's outputs: one forward of the whole batch. Tasks that loop (generation) override this,
        and may stream chunks through ``emit`` as they go."""
        return served.forward_batch(encoded.inputs)

    def prove(self, forward: Forward, batch: Any) -> Any:
        """One warmup batch through ``forward`` (a rung being proven, or fp32 eager for the reference)."""
        return forward(**batch)

    def describe_inputs(self) -> dict[str, Any]:
        """The input limits a client must respect, for describe."""
        return {"max_length": self.max_length, "too_long": self.too_long.value, "max_per_request": self.max_inputs}

    def describe_outputs(self) -> dict[str, Any] | None:
        """What decides the answers beside the forward, for describe (embeddings: the pooling); None: nothing."""
        return None

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
    def pad_values(self) -> dict[str, int]:
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


MAX_JSON_DEPTH = 32  # every task's body is at most 4 levels deep; deeper is a client bug, or an attack


def decode_body(body: Any) -> Any:
    """TorchServe hands over parsed JSON, text or raw bytes; turn bytes into text or JSON, and refuse what no
    task can read: invalid UTF-8, JSON nested past ``MAX_JSON_DEPTH``, strings holding lone surrogates."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        if body.lstrip().startswith(("{", "[")):
            try:
                body = json.loads(body)
            except json.JSONDecodeError as exc:
                raise InvalidInput(f"request body looks like JSON but does not parse: {exc}") from None
            except RecursionError:  # TorchServe's own json.loads gave up too, and handed over the bytes
                raise InvalidInput(f"request body is JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    if body is None:
        raise InvalidInput("request body is empty")
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    """InvalidInput for nesting past MAX_JSON_DEPTH, or a string no tokenizer can take: JSON may spell a lone
    UTF-16 surrogate ("\\ud800"), which Python keeps and the Rust tokenizers reject, for the whole batch."""
    pending = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(f"request body is JSON nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInput(f"a string in the request holds a lone surrogate ({value[exc.start]!a} at "
                                   f"character {exc.start}); send valid Unicode") from None
        elif isinstance(value, Mapping):
            pending.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)


class ScoreGate(QualityGate):
    """``score_agreement`` = 1 - the largest score difference from fp32 eager, over every output, row and
    label. ``to_scores`` turns each output tensor into the probabilities clients see (e.g. a softmax over
    logits); by default the outputs are those probabilities. Scores within ``max_error`` also keep the
    labels: a ranking can only flip between labels whose fp32 scores are within twice that. ``same_labels``
    (int8, whose error bound is wider) also wants every top label identical: each row's class, each token's
    entity label, each question's most likely answer start and end."""

    metric = "score_agreement"

    def __init__(self, max_error: float, to_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 same_labels: bool = False):
        self.threshold = 1.0 - max_error
        self.to_scores = to_scores or (lambda scores: scores)
        self.same_labels = same_labels

    def measure(self, actual: Any, expected: Any) -> float:
        got, want = list(tensors(actual)), list(tensors(expected))
        if [t.shape for t in got] != [t.shape for t in want]:
            raise QualityError(f"outputs have shapes {[tuple(t.shape) for t in got]}, "
                               f"fp32 eager {[tuple(t.shape) for t in want]}")
        pairs = [(self.to_scores(ours.detach().float().cpu()), self.to_scores(theirs.float().cpu()))
                 for ours, theirs in zip(got, want, strict=True)]
        value = 1.0 - max((ours - theirs).abs().max() for ours, theirs in pairs).nan_to_num(2.0).item()
        if self.same_labels:
            changed = sum(int((ours.argmax(-1) != theirs.argmax(-1)).sum()) for ours, theirs in pairs)
            if changed:
                total = sum(theirs[..., 0].numel() for _, theirs in pairs)
                raise QualityError(f"{changed} of {total} top labels differ from fp32 eager's "
                                   f"({self.metric} {value:.6f})", Quality(self.metric, value, self.threshold))
        return value


def score_gate(dtype: DType, overrides: Mapping[str, float],
               to_scores: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ScoreGate:
    """The score gate of the classification-like tasks: ``max_score_error`` for fp32 rungs,
    ``max_score_error_half`` for bf16/fp16 ones, ``max_score_error_int8`` for int8 ones."""
    return ScoreGate(gate_threshold(dtype, overrides, SCORE_GATE), to_scores, same_labels=dtype is DType.INT8)


def softmax_scores(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=-1)


class ScoredTask(Task, ABC):
    """A task judged by the score gate. Its module returns logits (softmaxed for the gate) unless
    ``outputs_are_scores``."""

    outputs_are_scores: ClassVar[bool] = False

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> ScoreGate:
        return score_gate(dtype, overrides, None if cls.outputs_are_scores else softmax_scores)


def gate_threshold(dtype: DType, overrides: Mapping[str, float], gate: GateFacts) -> float:
    """A task's configured (or default) gate value for a rung in ``dtype``: the key of its precision family (fp32,
    bf16/fp16, int8; a gate with one key has it for all); a ConfigError for any configured value out of range."""
    low, high = gate.bounds
    for key, value in overrides.items():
        if not low <= value <= high:
            raise ConfigError(f"pt2_handlers.quality_gate.{key} is {gate.what} in [{low:g}, {high:g}], got {value!r}")
    family = 0 if dtype is DType.FLOAT32 else 2 if dtype is DType.INT8 else 1
    index = min(family, len(gate.keys) - 1)
    return overrides.get(gate.keys[index], gate.defaults[index])
