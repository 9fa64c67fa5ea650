"""What one load measured, kept for the next: small JSON records beside the compile cache.

A worker's load measures things that take seconds and may come out differently under load: which layers int8 can
take (``handlers.precision.sensitivity``) and which precision is faster here (``handlers.ladder.race``). Workers of one
model that decide differently serve different precisions, and an added worker that picks the precision no one compiled
misses the compile cache. So a decision is kept under a ``fingerprint`` of everything it depends on, and a restarted or
added worker reads it instead of measuring again. A record read here is a proposal, never a verdict on answers:
the gate still judges every model built from it. Reading or writing never fails a load.

Pure Python + torch; no TorchServe import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from handlers.ladder.attempts import shape_of, summarize

logger = logging.getLogger(__name__)

Kept = TypeVar("Kept")  # a decision an earlier load kept, parsed

# The directory under the compile cache (``pt2_handlers.compile_cache``) that holds the records.
DIRECTORY = "pt2-handlers-memory"


@dataclass(frozen=True)
class DecisionStore:
    """Records kept between loads, one JSON file per key in ``directory``."""

    directory: Path

    def recall(self, key: str) -> dict[str, Any] | None:
        """The record kept under ``key``; None if there is none or it cannot be read (then the load measures)."""
        try:
            saved = json.loads((self.directory / f"{key}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("the remembered record %s cannot be read (%s); measuring again", key, exc)
            return None
        return saved if isinstance(saved, dict) else None

    def keep(self, key: str, record: Mapping[str, Any]) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # Whole or not at all, with workers loading side by side: each writes its own file, then renames it.
            partial = self.directory / f".{key}.{os.getpid()}.partial"
            partial.write_text(json.dumps(record), encoding="utf-8")
            partial.replace(self.directory / f"{key}.json")
        except OSError as exc:
            logger.warning("a measurement cannot be kept in %s (%s); the next load measures again", self.directory,
                           exc)


def fingerprint(*said: object, tensors: Iterable[tuple[str, torch.Tensor]] = ()) -> str:
    """A key for what a decision depends on: ``tensors`` (weights, batches: names, shapes, dtypes and bytes) and what
    else is ``said`` (layer names, the gate, the machine), with torch's version."""
    digest = hashlib.sha256(repr((torch.__version__, said)).encode())
    for name, tensor in tensors:
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def batch_tensors(batches: Iterable[Any]) -> Iterable[tuple[str, torch.Tensor]]:
    """The named tensors of mapping batches (a task's own batch type counts by its ``repr``, in ``said``)."""
    for batch in batches:
        if isinstance(batch, Mapping):
            yield from ((name, tensor) for name, tensor in batch.items() if isinstance(tensor, torch.Tensor))


class Decisions:
    """The decisions kept about one reference model: their keys hash its weights (once) and the batches they were
    measured on; a record this version cannot parse is measured again."""

    def __init__(self, store: DecisionStore | None, reference: torch.nn.Module, run: Callable[..., Any]):
        self.store = store
        self._reference = reference
        self._run = getattr(run, "__qualname__", type(run).__name__)
        self.weights_key: str | None = None  # hashed on the first key asked for

    def key(self, *said: object, batches: Sequence[Any]) -> str:
        """The key of a decision about this model on ``batches`` that depends on ``said`` too."""
        if self.weights_key is None:
            self.weights_key = fingerprint(tensors=self._reference.state_dict().items())
        return fingerprint(self.weights_key, self._run, said, [shape_of(batch) for batch in batches],
                           tensors=batch_tensors(batches))

    def recall(self, key: str, parse: Callable[[Mapping[str, Any]], Kept]) -> Kept | None:
        """What an earlier load kept under ``key``, parsed; None where nothing (readable) was kept."""
        kept = self.store.recall(key) if self.store else None
        if kept is None:
            return None
        try:
            return parse(kept)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.warning("the remembered record %s is not what this version keeps (%s); measuring again", key,
                           summarize(exc))
            return None

    def keep(self, key: str, record: Mapping[str, Any]) -> None:
        if self.store:
            self.store.keep(key, record)

