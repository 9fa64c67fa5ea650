"""Text generation, answered as transformers' ``text-generation`` pipeline answers, with the per-token decode step
itself compiled.

Accepted bodies:

* raw text                      -> ``[{"generated_text": prompt + completion}]``
* ``{"text": "...", <parameters>}`` -> the same, shaped by the parameters:

  ``max_new_tokens``; ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed`` (sampling: on when
  ``do_sample`` is true, or when a sampling parameter is given without it; ``temperature: 0`` is greedy);
  ``stop`` (a string or a list: generation ends where one appears, and the text ends before it);
  ``return_full_text`` (default true, as the pipeline); ``details`` (adds finish reason, token ids, seed);
  ``stream`` (chunks as the tokens come: ``{"token_id", "text"}`` per token, then the answer itself).
  Defaults are the model's ``generation_config.json``, as ``model.generate`` reads them.

How it runs: a batch's prompts, left-padded, are prefilled by one eager forward that fills the KV cache; then
each new token costs one *decode step* through the accepted rung. The KV cache is static (transformers'
``StaticCache``, one per (batch, cache length) bucket of the shape policy), so every step of a bucket has the
same shapes and the same guards: one graph per bucket, compiled at load, never after READY. Sliding-window
layers get full-length static layers (see ``static_cache``). Greedy tokens are the gate: a rung is accepted
only if its greedy tokens equal fp32 eager's on the warmup prompts.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers

from handlers.config import DType, TooLong
from handlers.errors import InvalidInput
from handlers.ladder import Forward, QualityError, QualityGate, tensors
from handlers.tasks import open_inference
from handlers.tasks.base import Emit, Encoded, Served, gate_threshold
from handlers.tasks.text import TextTask
from handlers.tasks.decoding import (Completion, DecodeStep, GenerationBatch, GenerationRequest, Sampling, cache_needed,
                                     sample, static_cache)

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 64  # when neither the request nor generation_config.json says
WARMUP_NEW_TOKENS = 8  # per warmup prompt: enough steps to compile, replay and compare the decode step
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 200
MAX_SEED = 2**63 - 1
SAMPLING_KEYS = ("temperature", "top_k", "top_p")
PARAMETERS = ("max_new_tokens", "do_sample", *SAMPLING_KEYS, "seed", "stop", "return_full_text", "details",
              "stream")


class TokenGate(QualityGate):
    """``greedy_token_agreement``: per warmup prompt, the share of greedy tokens generated before the first
    one that differs from fp32 eager's; the smallest over all prompts. 1.0 means identical."""

    metric = "greedy_token_agreement"

    def __init__(self, threshold: float):
        self.threshold = threshold

    def measure(self, actual: Any, expected: Any) -> float:
        (got,), (want,) = list(tensors(actual)), list(tensors(expected))
        if got.shape != want.shape:
            raise QualityError(f"generated tokens have shape {tuple(got.shape)}, fp32 eager {tuple(want.shape)}")
        same = (got.cpu() == want.cpu()).long().cumprod(dim=1).sum(dim=1)  # tokens before the first difference
        return (same.float() / max(1, want.shape[1])).min().item()


class TextGenerationTask(TextTask):
    name = "text-generation"
    open_inference_output = "generated_text"
    model_class = transformers.AutoModelForCausalLM
    runs_one_forward = False  # a decode loop: its prompt's tokens say nothing of its work

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> TokenGate:
        return TokenGate(gate_threshold(dtype, overrides, cls.facts().gate))

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        self._model_config = model.config
        self._defaults = model.generation_config
        eos = self._defaults.eos_token_id if self._defaults.eos_token_id is not None else self.tokenizer.eos_token_id
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        pad = self.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else next(iter(self._eos_ids), 0)
        self._caches: dict[tuple[int, int], transformers.StaticCache] = {}
        self._step = DecodeStep(model).eval()
        return self._step

    def describe_inputs(self) -> dict[str, Any]:
        """One prompt per request; ``max_length`` counts the prompt and its new tokens together."""
        defaults = getattr(self, "_defaults", None)  # set by build_module; describe may come before
        return {"max_length": self.max_length, "too_long": self.too_long.value,
                "default_max_new_tokens": (defaults and defaults.max_new_tokens) or DEFAULT_MAX_NEW_TOKENS}

    # -- requests ------------------------------------------------------------------------------------------

    def parse(self, body: Any) -> GenerationRequest:
        if isinstance(body, str):
            text, params = body, {}
        elif isinstance(body, Mapping):
            if "text" not in body:
                raise InvalidInput('send the prompt as "text" in the JSON object')
            unknown = sorted(str(key) for key in body if key != "text" and key not in PARAMETERS)
            if unknown:
                raise InvalidInput(f"unknown key(s) {', '.join(unknown)}; allowed here: text, {', '.join(PARAMETERS)}")
            text, params = body["text"], body
            if not isinstance(text, str):
                raise InvalidInput(f'"text" must be a string (one prompt per request), got {type(text).__name__}')
        else:
            raise InvalidInput(f"expected text or a JSON object, got JSON {type(body).__name__}")
        if not text.strip():
            raise InvalidInput("the prompt is empty")
        prompt_ids = tuple(self.tokenizer(text)["input_ids"])
        max_new, prompt_ids = self._lengths(prompt_ids, params.get("max_new_tokens"))
        return GenerationRequest(
            prompt=text, prompt_ids=prompt_ids, max_new_tokens=max_new, sampling=self._sampling(params),
            stop=_stop_strings(params.get("stop")),
            return_full_text=_flag(params, "return_full_text", True), details=_flag(params, "details", False),
            stream=_flag(params, "stream", False))

    def from_texts(self, texts: Mapping[str, list[str]], parameters: Mapping[str, Any]) -> Any:
        """One BYTES input holding one prompt; the parameters are the generation parameters (no streaming: the
        protocol's REST answer is one JSON object)."""
        prompts = open_inference.only_input(texts, self.name)
        if len(prompts) != 1:
            raise InvalidInput(f"text-generation reads one prompt per request; the input holds {len(prompts)}")
        if parameters.get("stream"):
            raise InvalidInput('"stream" is not available over the Open Inference Protocol; stream with '
                               "/predictions or gRPC StreamPredictions")
        return open_inference.with_options({"text": prompts[0]}, parameters)

    def _lengths(self, prompt_ids: tuple[int, ...], requested: Any) -> tuple[int, tuple[int, ...]]:
        """``max_new_tokens`` and the prompt tokens read, within ``max_length`` tokens in all."""
        if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
            raise InvalidInput(f'"max_new_tokens" must be a positive integer, got {requested!r}')
        room = self.max_length - len(prompt_ids)
        if requested is None:
            default = self._defaults.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
            if room >= 1:
                return min(default, room), prompt_ids
            requested = min(default, self.max_length - 1)
        if requested >= self.max_length:
            raise InvalidInput(f'"max_new_tokens" is {requested}; this model reads at most {self.max_length} tokens '
                               "in all (prompt and new tokens)")
        if requested <= room:
            return requested, prompt_ids
        if self.too_long is TooLong.TRUNCATE:  # keep the end of the prompt: it is what the model continues
            return requested, prompt_ids[len(prompt_ids) - (self.max_length - requested):]
        raise InvalidInput(
            f"the prompt is {len(prompt_ids)} tokens long and max_new_tokens is {requested}; this model reads at most "
            f"{self.max_length} tokens in all. Shorten the prompt, ask for fewer tokens, or serve the model with "
            "pt2_handlers.too_long: truncate")

    def _sampling(self, params: Mapping[str, Any]) -> Sampling | None:
        do_sample = params.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            raise InvalidInput(f'"do_sample" must be true or false, got {do_sample!r}')
        temperature = _number(params, "temperature", 0.0, math.inf, low_open=False)
        top_k = params.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise InvalidInput(f'"top_k" must be a non-negative integer (0: off), got {top_k!r}')
        top_p = _number(params, "top_p", 0.0, 1.0, low_open=True)
        seed = params.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
            raise InvalidInput(f'"seed" must be an integer in [0, 2**63 - 1], got {seed!r}')
        given = [key for key in SAMPLING_KEYS if params.get(key) is not None]
        if do_sample is False and given:
            raise InvalidInput(f"{', '.join(given)} apply only to sampling; drop them or set do_sample: true")
        if temperature == 0.0:
            if do_sample:
                raise InvalidInput('"temperature": 0 means greedy decoding; with do_sample: true use a positive one')
            return None
        if not (do_sample if do_sample is not None else bool(given) or bool(self._defaults.do_sample)):
            return None
        defaults = self._defaults
        return Sampling(
            temperature=temperature if temperature is not None else float(defaults.temperature or 1.0),
            top_k=top_k if top_k is not None else int(defaults.top_k or 0),
            top_p=top_p if top_p is not None else float(defaults.top_p or 1.0),
            seed=seed if seed is not None else secrets.randbits(63))

    def preprocess(self, requests: Sequence[GenerationRequest]) -> Encoded:
        return Encoded({}, tuple(requests))

    # -- the decode loop -----------------------------------------------------------------------------------

    def run(self, served: Served, encoded: Encoded, emit: Emit | None) -> list[Completion]:
        requests: tuple[GenerationRequest, ...] = encoded.extras
        completions: list[Completion] = []
        start = 0
        for chunk in self._chunks(requests, served.shapes.max_batch):
            rows, cache_length = served.shapes.serving_shape(len(chunk), cache_needed(chunk))
            batch = self._batch(chunk, rows, cache_length)
            stream = None if emit is None else (
                lambda pieces, start=start: emit({start + row: piece for row, piece in pieces.items()}))
            completions.extend(self._generate(served.forward_step, batch, stream)[:len(chunk)])
            start += len(chunk)
        return completions

    def _chunks(self, requests: Sequence[GenerationRequest], size: int) -> list[list[GenerationRequest]]:
        """Consecutive requests decoded together: at most ``size``, and only while the longest prompt (all are
        left-padded to it) plus the most new tokens still fit ``max_length``."""
        chunks: list[list[GenerationRequest]] = []
        for request in requests:
            if chunks and len(chunks[-1]) < size and cache_needed([*chunks[-1], request]) <= self.max_length:
                chunks[-1].append(request)
            else:
                chunks.append([request])
        return chunks

    def prove(self, forward: Forward, batch: GenerationBatch) -> torch.Tensor:
        """Greedy tokens of every warmup row, as one (rows, WARMUP_NEW_TOKENS) tensor."""
        completions = self._generate(forward, batch, None)
        return torch.tensor([completion.token_ids for completion in completions])

    def warmup_batches(self, shapes: Sequence[tuple[int, int]]) -> list[GenerationBatch]:
        """Greedy prompts of different lengths in each (batch, cache length) bucket, run to the end."""
        batches = []
        for rows, cache_length in shapes:
            requests = []
            for row in range(rows):
                ids = tuple(self.tokenizer(self._words(3 + 4 * row))["input_ids"])
                ids = ids[:max(1, cache_length - WARMUP_NEW_TOKENS)]
                requests.append(GenerationRequest(self.tokenizer.decode(ids), ids, WARMUP_NEW_TOKENS, ignore_eos=True))
            batches.append(self._batch(requests, rows, cache_length))
        return batches

    def _batch(self, requests: Sequence[GenerationRequest], rows: int, cache_length: int) -> GenerationBatch:
        padded = tuple(requests) + (requests[0],) * (rows - len(requests))
        longest = max(len(request.prompt_ids) for request in padded)
        input_ids = torch.full((rows, longest), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, longest), dtype=torch.long)
        for row, request in enumerate(padded):
            if request.prompt_ids:
                input_ids[row, -len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
                attention_mask[row, -len(request.prompt_ids):] = 1
        return GenerationBatch(input_ids, attention_mask, padded, len(requests), cache_length)

    def _cache(self, rows: int, cache_length: int) -> transformers.StaticCache:
        """One static cache per bucket, kept: the compiled step is specialized to its tensors."""
        key = (rows, cache_length)
        if key not in self._caches:
            self._caches[key] = static_cache(self._model_config, cache_length)
        cache = self._caches[key]
        cache.reset()
        return cache

    def _generate(self, step: Forward, batch: GenerationBatch,
                  emit: Emit | None) -> list[Completion]:
        rows, prompt_length = batch.input_ids.shape
        device = next(self._step.parameters()).device
        completions = [Completion(request, self.tokenizer, self._eos_ids,
                                  watch=row < batch.real and (request.stream or bool(request.stop)))
                       for row, request in enumerate(batch.requests)]
        generators = [torch.Generator().manual_seed(request.sampling.seed) if request.sampling else None
                      for request in batch.requests]
        with torch.inference_mode():
            cache = self._cache(rows, batch.cache_length)
            mask = torch.zeros((rows, batch.cache_length), dtype=torch.long, device=device)
            mask[:, :prompt_length] = batch.attention_mask
            positions = (batch.attention_mask.cumsum(dim=1) - 1).clamp(min=0).to(device)
            # The prefill runs eagerly: its shape changes with every prompt, and it runs once per batch.
            logits = self._step(attention_mask=mask, input_ids=batch.input_ids.to(device), position_ids=positions,
                                cache_position=torch.arange(prompt_length, device=device), cache=cache)
            next_position = positions[:, -1:] + 1
            for index in range(max(request.max_new_tokens for request in batch.requests[:batch.real])):
                tokens = self._pick(logits, batch.requests, generators)
                chunks = {}
                for row, (completion, token) in enumerate(zip(completions, tokens.tolist(), strict=True)):
                    if completion.done:
                        continue
                    text = completion.add(token)
                    if emit is not None and row < batch.real and completion.request.stream:
                        chunks[row] = {"token_id": token, "text": text}
                if chunks:
                    emit(chunks)
                if all(completion.done for completion in completions[:batch.real]):
                    break
                position = prompt_length + index
                mask[:, position] = 1
                logits = step(attention_mask=mask, input_ids=tokens.unsqueeze(1).to(device),
                              position_ids=next_position, cache_position=torch.tensor([position], device=device),
                              cache=cache)
                next_position = next_position + 1
        return completions

    @staticmethod
    def _pick(logits: torch.Tensor, requests: Sequence[GenerationRequest],
              generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """The next token per row: the argmax, or a draw from the row's own seeded generator (so a seeded
        request gets the same tokens whatever else is in its batch)."""
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1)
        for row, (request, generator) in enumerate(zip(requests, generators, strict=True)):
            if request.sampling is not None:
                tokens[row] = sample(logits[row], request.sampling, generator)
        return tokens

    def postprocess(self, outputs: list[Completion], encoded: Encoded,
                    requests: Sequence[GenerationRequest]) -> list[Any]:
        answers = []
        for completion, request in zip(outputs, requests, strict=True):
            answer: dict[str, Any] = {
                "generated_text": (request.prompt if request.return_full_text else "") + completion.text}
            if request.details:
                answer["details"] = {
                    "finish_reason": completion.finish_reason, "prompt_tokens": len(request.prompt_ids),
                    "generated_tokens": len(completion.token_ids), "token_ids": completion.token_ids,
                    "seed": request.sampling.seed if request.sampling else None}
            answers.append([answer])
        return answers


def _number(params: Mapping[str, Any], key: str, low: float, high: float, low_open: bool) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or value != value or (value <= low if low_open else value < low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidInput(f'"{key}" must be a number in {bounds}, got {value!r}')
    return float(value)


def _flag(params: Mapping[str, Any], key: str, default: bool) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f'"{key}" must be true or false, got {value!r}')
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP_STRINGS
            or not all(isinstance(stop, str) and 0 < len(stop) <= MAX_STOP_LENGTH for stop in stops)):
        raise InvalidInput(f'"stop" must be a string or a list of 1 to {MAX_STOP_STRINGS} non-empty strings of at '
                           f"most {MAX_STOP_LENGTH} characters, got {value!r}")
    return tuple(stops)
