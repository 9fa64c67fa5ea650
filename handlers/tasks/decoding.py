"""The pieces of a decode loop: a request's parameters, a batch of left-padded prompts, the decode step the ladder
compiles (the causal LM over new tokens against a static KV cache), one row's completion as its tokens arrive, and
sampling. ``handlers.tasks.generation`` runs them.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers

logger = logging.getLogger(__name__)

NOT_FINAL = "\ufffd"  # what a token ending inside a multi-byte character decodes to, until the next one


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    seed: int

@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling | None = None  # None: greedy
    stop: tuple[str, ...] = ()
    return_full_text: bool = True
    details: bool = False
    stream: bool = False
    ignore_eos: bool = False  # warmup only: every warmup prompt runs all its decode steps

@dataclass(frozen=True)
class GenerationBatch:
    """Rows of prompts, left-padded, and the static cache length they decode in. Rows past ``real`` pad the
    batch up to its bucket (they repeat the first request) and are never answered."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    requests: tuple[GenerationRequest, ...]
    real: int
    cache_length: int

    def __str__(self) -> str:
        return f"{len(self.requests)}x{self.cache_length}"

class DecodeStep(torch.nn.Module):
    """The causal LM over new tokens: appends their keys and values to the static cache (which counts its own
    positions, in a tensor) and returns the float logits at each row's last position. The prefill runs it
    eagerly over the prompts, the decode loop compiled over one token per row."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        declared = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache (the old name goes in 5.40). A model that does not
        # declare cache would swallow it in **kwargs and decode without its past, so ask the signature.
        self.cache_keyword = "cache" if "cache" in declared else "past_key_values"
        # Earlier models write the cache at cache_position; later ones count positions in the cache itself.
        self.takes_cache_position = "cache_position" in declared

    def forward(self, attention_mask: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache_position: torch.Tensor, cache: transformers.Cache) -> torch.Tensor:
        extra = {"cache_position": cache_position} if self.takes_cache_position else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache}, **extra,
                          ).logits[:, -1].float()

class Completion:
    """One row's generated tokens and text, and what of it has been streamed."""

    def __init__(self, request: GenerationRequest, tokenizer: Any, eos_ids: frozenset[int], watch: bool):
        self.request = request
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = ""  # the text streamed so far: always a prefix of the final text
        self.finish_reason: str | None = None  # length | eos | stop
        self._tokenizer = tokenizer
        self._eos = frozenset() if request.ignore_eos else eos_ids
        self._watch = watch  # decode every step (to stream or to look for stop strings), not only at the end

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> str:
        """Take the next token; return the text that became final with it (what a stream sends now)."""
        self.token_ids.append(token)
        if token in self._eos:
            self.finish_reason = "eos"
        elif len(self.token_ids) >= self.request.max_new_tokens:
            self.finish_reason = "length"
        if not (self._watch or self.done):
            return ""
        text = self._tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((index for index in (text.find(stop) for stop in self.request.stop) if index >= 0), default=None)
        if cut is not None:
            text, self.finish_reason = text[:cut], "stop"
        self.text = text
        ready = text if self.done else self._settled(text)
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            if self.done and not text.startswith(self.sent):
                logger.warning("streamed text is not a prefix of the final text; the stream and answer differ")
            return ""
        delta, self.sent = ready[len(self.sent):], ready
        return delta

    def _settled(self, text: str) -> str:
        """``text`` without what the next tokens may still change: a character not yet complete, and an ending
        that may be the start of a stop string (the answer leaves stop strings out)."""
        end = len(text.rstrip(NOT_FINAL))
        held = 0
        for stop in self.request.stop:
            for length in range(min(len(stop) - 1, end), held, -1):
                if text[end - length:end] == stop[:length]:
                    held = length
                    break
        return text[:end - held]

def static_cache(config: Any, cache_length: int) -> transformers.StaticCache:
    """transformers' static cache for ``config``, its sliding-window layers made full-length static layers.

    A sliding layer counts its length in a Python int, which dynamo guards on: every decode step would compile
    a new graph until the recompile limit, and then run eagerly. A full-length layer counts in a tensor; the
    sliding-window *mask*, built from the config as before, still keeps each query to its window, so the tokens
    are the same (the keys past the window are kept but masked). It holds cache_length positions instead of
    the window's, as full layers do. Chunked-attention layers use the same class and are swapped too: their
    chunks are masks as well (only sliding windows are tested here)."""
    cache = transformers.StaticCache(config=config, max_cache_len=cache_length)
    cache.layers = [transformers.StaticLayer(max_cache_len=cache_length)
                    if type(layer) is transformers.StaticSlidingWindowLayer else layer  # not its hybrid subclasses
                    for layer in cache.layers]
    return cache

def cache_needed(requests: Sequence[GenerationRequest]) -> int:
    """KV cache positions a batch needs: its longest prompt, left-padded, then its most new tokens."""
    return max(len(r.prompt_ids) for r in requests) + max(r.max_new_tokens for r in requests)

def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One draw after temperature, top-k and top-p (nucleus), in the order transformers applies them."""
    scores = logits.double() / sampling.temperature  # float64: a tiny temperature stays finite far longer
    if not scores.isfinite().all():  # a temperature so small that sampling is greedy (its limit)
        scores = torch.full_like(scores, -math.inf).index_fill_(0, logits.argmax(), 0.0)
    if 0 < sampling.top_k < scores.numel():
        scores = scores.masked_fill(scores < scores.topk(sampling.top_k).values[-1], -math.inf)
    if sampling.top_p < 1.0:
        ordered, order = scores.sort()
        tail = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - sampling.top_p
        tail[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(tail.scatter(0, order, tail), -math.inf)
    return int(torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).item())
