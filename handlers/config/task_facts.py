"""What configuration knows about each task, without importing it.

A task module imports transformers, the ladder and ``handlers.config``; the model YAML is validated before any
task module may be imported (handlers/tasks/__init__.py says why). So the facts ``pt2_handlers`` is checked
against live here, in a leaf that imports no other handlers module but ``shapes``: the task names, where each
adapter lives, the quality-gate keys with their defaults and ranges, and what a task refuses. The task classes
declare the same facts for the engine; tests/test_schema.py holds the two to each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from handlers.config.shapes import ShapePolicy

# The precisions each gate key covers, in the order GateFacts.keys lists them.
GATE_KEY_PRECISIONS = ("fp32 rungs", "bf16/fp16 rungs", "int8 rungs")


@dataclass(frozen=True)
class GateFacts:
    """The thresholds a task reads from ``pt2_handlers.quality_gate``: one key per precision family."""

    keys: tuple[str, ...]  # fp32 rungs, then bf16/fp16 rungs, then int8 rungs; a float32-only task has one
    defaults: tuple[float, ...]  # each key's value when the YAML leaves it out
    bounds: tuple[float, float]  # the values a key may take, both ends included
    what: str  # the kind of value, in the range error: "... is a cosine in [-1, 1]"
    measures: str  # what the metric is, for the configuration reference

    def describe(self, key: str) -> str:
        precisions = GATE_KEY_PRECISIONS[self.keys.index(key)] if len(self.keys) > 1 else "every rung"
        return f"{self.measures}; for {precisions}"


@dataclass(frozen=True)
class TaskFacts:
    name: str
    location: str  # "module:class" of the adapter, imported only when asked for (handlers.tasks.check_task)
    summary: str  # one line for the configuration reference
    gate: GateFacts
    default_shapes: ShapePolicy = ShapePolicy()  # the buckets a YAML without pt2_handlers.shapes gets
    float32_only: str | None = None  # why the task serves float32 only, if it does
    static_shapes_only: str | None = None  # why the task refuses the dynamic shape policy, if it does
    causal_attention: bool = False  # its models attend to earlier tokens only (decoders): no fused attention
    more_gates: tuple[GateFacts, ...] = ()  # further metrics a rung must also pass (the tensor task's max error)
    needs_inputs: bool = False  # pt2_handlers.inputs must declare the model's tensors

    @property
    def gates(self) -> tuple[GateFacts, ...]:
        return (self.gate, *self.more_gates)

    @property
    def gate_keys(self) -> tuple[str, ...]:
        return tuple(key for gate in self.gates for key in gate.keys)


COSINE_GATE = GateFacts(
    keys=("min_cosine", "min_cosine_half", "min_cosine_int8"), defaults=(0.9999, 0.999, 0.99), bounds=(-1.0, 1.0),
    what="a cosine", measures="the smallest cosine, per row, between a rung's output (an embedding) and fp32 eager's",
)
MAX_ERROR_GATE = GateFacts(
    keys=("max_abs_error", "max_abs_error_half", "max_abs_error_int8"), defaults=(1e-4, 5e-2, 1e-1),
    bounds=(0.0, 1.0), what="a share of fp32 eager's largest magnitude",
    measures="the largest absolute difference from fp32 eager over every output element, as a share of the largest "
             "absolute value fp32 eager's outputs hold",
)
SCORE_GATE = GateFacts(
    keys=("max_score_error", "max_score_error_half", "max_score_error_int8"), defaults=(1e-4, 1e-2, 5e-2),
    bounds=(0.0, 1.0), what="a probability difference",
    measures="the largest probability difference from fp32 eager, over every output, row and label",
)
IMAGE_GATE = GateFacts(
    keys=SCORE_GATE.keys, defaults=(1e-3, 2e-1, 2.5e-1), bounds=(0.0, 1.0), what="a probability difference",
    measures="the largest probability difference from fp32 eager, over every image and label (besides: every "
             "image's most likely label the same, and at most one of its top 5 different)",
)
TOKEN_GATE = GateFacts(
    keys=("min_token_agreement",), defaults=(1.0,), bounds=(0.0, 1.0), what="a share of tokens",
    measures="per warmup prompt, the share of greedy tokens before the first that differs from fp32 eager's "
             "(1.0: identical)",
)

IMAGE_TASK = "image-classification"
TASK_FACTS: Mapping[str, TaskFacts] = MappingProxyType({facts.name: facts for facts in (
    TaskFacts("embeddings", "handlers.tasks.embeddings:EmbeddingsTask",
              "sentence embeddings: mean-pooled, normalized (sentence-transformers' answer)", COSINE_GATE),
    TaskFacts("text-classification", "handlers.tasks.classification:TextClassificationTask",
              "labels and scores per text (transformers' text-classification pipeline)", SCORE_GATE),
    TaskFacts("token-classification", "handlers.tasks.token_classification:TokenClassificationTask",
              "entities with character offsets (transformers' token-classification pipeline)", SCORE_GATE),
    TaskFacts("question-answering", "handlers.tasks.question_answering:QuestionAnsweringTask",
              "answer spans in a context, long contexts read in windows", SCORE_GATE),
    TaskFacts("text-generation", "handlers.tasks.generation:TextGenerationTask",
              "greedy or sampled continuations, streamed or whole", TOKEN_GATE,
              default_shapes=ShapePolicy(batch_sizes=(1, 4), seq_lengths=(256,)),
              float32_only="its gate wants greedy tokens identical to fp32 eager's, which half types rarely keep",
              static_shapes_only="the decode step runs against a static KV cache per (batch, cache length) bucket",
              causal_attention=True),
    TaskFacts(IMAGE_TASK, "handlers.tasks.image_classification:ImageClassificationTask",
              "top-k labels per image, TorchServe's image_classifier contract (raw bytes, base64, multipart)",
              IMAGE_GATE, default_shapes=ShapePolicy(batch_sizes=(1, 2, 4, 8), seq_lengths=(1,))),
    TaskFacts("tensor", "handlers.tasks.tensor:TensorTask",
              "any nn.Module: named tensors in (pt2_handlers.inputs), tensors out", COSINE_GATE,
              more_gates=(MAX_ERROR_GATE,), needs_inputs=True),
)})
TASK_NAMES: tuple[str, ...] = tuple(TASK_FACTS)
# A task of one's own: "module:Class", the module packed at the archive's root (--extra-files).
USER_TASK_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


def is_user_task(name: str) -> bool:
    return ":" in name
