"""How an embeddings model turns its token states into one vector per text, as sentence-transformers does for it.

A sentence-transformers model says so in its directory: ``modules.json`` lists its modules (a Transformer, a Pooling
module, often a Normalize module), and the Pooling module's ``config.json`` names the pooling mode(s). BGE and
arctic-embed take the CLS token, all-MiniLM and E5 the mean, decoder embedders the last token; a mean where the model
was trained on CLS answers vectors that look fine and retrieve badly. So the served embedding follows the directory,
and a model with a module this does not compute (a Dense projection, a word-embedding model) is refused at load rather
than served without it. A directory without ``modules.json`` (a plain ``save_pretrained``) gets the mean over the
attention mask, L2-normalised: what pt2-handlers has always served there.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.errors import ModelLoadError


class Mode(str, enum.Enum):
    """sentence-transformers' pooling modes, by the names its config uses."""

    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    WEIGHTED_MEAN = "weightedmean"
    LAST_TOKEN = "lasttoken"


# The older config format: one flag per mode, concatenated in this order when several are on.
LEGACY_FLAGS = {"pooling_mode_cls_token": Mode.CLS, "pooling_mode_max_tokens": Mode.MAX,
                "pooling_mode_mean_tokens": Mode.MEAN, "pooling_mode_mean_sqrt_len_tokens": Mode.MEAN_SQRT_LEN,
                "pooling_mode_weightedmean_tokens": Mode.WEIGHTED_MEAN, "pooling_mode_lasttoken": Mode.LAST_TOKEN}
# The modules.json types served (by their class name: the module path moved between sentence-transformers versions).
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True)
class Pooling:
    modes: tuple[Mode, ...] = (Mode.MEAN,)  # several: their vectors concatenated, in this order
    normalize: bool = True  # L2, as sentence-transformers' Normalize module
    source: str = "no modules.json in the model directory: the mean over the attention mask, L2-normalised"

    def __call__(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        vectors = [_pool(mode, hidden, attention_mask) for mode in self.modes]
        pooled = vectors[0] if len(vectors) == 1 else torch.cat(vectors, dim=-1)
        return torch.nn.functional.normalize(pooled, p=2, dim=1) if self.normalize else pooled

    def describe(self) -> dict[str, Any]:
        return {"modes": [mode.value for mode in self.modes], "normalize": self.normalize, "from": self.source}

    def summary(self) -> str:
        """One line for logs: ``cls, L2-normalised (1_Pooling/config.json and modules.json ...)``."""
        return (f"{'+'.join(mode.value for mode in self.modes)}, "
                f"{'L2-normalised' if self.normalize else 'not normalised'} ({self.source})")


# What a directory without modules.json gets (a plain save_pretrained).
MEAN_NORMALIZED = Pooling()


def _pool(mode: Mode, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One mode's vector per row, computed as sentence-transformers' Pooling module does on padded batches."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode in (Mode.MEAN, Mode.MEAN_SQRT_LEN):
        count = mask.sum(dim=1).clamp(min=1e-9)
        return (hidden * mask).sum(dim=1) / (count if mode is Mode.MEAN else count.sqrt())
    if mode is Mode.MAX:
        return hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    if mode is Mode.CLS:  # the first attended token: position 0, or past the padding on the left
        return _gather(hidden, attention_mask.to(torch.int32).argmax(dim=1))
    if mode is Mode.LAST_TOKEN:  # the last attended token, wherever the padding is
        values, from_end = attention_mask.flip(1).max(dim=1)
        from_end = torch.where(values == 0, hidden.shape[1] - 1, from_end)
        return _gather(hidden * mask, hidden.shape[1] - 1 - from_end)
    # weighted mean: the i-th attended token weighs i
    weights = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
    weights = mask * (weights - attention_mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1).to(hidden.dtype))
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _gather(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    index = positions.to(torch.int64).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
    return torch.gather(hidden, 1, index).squeeze(1)


def read(model_dir: Path) -> Pooling:
    """The model's pooling from its sentence-transformers files; ModelLoadError naming the file for one this cannot
    serve as sentence-transformers would."""
    listed = model_dir / "modules.json"
    if not listed.is_file():
        return MEAN_NORMALIZED
    modules = _json(listed)
    if not isinstance(modules, list) or not all(isinstance(entry, dict) for entry in modules):
        raise ModelLoadError(f"{listed} is not a list of modules, as sentence-transformers writes it")
    kinds = [(str(entry.get("type", "")).rsplit(".", 1)[-1], str(entry.get("path", ""))) for entry in modules]
    others = [f"{entry.get('type')} ({entry.get('path') or 'the model directory'})"
              for entry, (kind, _) in zip(modules, kinds, strict=True) if kind not in (TRANSFORMER, POOLING, NORMALIZE)]
    if others:
        raise ModelLoadError(f"{listed} lists {', '.join(others)}: pt2-handlers computes a Transformer, Pooling and "
                             "Normalize only, so its embeddings would not be this model's")
    paths = [path for kind, path in kinds if kind == POOLING]
    if len(paths) != 1:
        raise ModelLoadError(f"{listed} lists {len(paths)} Pooling modules; an embedding model has one")
    config_file = model_dir / paths[0] / "config.json"
    if not config_file.resolve().is_relative_to(model_dir.resolve()) or not config_file.is_file():
        raise ModelLoadError(f"{listed} names a Pooling module at {paths[0]!r}, which has no config.json in the "
                             "model directory")
    modes = _modes(_json(config_file), config_file)
    normalize = any(kind == NORMALIZE for kind, _ in kinds)
    return Pooling(modes, normalize, f"{config_file.relative_to(model_dir)} and modules.json (sentence-transformers)")


def _modes(config: Any, config_file: Path) -> tuple[Mode, ...]:
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object")
    named = config.get("pooling_mode")
    if named is None:  # the older format's flags; none on means the mean, as sentence-transformers reads it
        return tuple(mode for flag, mode in LEGACY_FLAGS.items() if config.get(flag)) or (Mode.MEAN,)
    names = [named] if isinstance(named, str) else named
    known = {mode.value: mode for mode in Mode}
    if not isinstance(names, list) or not names or not all(isinstance(name, str) and name in known for name in names):
        raise ModelLoadError(f"{config_file}: pooling_mode {named!r} is not one of {', '.join(known)}")
    return tuple(known[name] for name in names)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
