"""What every task provides: parse -> preprocess -> the module -> postprocess, with the warmup and the quality gate the
ladder proves each rung by. Nothing here assumes text: ``handlers.tasks.text.TextTask`` adds the tokenizer.

The ladder optimizes the ``torch.nn.Module`` a task builds around the model, so the quality gate is checked on what
the client receives (e.g. pooled, normalized embeddings), not on hidden states.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import torch

from handlers.config import DType, HandlerSettings
from handlers.config.inputs import TensorSpec
from handlers.config.shapes import ShapePolicy
from handlers.config.task_facts import COSINE_GATE, MAX_ERROR_GATE, SCORE_GATE, TASK_FACTS, GateFacts, TaskFacts
from handlers.errors import ConfigError, InvalidInput, ModelLoadError
from handlers.ladder import Calibration, Forward, Quality, QualityError, QualityGate, tensors
from handlers.models.files import Form, ModelFiles
from handlers.models.state_dict import load_module
from handlers.tasks import open_inference
from handlers.tasks.casting import CastsFloats

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


@dataclass(frozen=True)
class TaskSettings:
    """What a task is told at load: the model YAML's ``pt2_handlers`` section, the unpacked archive, the model's
    name."""

    settings: HandlerSettings
    model_root: Path
    files: ModelFiles
    model_name: str

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.settings.inputs

    @property
    def options(self) -> Mapping[str, Any]:
        return self.settings.options

    @property
    def max_inputs(self) -> int:
        return self.settings.max_inputs_per_request


class Task(ABC):
    """One task: how requests become a batch of tensors for the module the ladder optimizes, and its outputs become
    answers. The hooks, in the order a batch meets them (TorchServe's preprocess/inference/postprocess, LitServe's
    decode_request/predict/encode_response): ``parse`` one body, ``preprocess`` the batch, ``run`` it through the
    served forward, ``postprocess`` into one answer per request. At load: ``load`` the model the archive carries,
    ``build_module`` (what the ladder optimizes), ``warmup_batches`` (what every rung is proven on) and
    ``quality_gate`` (what it must match fp32 eager by).

    A task of one's own subclasses this (or ``handlers.tasks.tensor.TensorTask``) and is named in the model YAML as
    ``task: module:Class`` (docs/tasks/your-own.md). The built-in tasks' facts for configuration live in
    ``handlers.config.task_facts`` under their name; a task of one's own declares them as class attributes
    (``gate``, ``more_gates``)."""

    name: ClassVar[str] = ""  # a built-in task's name; a task of one's own is named by its "module:Class"
    gate: ClassVar[GateFacts] = COSINE_GATE  # a task of one's own: the gate keys it reads (see ``facts``)
    more_gates: ClassVar[tuple[GateFacts, ...]] = (MAX_ERROR_GATE,)
    open_inference_output: ClassVar[str] = "output"  # the v2 output's name where an answer is one tensor
    # One output row per text, with no sequence axis, that the rows beside it do not change: the engine may then run
    # a batch's rows in groups of similar length (handlers.serving.length_groups).
    row_outputs: ClassVar[bool] = False
    # The shape policy pads each batch's sequence axis (dim 1) to its bucket with ``pad_values``: text behind an
    # attention mask. False: only rows are added (copies of the first, sliced away), the other axes run as sent.
    pads_sequence: ClassVar[bool] = False
    runs_one_forward: ClassVar[bool] = True  # ``run`` is one forward of ``inputs`` (generation loops: False)
    reads_tensors: ClassVar[bool] = True  # Open Inference inputs of numbers are read (text tasks: BYTES only)
    # Paths under the model's URL the task also answers, for clients that append their own (OpenAI's SDK posts to
    # <base_url>/embeddings); a request to any other is refused (404) rather than answered as if sent to the URL.
    paths: ClassVar[tuple[str, ...]] = ()
    pad_values: Mapping[str, int] = MappingProxyType({})  # what each input is padded with (``pads_sequence``)

    def __init__(self, setup: TaskSettings):
        self.setup = setup
        self.max_inputs = setup.max_inputs
        self.model_name = setup.model_name

    @classmethod
    def facts(cls) -> TaskFacts:
        """What configuration knows of the task: a built-in one's entry in ``TASK_FACTS``, else the class's own."""
        if cls.name in TASK_FACTS:
            return TASK_FACTS[cls.name]
        location = f"{cls.__module__}:{cls.__qualname__}"
        return TaskFacts(cls.name or location, location, (cls.__doc__ or "").strip().split("\n")[0], cls.gate,
                         more_gates=cls.more_gates)

    @classmethod
    def load(cls, setup: TaskSettings, device: torch.device) -> tuple[Task, torch.nn.Module]:
        """The task, and the fp32 model the archive carries on ``device`` in eval mode: by default its
        ``--model-file`` + ``--serialized-file``, or its exported program (handlers.models.state_dict)."""
        if setup.files.form is Form.PRETRAINED:
            raise ModelLoadError(f"{cls.facts().name} loads the model from --model-file + --serialized-file (a "
                                 "state_dict) or --serialized-file model.pt2 (torch.export); the archive has neither")
        return cls(setup), load_module(setup.model_root, setup.files, device)

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> QualityGate:
        """The acceptance metric for a rung serving in ``dtype``, with configured thresholds applied; ConfigError
        for a threshold out of range. By default: cosine per row and largest error, against fp32 eager."""
        return TensorGate(gate_threshold(dtype, overrides, COSINE_GATE),
                          gate_threshold(dtype, overrides, MAX_ERROR_GATE))

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the ladder optimizes (and the quality gate judges): by default the model, its floating inputs
        cast to the precision it runs in and its floating outputs to float32; a task may add its tensor-side head,
        so the gate is checked on what clients receive."""
        return CastsFloats(model)

    def fit_shapes(self, shapes: ShapePolicy) -> ShapePolicy:
        """The shape policy for this task's model: by default batch sizes alone (text: sequence buckets too, capped
        at ``max_length``)."""
        return replace(shapes, seq_lengths=(1,))

    def parse_threads(self) -> int:
        """How many threads read a batch's bodies (``decode`` and ``parse``): 1, unless parsing is heavy and lets go
        of the GIL (image decoding)."""
        return 1

    def decode(self, body: Any) -> Any:
        """One body as TorchServe hands it over (JSON, text or bytes) made text or JSON (``decode_body``); a task that
        reads binary bodies (images) keeps them as bytes."""
        return decode_body(body)

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

    @abstractmethod
    def warmup_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        """Model inputs at each (batch, sequence) shape of the policy: what every rung runs and is judged on."""

    def calibration(self, shapes: Sequence[tuple[int, int]], warmup: list[Any]) -> Calibration:
        """What int8 is calibrated on (the warmup batches) and judged on besides them (by default: inputs of a
        second seed at the warmup shapes)."""
        return Calibration(list(warmup), self.held_out_batches(shapes), "the warmup batches",
                           "inputs of another seed at the warmup shapes")

    def held_out_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        """Inputs like the warmup's that int8 was not calibrated on; by default the warmup's."""
        return self.warmup_batches(shapes)

    def from_open_inference(self, request: open_inference.InferRequest) -> Any:
        """This task's own body for an Open Inference (KServe v2) request."""
        raise InvalidInput(f"{self.facts().name} does not read Open Inference requests")

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        """The v2 output tensors of the answer to ``body`` (what ``from_open_inference`` made): by default one
        row per input (see handlers/tasks/open_inference.py)."""
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
        return {"max_per_request": self.max_inputs}

    def describe_outputs(self) -> dict[str, Any] | None:
        """What decides the answers beside the forward, for describe (embeddings: the pooling); None: nothing."""
        return None


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


def float_pairs(actual: Any, expected: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each output tensor of a rung beside fp32 eager's, both float32 on the CPU; QualityError where the outputs'
    shapes differ."""
    got, want = list(tensors(actual)), list(tensors(expected))
    if [t.shape for t in got] != [t.shape for t in want]:
        raise QualityError(f"outputs have shapes {[tuple(t.shape) for t in got]}, "
                           f"fp32 eager {[tuple(t.shape) for t in want]}")
    return [(ours.detach().float().cpu(), theirs.float().cpu()) for ours, theirs in zip(got, want, strict=True)]


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
        pairs = [(self.to_scores(ours), self.to_scores(theirs)) for ours, theirs in float_pairs(actual, expected)]
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


class TensorGate(QualityGate):
    """``min_cosine``: the smallest cosine between a rung's output row and fp32 eager's (each output flattened per
    row); and the largest absolute difference over every element, as a share of the largest magnitude fp32 eager's
    outputs hold, at most ``max_error``."""

    metric = "min_cosine"

    def __init__(self, min_cosine: float, max_error: float):
        self.threshold = min_cosine
        self.max_error = max_error

    def measure(self, actual: Any, expected: Any) -> float:
        cosines, errors, scale = [], [], 0.0
        for ours, theirs in float_pairs(actual, expected):
            rows = ours.reshape(ours.shape[0] if ours.dim() else 1, -1)
            expected_rows = theirs.reshape(rows.shape)
            same = (rows == expected_rows).all(dim=-1)  # all-zero rows have no cosine: equal is equal
            cosine = torch.nn.functional.cosine_similarity(rows, expected_rows, dim=-1).nan_to_num(-1.0)
            cosines.append(torch.where(same, torch.ones_like(cosine), cosine).min())
            errors.append((ours - theirs).abs().max().nan_to_num(float("inf")))
            scale = max(scale, theirs.abs().max().item())
        value = min(cosines).item()
        error = max(errors).item() / (scale or 1.0)
        if error > self.max_error:
            raise QualityError(f"largest error {error:.3g} of fp32 eager's largest magnitude (max_abs_error "
                               f"{self.max_error:g}); min_cosine {value:.6f}",
                               Quality(self.metric, value, self.threshold))
        return value


def gate_threshold(dtype: DType, overrides: Mapping[str, float], gate: GateFacts) -> float:
    """A task's configured (or default) gate value for a rung in ``dtype``: the key of its precision family (fp32,
    bf16/fp16, int8; a gate with one key has it for all); a ConfigError for any configured value out of range."""
    low, high = gate.bounds
    for key, value in overrides.items():
        if key in gate.keys and not low <= value <= high:
            raise ConfigError(f"pt2_handlers.quality_gate.{key} is {gate.what} in [{low:g}, {high:g}], got {value!r}")
    family = 0 if dtype is DType.FLOAT32 else 2 if dtype is DType.INT8 else 1
    index = min(family, len(gate.keys) - 1)
    return overrides.get(gate.keys[index], gate.defaults[index])
