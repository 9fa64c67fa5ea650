"""What int8 is calibrated on, and the held-out texts it is judged on besides the warmup batches.

Static int8 fixes one scale per activation from the texts it is calibrated on. Judged on those same texts, it
looks better than it serves (MiniLM: cosine 0.9957 on its calibration texts, 0.9899 on the benchmark's), so the
gate never judges int8 on a text it was calibrated on. The texts come from the archive's calibration file
(``pt2_handlers.int8_calibration``: one text per line, what the model will be sent), every ``HELD_OUT_EVERY``-th
line held out; or, without one, from a seeded sample of the tokenizer's whole words: a wider spread of tokens
than the warmup's one sentence, which gives wider scales (docs/ladder.md: int8).
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
SAMPLE_TEXTS = 32  # texts sampled from the vocabulary to calibrate on (about 2,500 words at MiniLM's 256 tokens)
SAMPLE_SEED = 0  # the same sample on every load: the same scales, the same gate value
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
    return _calibration(task, shapes, fit, held_out, source)


def vocabulary_sample(task: Batches, shapes: Sequence[tuple[int, int]]) -> Calibration:
    """``SAMPLE_TEXTS`` texts of whole words drawn from the tokenizer's vocabulary (seeded), of every length up to
    ``max_length``, to calibrate on; one more per row of the warmup shapes to hold out."""
    words = whole_words(task.tokenizer)
    rng = random.Random(SAMPLE_SEED)
    longest = max(2, task.max_length - 2)  # less the special tokens

    def sample(count: int) -> list[str]:
        return [" ".join(rng.choices(words, k=rng.randint(min(8, longest), longest))) for _ in range(count)]

    fit, held_out = sample(SAMPLE_TEXTS), sample(sum(size for size, _ in shapes))
    return _calibration(task, shapes, fit, held_out,
                        f"a sample of the vocabulary's {len(words)} whole words (seed {SAMPLE_SEED})")


def _calibration(task: Batches, shapes: Sequence[tuple[int, int]], fit: Sequence[str], held_out: Sequence[str],
                 source: str) -> Calibration:
    batch_size = max(size for size, _ in shapes)
    return Calibration(task.text_batches(fit, batch_size), task.warmup_batches(shapes, held_out),
                       f"{source}: {len(fit)} texts, {len(held_out)} more held out")


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
