"""Texts to padded model inputs through the tokenizer's Rust backend, without transformers' Python around it.

Why: in a serving worker, tokenizing runs right after a forward whose weights and OpenMP threads have pushed
everything else out of the CPU's caches, and there transformers' ``tokenizer(texts, ...)`` walks enough Python
(argument checks, ``BatchEncoding``, conversions) to cost 0.4-0.6 ms for one short text on a Zen 4 EPYC, against
0.06 ms warm; the backend's own ``encode_batch`` costs 0.13-0.19 ms there. The batch encoder is a copy of the backend,
configured once as transformers configures it for ``truncation=True, max_length=..., padding=True``, so its
answers are the same arrays (tests/test_batch_encoder.py checks them against transformers). ``WindowEncoder`` does
the same for question answering's windows over a (question, context) pair, its truncation set as each request's
window and stride ask."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Model input -> the backend Encoding's attribute that transformers reads for it.
ENCODING_FIELDS = {"input_ids": "ids", "token_type_ids": "type_ids", "attention_mask": "attention_mask"}
# What transformers runs for ``tokenizer(texts, ...)``: a tokenizer class that overrides any of them (CodeLlama's
# infilling, the translation tokenizers' input mode, LUKE's entities) does more than its backend, and keeps that path.
_CALL_PATH = ("__call__", "_get_padding_truncation_strategies", "_switch_to_input_mode", "set_truncation_and_padding",
              "_encode_plus", "_convert_encoding")


class BatchEncoder:
    """``encoder(texts)``: ``tokenizer(texts, truncation=True, max_length=max_length, padding=True)`` as tensors of
    the model's inputs; ``with_offsets`` adds the character offsets and special-tokens mask token classification
    reads."""

    def __init__(self, backend: Any, input_names: Sequence[str]):
        self._backend = backend
        self._fields = [(name, ENCODING_FIELDS[name]) for name in input_names]

    @classmethod
    def of(cls, tokenizer: Any, max_length: int) -> BatchEncoder | None:
        """The encoder for ``tokenizer``; None where transformers' call does more than the backend would (a slow
        tokenizer, one whose class changes the call, no padding token, an input other than ids, token types and
        attention mask) or where the backend cannot be copied (a custom Python pre-tokenizer)."""
        own = _own_backend(tokenizer)
        if own is None:
            return None
        own.enable_truncation(max_length=max_length, stride=0, strategy="longest_first",
                              direction=tokenizer.truncation_side)
        own.enable_padding(direction=tokenizer.padding_side, pad_id=tokenizer.pad_token_id,
                           pad_token=tokenizer.pad_token, pad_type_id=tokenizer.pad_token_type_id)
        return cls(own, tokenizer.model_input_names)

    def first_too_long(self, texts: Sequence[str]) -> int | None:
        """The index of the first text longer than ``max_length`` tokens (special tokens included): the first one
        the backend had to truncate. None when every text fits."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=True)
        return next((index for index, encoding in enumerate(encodings) if encoding.overflowing), None)

    def __call__(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        # encode_batch_fast: the same encodings of single texts without character offsets, which these inputs do not
        # need (8 texts of ~120 words: 1.09 -> 0.84 ms); not for pairs, whose second text's token types it leaves 0
        return self._inputs(self._backend.encode_batch_fast(list(texts), add_special_tokens=True))

    def with_offsets(self, texts: Sequence[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """As called, with each token's character span in its text ([rows, tokens, 2]; (0, 0) for the special tokens
        the tokenizer adds and for padding) and the special-tokens mask ([rows, tokens]; 1 for those): what
        ``return_offsets_mapping=True, return_special_tokens_mask=True`` add, read from the same encodings."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=True)
        offsets = np.array([encoding.offsets for encoding in encodings], dtype=np.int64).reshape(len(encodings), -1, 2)
        special = np.array([encoding.special_tokens_mask for encoding in encodings], dtype=np.int64)
        return self._inputs(encodings), torch.from_numpy(offsets), torch.from_numpy(special)

    def _inputs(self, encodings: Sequence[Any]) -> dict[str, torch.Tensor]:
        return {name: torch.from_numpy(np.array([getattr(encoding, field) for encoding in encodings], dtype=np.int64))
                for name, field in self._fields}


class WindowEncoder:
    """Question answering's windows: ``tokenizer(question, context, truncation="only_second", max_length=window,
    stride=stride, return_overflowing_tokens=True)`` as the backend's encodings (one per window, the first window
    first, as transformers lists them), and a batch of windows padded on the right as ``tokenizer.pad`` pads it."""

    def __init__(self, backend: Any, input_names: Sequence[str], truncation_side: str, pad_id: int, pad_type_id: int):
        self._backend = backend
        self._fields = [(name, ENCODING_FIELDS[name]) for name in input_names]
        self._truncation_side = truncation_side
        self._fill = {"ids": pad_id, "type_ids": pad_type_id, "attention_mask": 0}
        self._window: tuple[int, int] | None = None  # (max_length, stride) the backend truncates at now

    @classmethod
    def of(cls, tokenizer: Any) -> WindowEncoder | None:
        """As ``BatchEncoder.of``: None where transformers' call does more than the backend would."""
        own = _own_backend(tokenizer, also=("pad", "_pad"))  # pad() stands in for tokenizer.pad
        if own is None:
            return None
        own.no_padding()  # each window as long as its tokens; ``pad`` pads a batch
        return cls(own, tokenizer.model_input_names, tokenizer.truncation_side, tokenizer.pad_token_id,
                   tokenizer.pad_token_type_id)

    def windows(self, question: str, context: str, window: int, stride: int) -> list[Any]:
        """The pair's windows; the backend's exception where the question leaves no room for the context."""
        if self._window != (window, stride):  # the options of a request; the defaults stay set between requests
            self._backend.enable_truncation(max_length=window, stride=stride, strategy="only_second",
                                            direction=self._truncation_side)
            self._window = (window, stride)
        encoding = self._backend.encode(question, context, add_special_tokens=True)
        return [encoding, *encoding.overflowing]

    def pad(self, encodings: Sequence[Any]) -> dict[str, torch.Tensor]:
        """The windows as model inputs, each padded on the right to the longest."""
        longest = max(len(encoding.ids) for encoding in encodings)
        inputs = {}
        for name, field in self._fields:
            array = np.full((len(encodings), longest), self._fill[field], dtype=np.int64)
            for row, encoding in enumerate(encodings):
                values = getattr(encoding, field)
                array[row, : len(values)] = values
            inputs[name] = torch.from_numpy(array)
        return inputs


def _own_backend(tokenizer: Any, also: Sequence[str] = ()) -> Any | None:
    """A copy of ``tokenizer``'s Rust backend for the serving path to configure and call directly (transformers
    reconfigures the tokenizer's own on each call), with the tokenizer's special-token splitting; None where
    transformers' call does more than the backend would (or its class overrides one of ``also``, methods the caller
    stands in for) or the backend cannot be copied."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    own_call = [name for name in (*_CALL_PATH, *also)
                if getattr(type(tokenizer), name, None) is not getattr(TokenizersBackend, name, None)]
    if not isinstance(tokenizer, TokenizersBackend) or own_call:
        return None
    names = set(tokenizer.model_input_names)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id < 0 or not names or not names <= set(ENCODING_FIELDS):
        return None
    try:
        own = copy.deepcopy(tokenizer.backend_tokenizer)
    except Exception:  # noqa: BLE001 - e.g. "Custom PreTokenizer cannot be serialized": transformers' path then
        return None
    own.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return own
