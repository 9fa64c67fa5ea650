"""Extractive question answering, answered as transformers' ``question-answering`` pipeline answered (its last
release with that pipeline, 4.57; transformers 5 dropped it).

Accepted bodies (options optional, with the pipeline's names and defaults):

* ``{"question": "...", "context": "...", "top_k": 1, "max_answer_len": 15, "handle_impossible_answer": false,
  "align_to_words": true, "doc_stride": 128, "max_seq_len": 384}`` -> ``{"answer", "score", "start", "end"}``
  (a list of them, best first, when ``top_k`` > 1 finds more than one)
* ``{"inputs": [{"question": ..., "context": ...}, ...], <options>}`` -> one such answer per pair

``start``/``end`` are character offsets into the context. A context longer than one window is read in windows
of ``max_seq_len`` tokens that overlap by ``doc_stride`` tokens; each window is one row of the batch, and the
best spans of all windows compete (the same text found in several windows adds up its scores), as in the
pipeline. One difference: spans with probability 0, which the pipeline may list when ``top_k`` exceeds the
possible spans, are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import transformers

from handlers.errors import InvalidInput, ModelLoadError, native_panic
from handlers.tasks import open_inference
from handlers.tasks.base import Encoded
from handlers.tasks.text import ScoredTask
from handlers.tasks.batch_encoder import ENCODING_FIELDS, WindowEncoder

PIPELINE_WINDOW = 384  # the pipeline's default max_seq_len
PIPELINE_STRIDE = 128  # its default doc_stride (at most half the window)
MASKED_LOGIT = -10000.0  # what the pipeline gives tokens that cannot be part of an answer


@dataclass(frozen=True)
class Options:
    top_k: int = 1
    max_answer_len: int = 15
    handle_impossible_answer: bool = False
    align_to_words: bool = True
    doc_stride: int | None = None  # None: min(window // 2, 128)
    max_seq_len: int | None = None  # None: min(max_length, 384)


@dataclass(frozen=True)
class Windows:
    """One (question, context) pair, tokenized into overlapping windows of the context."""

    context: str
    encodings: tuple[Any, ...]  # the tokenizer backend's Encoding of each window, the first window first


@dataclass(frozen=True)
class QuestionRequest:
    pairs: tuple[Windows, ...]
    options: Options
    many: bool  # "inputs": one answer per pair


class SpanLogits(torch.nn.Module):
    """The QA model's start and end logits in fp32 (what the span search reads)."""

    # The head's squeezed logits make inductor ask whether the batch is 1: traced with unbacked rows, one graph
    # serves batch 1 too (handlers.rungs.unbacked_batch)
    rows_unbacked_while_traced = True

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                **extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        return output.start_logits.float(), output.end_logits.float()


class QuestionAnsweringTask(ScoredTask):
    name = "question-answering"
    open_inference_output = "answers"
    model_class = transformers.AutoModelForQuestionAnswering

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # The windows through the Rust backend directly (handlers.tasks.batch_encoder); None: through transformers
        self._window_encoder = WindowEncoder.of(self.tokenizer)
        self._pair_specials = self.tokenizer.num_special_tokens_to_add(pair=True)  # [CLS] q [SEP] c [SEP]: 3

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.tokenizer.is_fast:
            raise ModelLoadError("question-answering needs a fast tokenizer (tokenizer.json) for context windows")
        if self.tokenizer.padding_side != "right":
            raise ModelLoadError("question-answering expects a tokenizer that pads on the right (question first)")
        return SpanLogits(model).eval()

    def parse(self, body: Any) -> QuestionRequest:
        if not isinstance(body, Mapping):
            raise InvalidInput('send a JSON object with "question" and "context" (or "inputs": a list of them)')
        many = "inputs" in body
        allowed = ("inputs",) if many else ("question", "context")
        allowed += tuple(field.name for field in fields(Options))
        unknown = sorted(str(key) for key in body if key not in allowed)
        if unknown:
            raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; allowed here: {', '.join(allowed)}")
        options = self._options(body)
        if many:
            items = body["inputs"]
            if not isinstance(items, list) or not items:
                raise InvalidInput('"inputs" must be a non-empty list of {"question", "context"} objects')
            if len(items) > self.max_inputs:
                raise InvalidInput(f'"inputs" has {len(items)} pairs; at most {self.max_inputs} per request')
            pairs = [self._pair(item, f'"inputs"[{index}]') for index, item in enumerate(items)]
            extra = sorted({str(key) for item in items for key in item if key not in ("question", "context")})
            if extra:
                raise InvalidInput(f'unknown key(s) {", ".join(extra)} in "inputs"; each pair has question, context')
        else:
            pairs = [self._pair(body, "the request")]
        windows = tuple(self._windows(question, context, options) for question, context in pairs)
        total = sum(len(pair.encodings) for pair in windows)
        if total > self.max_inputs:
            raise InvalidInput(f"the context(s) need {total} windows of {self._window(options)} tokens; at most "
                               f"{self.max_inputs} per request (pt2_handlers.max_inputs_per_request)")
        return QuestionRequest(windows, options, many)

    def from_texts(self, texts: Mapping[str, list[str]], parameters: Mapping[str, Any]) -> Any:
        """Two BYTES inputs, "question" and "context", with one element per pair."""
        if sorted(texts) != ["context", "question"]:
            raise InvalidInput(f'question-answering reads two BYTES inputs, "question" and "context"; got '
                               f'{", ".join(texts)}')
        if len(texts["question"]) != len(texts["context"]):
            raise InvalidInput(f'"question" has {len(texts["question"])} elements and "context" '
                               f'{len(texts["context"])}; send one of each per pair')
        pairs = [{"question": question, "context": context}
                 for question, context in zip(texts["question"], texts["context"], strict=True)]
        return open_inference.with_options({"inputs": pairs}, parameters)

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        # One best answer per pair: answer, score, start, end columns [n]; top_k > 1 may give fewer answers
        # for some pairs, so then each pair's list is one JSON string.
        if body.get("top_k", 1) == 1:
            return open_inference.to_tensors(self.open_inference_output, answer)
        return [open_inference.json_rows(self.open_inference_output,
                                         [pair if isinstance(pair, list) else [pair] for pair in answer])]

    def _pair(self, item: Any, where: str) -> tuple[str, str]:
        if not isinstance(item, Mapping):
            raise InvalidInput(f"{where} must be a JSON object with \"question\" and \"context\"")
        for key in ("question", "context"):
            if key not in item:
                raise InvalidInput(f'{where} has no "{key}"')
            if not isinstance(item[key], str) or not item[key].strip():
                raise InvalidInput(f'{where}: "{key}" must be a non-empty string, got {item[key]!r:.40}')
        return item["question"], item["context"]

    def _options(self, body: Mapping[str, Any]) -> Options:
        values = {}
        for name in ("top_k", "max_answer_len", "doc_stride", "max_seq_len"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidInput(f'"{name}" must be a positive integer, got {value!r}')
            values[name] = value
        for name in ("handle_impossible_answer", "align_to_words"):
            value = body.get(name)
            if value is not None and not isinstance(value, bool):
                raise InvalidInput(f'"{name}" must be true or false, got {value!r}')
            values[name] = value
        options = Options(**{name: value for name, value in values.items() if value is not None})
        if options.max_seq_len is not None and options.max_seq_len > self.max_length:
            raise InvalidInput(f'"max_seq_len" {options.max_seq_len} exceeds this model\'s {self.max_length} tokens')
        window = self._window(options)
        if options.doc_stride is not None and options.doc_stride >= window - self._pair_specials:
            raise InvalidInput(f'"doc_stride" {options.doc_stride} must be smaller than the window ({window} tokens, '
                               f"{self._pair_specials} of them special)")
        return options

    def _window(self, options: Options) -> int:
        return options.max_seq_len or min(self.max_length, PIPELINE_WINDOW)

    def _windows(self, question: str, context: str, options: Options) -> Windows:
        window = self._window(options)
        stride = options.doc_stride if options.doc_stride is not None else min(window // 2, PIPELINE_STRIDE)
        try:
            if self._window_encoder is not None:
                encodings = self._window_encoder.windows(question, context, window, stride)
            else:
                encodings = self.tokenizer(question, context, truncation="only_second", max_length=window,
                                           stride=stride, return_overflowing_tokens=True).encodings
        except BaseException as exc:  # noqa: BLE001 - the tokenizer panics where the room is not above the stride
            if not isinstance(exc, Exception) and not native_panic(exc):
                raise
            problem = self._no_room(question, window, stride)
            if problem is None:
                raise RuntimeError(f"the tokenizer failed on this pair: {exc}") from None
            raise problem from None
        return Windows(context, tuple(encodings))

    def _no_room(self, question: str, window: int, stride: int) -> InvalidInput | None:
        """Why the tokenizer could not window a pair, where the question is the reason: it leaves no context in a
        window, or no more than the stride (where the tokenizer panics, as the pipeline's would)."""
        length = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        room = window - self._pair_specials - length
        if room <= 0:
            return InvalidInput(f"the question is too long for a {window}-token window ({length} tokens and "
                                f"{self._pair_specials} special ones); shorten it")
        if room <= stride:
            return InvalidInput(f"the question leaves {room} tokens of each {window}-token window to the context, "
                                f"not more than the stride ({stride}): shorten the question, lower doc_stride or "
                                "raise max_seq_len")
        return None

    def preprocess(self, requests: Sequence[QuestionRequest]) -> Encoded:
        encodings = [encoding for request in requests for pair in request.pairs for encoding in pair.encodings]
        if self._window_encoder is not None:
            return Encoded(self._window_encoder.pad(encodings))
        names = self.tokenizer.model_input_names
        rows = [{name: getattr(encoding, ENCODING_FIELDS[name]) for name in names} for encoding in encodings]
        batch = self.tokenizer.pad(rows, padding=True, return_tensors="pt")
        return Encoded({name: batch[name] for name in names})

    def postprocess(self, outputs: tuple[torch.Tensor, torch.Tensor], encoded: Encoded,
                    requests: Sequence[QuestionRequest]) -> list[Any]:
        starts, ends = (logits.float().cpu().numpy() for logits in outputs)
        answers, row = [], 0
        for request in requests:
            per_pair = []
            for pair in request.pairs:
                count = len(pair.encodings)
                per_pair.append(self._answer(pair, starts[row : row + count], ends[row : row + count], request.options))
                row += count
            answers.append(per_pair if request.many else per_pair[0])
        return answers

    def _answer(self, pair: Windows, starts: np.ndarray, ends: np.ndarray, options: Options) -> Any:
        """The pipeline's answer for one pair from its windows' logits."""
        candidates = options.top_k * 2 + 10 if options.align_to_words else options.top_k  # some merge into words
        null_score = 1_000_000.0
        answers: list[dict[str, Any]] = []
        for window, encoding in enumerate(pair.encodings):
            length = len(encoding.ids)
            context_tokens = np.array([sequence == 1 for sequence in encoding.sequence_ids])
            start = _probabilities(starts[window, :length], context_tokens, self.tokenizer.cls_token_id, encoding)
            end = _probabilities(ends[window, :length], context_tokens, self.tokenizer.cls_token_id, encoding)
            null_score = min(null_score, float(start[0] * end[0]))
            start[0] = end[0] = 0.0  # the empty answer is judged apart, as above
            for first, last, score in _best_spans(start, end, candidates, options.max_answer_len, context_tokens):
                begin, finish = _characters(encoding, first, last, options.align_to_words)
                text = pair.context[begin:finish]
                same = next((answer for answer in answers if answer["answer"].lower() == text.lower()), None)
                if same:
                    same["score"] += score
                else:
                    answers.append({"score": score, "start": begin, "end": finish, "answer": text})
        if options.handle_impossible_answer:
            answers.append({"score": null_score, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda answer: answer["score"], reverse=True)[: options.top_k]
        return answers[0] if len(answers) == 1 else answers


def _probabilities(logits: np.ndarray, context_tokens: np.ndarray, cls_id: int | None, encoding: Any) -> np.ndarray:
    """Softmax over the context tokens and the CLS token (the empty answer); every other token masked."""
    allowed = context_tokens | (np.array(encoding.ids) == cls_id)
    masked = np.where(allowed, logits, np.float32(MASKED_LOGIT))
    exp = np.exp(masked - masked.max())
    return exp / exp.sum()


def _best_spans(start: np.ndarray, end: np.ndarray, count: int, max_answer_len: int,
                context_tokens: np.ndarray) -> list[tuple[int, int, float]]:
    """The ``count`` most probable (start, end) token spans with start <= end < start + max_answer_len, kept if
    both ends lie in the context."""
    spans = np.tril(np.triu(np.outer(start, end)), max_answer_len - 1)
    flat = spans.flatten()
    if count == 1:
        best = np.array([np.argmax(flat)])
    elif len(flat) < count:
        best = np.argsort(-flat)
    else:
        best = np.argpartition(-flat, count)[:count]
        best = best[np.argsort(-flat[best])]
    firsts, lasts = np.unravel_index(best, spans.shape)
    return [(int(first), int(last), float(spans[first, last])) for first, last in zip(firsts, lasts, strict=True)
            if context_tokens[first] and context_tokens[last] and spans[first, last] > 0]


def _characters(encoding: Any, first: int, last: int, align_to_words: bool) -> tuple[int, int]:
    """Character offsets in the context of a token span, widened to whole words when asked."""
    if align_to_words:
        first_word, last_word = encoding.token_to_word(first), encoding.token_to_word(last)
        begin = encoding.word_to_chars(first_word, sequence_index=1) if first_word is not None else None
        finish = encoding.word_to_chars(last_word, sequence_index=1) if last_word is not None else None
        if begin is not None and finish is not None:
            return begin[0], finish[1]
    return encoding.offsets[first][0], encoding.offsets[last][1]
