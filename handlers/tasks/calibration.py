"""What int8 is calibrated on, and the held-out texts it is judged on besides the warmup batches.

Static int8 fixes one scale per activation from the texts it is calibrated on. Judged on those same texts, it
looks better than it serves (MiniLM: cosine 0.9957 on its calibration texts, 0.9899 on the benchmark's), so the
gate also judges int8 on texts it was not calibrated on. By default int8 is calibrated on the warmup batches and
judged on them and on a seeded sample of texts of the tokenizer's whole words (``held_out_sample``); with the
archive's calibration file (``pt2_handlers.int8_calibration``: one text per line, what the model will be sent),
on all but every ``HELD_OUT_EVERY``-th line, and judged on those (``from_texts``). Which calibration does best on
held-out texts: docs/ladder.md (int8).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from handlers.errors import ModelLoadError
from handlers.ladder import Calibration
from handlers.tasks.base import WARMUP_WORDS

HELD_OUT_EVERY = 4  # of a calibration file's texts, every 4th is judged on and never calibrated on
SAMPLE_SEED = 0  # the same held-out texts on every load: the same gate value
MARKERS = ("▁", "Ġ")  # how SentencePiece and byte-level BPE vocabularies mark a word's start


class Batches(Protocol):
    tokenizer: Any
    max_length: int

    def warmup_batches(self, shapes: Sequence[tuple[int, int]],
                       texts: Sequence[str] | None = None) -> list[dict[str, torch.Tensor]]: ...

    def text_batches(self, texts: Sequence[str], batch_size: int) -> list[dict[str, torch.Tensor]]: ...


def read_texts(model_root: Path, relative: str) -> list[str]:
    """The calibration file's texts, one per non-empty line; it must be inside the archive and hold at least
    ``HELD_OUT_EVERY`` texts (some to calibrate on, one held out)."""
    path = (model_root / relative).resolve()
    if not path.is_relative_to(model_root.resolve()):
        raise ModelLoadError(f"pt2_handlers.int8_calibration {relative!r} leads outside the model archive "
                             f"({model_root}); name a file inside it, e.g. calibration.txt")
    try:
        texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"pt2_handlers.int8_calibration {relative!r} cannot be read as UTF-8 text: "
                             f"{exc}") from None
    if len(texts) < HELD_OUT_EVERY:
        raise ModelLoadError(f"pt2_handlers.int8_calibration {relative!r} holds {len(texts)} text(s); int8 needs at "
                             f"least {HELD_OUT_EVERY}, one per line, like those the model will be sent")
    return texts


def from_texts(task: Batches, shapes: Sequence[tuple[int, int]], texts: Sequence[str], source: str) -> Calibration:
    """Calibrate on all but every ``HELD_OUT_EVERY``-th text; judge on those, at the warmup ``shapes``."""
    held_out = [text for index, text in enumerate(texts) if index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    fit = [text for index, text in enumerate(texts) if index % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    batch_size = max(size for size, _ in shapes)
    return Calibration(task.text_batches(fit, batch_size), task.warmup_batches(shapes, held_out),
                       f"{len(fit)} texts of {source}", f"the other {len(held_out)} texts of {source}")


def held_out_sample(task: Batches, shapes: Sequence[tuple[int, int]], warmup: Sequence[Any]) -> Calibration:
    """Calibrate on the ``warmup`` batches; judge on texts of whole words drawn from the tokenizer's vocabulary
    (seeded: the same texts, the same gate value on every load), ``max_length`` words long, one per row of the
    warmup ``shapes`` (each row cut to the warmup row's length)."""
    words = whole_words(task.tokenizer)
    rng = random.Random(SAMPLE_SEED)
    held_out = [" ".join(rng.choices(words, k=task.max_length)) for _ in range(sum(size for size, _ in shapes))]
    return Calibration(list(warmup), task.warmup_batches(shapes, held_out), "the warmup batches",
                       f"{len(held_out)} texts of the vocabulary's {len(words)} whole words (seed {SAMPLE_SEED})")


def whole_words(tokenizer: Any) -> list[str]:
    """The vocabulary's entries that are whole alphabetic words (WordPiece's ``word``, SentencePiece's ``▁word``,
    byte-level BPE's ``Ġword``), sorted; the warmup sentence's words where a vocabulary has none."""
    words = set()
    for token in tokenizer.get_vocab():
        word = token[1:] if token.startswith(MARKERS) else token
        if word.isascii() and word.isalpha() and 2 <= len(word) <= 12:
            words.add(word)
    if not words:
        words.update(WARMUP_WORDS)
    return sorted(words)
