"""A real torch.compile of the real all-MiniLM-L6-v2 on CPU, configured by the shipped model YAML:
it must pass warmup + the quality gate, be the active rung, and match sentence-transformers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from handlers.config import load_config
from handlers.cpu import fused_attention
from handlers.serving.engine import Engine
from tests.test_precision import auto_served

REPO = Path(__file__).resolve().parent.parent
SHIPPED_YAML = REPO / "model_configs" / "minilm-embeddings.yaml"
# Once: the ipex profile proves the same compile of the shipped YAML through TorchServe (tests/test_torchserve.py:
# describe and the embeddings against sentence-transformers), and under torch 2.8 each costs a cold compile (~90 s).
pytestmark = pytest.mark.default_profile
TEXTS = ["TorchServe makes serving easy.", "A compiled model answers faster.", "short", "the cat sat on the mat " * 8]


@pytest.fixture(scope="module")
def compiled_engine(minilm_dir):
    raw = yaml.safe_load(SHIPPED_YAML.read_text())
    shipped = copy.deepcopy(raw)
    raw["pt2_handlers"]["model_dir"] = str(minilm_dir)
    # The requested compile alone: the shipped ladder races openvino against it (tests/test_torchserve.py serves it)
    raw["pt2_handlers"]["ladder"] = ["compile", "safe_compile", "ipex", "eager"]
    # A worker serves one model: graphs that earlier tests' MiniLM engines left on the same frames would count
    # towards dynamo's recompile limit and fail this compile when the tests run in another order.
    torch._dynamo.reset()
    engine = Engine(load_config(raw), Path("/"), torch.device("cpu"), "minilm")
    engine.load()
    assert yaml.safe_load(SHIPPED_YAML.read_text()) == shipped
    return engine


@pytest.mark.slow
def test_requested_compile_is_proven_and_active(compiled_engine):
    optimization = compiled_engine.describe()["optimization"]
    assert optimization["active"] == "compile"
    (first,) = [a for a in optimization["attempts"] if a["status"] == "accepted"]
    tried = optimization["precisions"]["tried_in_order"]
    assert (first["rung"], first["dtype"]) == ("compile", auto_served(optimization, tried))  # bf16 where it pays
    assert first["seconds"] > 0
    assert optimization["requested_compile"]["mode"] == "reduce-overhead"
    assert first["quality"]["value"] >= first["quality"]["threshold"]
    # On an AVX-512 CPU the graphs run the fused attention kernel; the gate above judged them against SDPA's fp32.
    unavailable = fused_attention.unavailable_here()
    expected = fused_attention.IMPLEMENTATION if unavailable is None else "sdpa"
    assert optimization["attention"]["kernel"] == expected, optimization["attention"]
    assert unavailable is None or optimization["attention"]["reason"] == unavailable


@pytest.mark.slow
def test_compiled_embeddings_equal_sentence_transformers(compiled_engine, minilm_dir):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, normalize_embeddings=True,
                                                                      convert_to_tensor=True)
    answers = compiled_engine.predict([{"inputs": TEXTS[:2]}, {"text": TEXTS[2]}, TEXTS[3]])
    got = torch.tensor(answers[0]["embeddings"] + [answers[1]["embedding"], answers[2]["embedding"]])
    cosine = torch.nn.functional.cosine_similarity(got, want.cpu(), dim=1)
    assert cosine.min().item() >= 0.999, cosine  # the gate's bar for bf16 (dtype auto) against fp32
    assert compiled_engine.runtime_failures == 0
