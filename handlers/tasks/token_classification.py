"""Token classification (e.g. named entities), answered as transformers' ``token-classification`` pipeline
answers.

Accepted bodies (``aggregation_strategy`` and ``ignore_labels`` optional, as the pipeline's arguments):

* raw text, or ``{"text": "...", "aggregation_strategy": "simple", "ignore_labels": ["O"]}`` -> ``[entity, ...]``
* ``{"inputs": "..." | ["...", ...], ...}``                                             -> one such list per text

An entity is ``{"entity", "score", "index", "word", "start", "end"}`` per token with aggregation ``none`` (the
default, as in the pipeline), and ``{"entity_group", "score", "word", "start", "end"}`` with ``simple``,
``first``, ``average`` or ``max``. ``start``/``end`` are character offsets into the text as sent.

The optimized module returns per-token logits; turning them into entities is the pipeline's own postprocess,
run on our logits, so every strategy groups and scores exactly as the pipeline does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import transformers

from handlers.errors import InvalidInput, ModelLoadError
from handlers.tasks import open_inference
from handlers.tasks.base import Encoded
from handlers.tasks.text import ScoredTask

if TYPE_CHECKING:  # transformers.pipelines imports torch._dynamo: imported where used, not at import
    from transformers.pipelines.token_classification import AggregationStrategy

OPTIONS = ("aggregation_strategy", "ignore_labels")


@dataclass(frozen=True)
class TokenRequest:
    texts: tuple[str, ...]
    aggregation: AggregationStrategy
    ignore_labels: tuple[str, ...] | None  # None: the pipeline's default, ["O"]
    many: bool  # "inputs": one list of entities per text


class TokenLogits(torch.nn.Module):
    """The token-classification model's logits in fp32 (what the pipeline's postprocess reads)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits.float()


class TokenClassificationTask(ScoredTask):
    name = "token-classification"
    open_inference_output = "entities"
    encodes_texts = True  # through BatchEncoder.with_offsets
    model_class = transformers.AutoModelForTokenClassification

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.tokenizer.is_fast:
            raise ModelLoadError("token-classification needs a fast tokenizer (tokenizer.json) for character offsets")
        # The pipeline object only lends its postprocess (entity grouping); it never runs the model. Its device is
        # the model's: left unset, transformers moves the model to the first GPU it finds, under a CPU worker too.
        self._pipeline = transformers.TokenClassificationPipeline(model=model, tokenizer=self.tokenizer,
                                                                  device=model.device)
        return TokenLogits(model).eval()

    def parse(self, body: Any) -> TokenRequest:
        if isinstance(body, str):
            return TokenRequest(self.texts_of(body, "the text"), _aggregation(None), None, many=False)
        if not isinstance(body, Mapping):
            raise InvalidInput(f"expected text or a JSON object, got JSON {type(body).__name__}")
        present = [key for key in ("text", "inputs") if key in body]
        if len(present) != 1:
            raise InvalidInput('send exactly one of "text" or "inputs" in the JSON object')
        key = present[0]
        unknown = sorted(str(name) for name in body if name not in (key, *OPTIONS))
        if unknown:
            raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; allowed here: {', '.join((key, *OPTIONS))}")
        value = body[key]
        if key == "text" and not isinstance(value, str):
            raise InvalidInput(f'"text" must be a string, got {type(value).__name__}; send a list as "inputs"')
        return TokenRequest(self.texts_of(value, f'"{key}"'), _aggregation(body.get("aggregation_strategy")),
                            _ignore_labels(body.get("ignore_labels")), many=key == "inputs")

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        # Each text has its own number of entities: one JSON list per text, whatever the counts.
        return [open_inference.json_rows(self.open_inference_output, answer)]

    def preprocess(self, requests: Sequence[TokenRequest]) -> Encoded:
        texts = [text for request in requests for text in request.texts]
        if self._encoder is not None:  # the Rust backend directly, as embeddings do (handlers.tasks.batch_encoder)
            inputs, offsets, special = self._encoder.with_offsets(texts)
            return Encoded(inputs, {"offsets": offsets, "special": special})
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_offsets_mapping=True, return_special_tokens_mask=True, return_tensors="pt")
        inputs = {name: encoded[name] for name in self.tokenizer.model_input_names if name in encoded}
        return Encoded(inputs, {"offsets": encoded["offset_mapping"], "special": encoded["special_tokens_mask"]})

    def postprocess(self, outputs: torch.Tensor, encoded: Encoded, requests: Sequence[TokenRequest]) -> list[Any]:
        # Each text's own tokens, wherever its tokenizer padded it (left or right); columns past them are the shape
        # policy's padding, always on the right.
        mask = encoded.inputs["attention_mask"].bool()
        logits = outputs.float().cpu()[:, : mask.shape[1]]
        # Token ids and offsets as Python lists (the pipeline's documented types): it reads them token by token, and
        # each read of a tensor element costs microseconds (NER, 4 texts of 8-96 words: most of our 7 ms)
        ids, offsets = encoded.inputs["input_ids"].tolist(), encoded.extras["offsets"].tolist()
        answers, row = [], 0
        for request in requests:
            per_text = []
            for text in request.texts:
                real = mask[row]
                columns = real.nonzero().flatten().tolist()
                chunk = {
                    "logits": logits[row : row + 1, real],
                    "input_ids": [[ids[row][column] for column in columns]],
                    "offset_mapping": [[tuple(offsets[row][column]) for column in columns]],
                    "special_tokens_mask": encoded.extras["special"][row : row + 1, real],
                    "sentence": text,
                }
                ignore = None if request.ignore_labels is None else list(request.ignore_labels)
                entities = self._pipeline.postprocess([chunk], aggregation_strategy=request.aggregation,
                                                      ignore_labels=ignore)
                per_text.append([_plain(entity) for entity in entities])
                row += 1
            answers.append(per_text if request.many else per_text[0])
        return answers


def _aggregation(value: Any) -> AggregationStrategy:
    from transformers.pipelines.token_classification import AggregationStrategy

    allowed = ", ".join(strategy.value for strategy in AggregationStrategy)
    if value is None:
        return AggregationStrategy.NONE
    try:
        return AggregationStrategy(value)
    except ValueError:
        raise InvalidInput(f'"aggregation_strategy" must be one of: {allowed}; got {value!r}') from None


def _ignore_labels(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(label, str) for label in value):
        raise InvalidInput(f'"ignore_labels" must be a list of label names, got {value!r}')
    return tuple(value)


def _plain(entity: Mapping[str, Any]) -> dict[str, Any]:
    """The pipeline's entity with numpy numbers as JSON numbers."""
    return {key: value.item() if hasattr(value, "item") else value for key, value in entity.items()}
