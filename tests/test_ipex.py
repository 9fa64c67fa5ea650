"""The IPEX rung for real, in the ipex profile (torch 2.8 + intel-extension-for-pytorch 2.8): ipex.optimize in
fp32 and bf16 through warmup + the quality gate, torch.compile(backend="ipex"), and its failures going to the
next rung with the reason. Elsewhere these tests are deselected (conftest says why); scripts/test.sh runs
them in the ipex profile's venv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.engine import Engine
from handlers.hardware import linux_cpu_flags

pytestmark = pytest.mark.ipex

TEXTS = ["TorchServe makes serving easy.", "IPEX optimizes the linear layers.", "short", "the cat sat " * 20]
SHAPES = {"batch_sizes": [1, 2], "seq_lengths": [16, 64]}


def engine_for(model_dir: Path, compile_section=None, shapes=SHAPES, **settings) -> Engine:
    raw = {"pt2": {"compile": compile_section or {"enable": False}},
           "pt2_handlers": {"model_dir": str(model_dir), "shapes": shapes, **settings}}
    engine = Engine(load_config(json.loads(json.dumps(raw))), Path("/"), torch.device("cpu"), "ipex-test")
    engine.load()
    return engine


def attempts_of(engine: Engine) -> dict[str, dict]:
    return {a["rung"]: a for a in engine.describe()["optimization"]["attempts"]}


def embeddings(engine: Engine, texts: list[str]) -> torch.Tensor:
    return torch.tensor(engine.predict([{"inputs": texts}])[0]["embeddings"])


@pytest.mark.slow
def test_minilm_through_the_ipex_rung_equals_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    engine = engine_for(minilm_dir, ladder=["ipex", "eager"], dtype="float32")
    optimization = engine.describe()["optimization"]
    assert optimization["active"] == "ipex", optimization["attempts"]
    ipex = attempts_of(engine)["ipex"]
    assert ipex["status"] == "accepted" and ipex["dtype"] == "float32"
    assert ipex["quality"]["value"] >= ipex["quality"]["threshold"] == 0.9999
    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, normalize_embeddings=True,
                                                                      convert_to_tensor=True).cpu()
    cosine = torch.nn.functional.cosine_similarity(embeddings(engine, TEXTS), want, dim=1)
    assert cosine.min().item() >= 0.9999, cosine
    assert engine.runtime_failures == 0


def test_ipex_bf16_is_accepted_only_through_the_gate(tiny_bert_dir):
    """bf16 is what dtype auto picks on AMX / AVX512-BF16 CPUs; forced here so every CPU runs the path. IPEX
    prepacks bf16 weights only with avx512bw/vl/dq or avx_ne_convert; without them optimize raises, and the
    reason goes into describe while fp32 eager serves."""
    engine = engine_for(tiny_bert_dir, ladder=["ipex", "eager"], dtype="bfloat16")
    ipex = attempts_of(engine)["ipex"]
    assert ipex["dtype"] == "bfloat16"
    flags = linux_cpu_flags()
    if {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags:
        assert ipex["quality"]["threshold"] == 0.999
        if ipex["status"] == "accepted":
            assert ipex["quality"]["value"] >= 0.999 and engine.describe()["optimization"]["active"] == "ipex"
        else:  # only the gate may refuse it here
            assert ipex["status"] == "failed" and "min_cosine" in ipex["reason"], ipex
    else:
        assert ipex["status"] == "failed" and "BF16 weight prepack needs the cpu support" in ipex["reason"], ipex
    fp32 = engine_for(tiny_bert_dir, ladder=["eager"], dtype="float32")
    cosine = torch.nn.functional.cosine_similarity(embeddings(engine, TEXTS), embeddings(fp32, TEXTS), dim=1)
    assert cosine.min().item() >= 0.999, cosine


def test_torch_compile_with_the_ipex_backend(tiny_bert_dir):
    # One static shape: the ipex backend traces and freezes each shape with TorchScript (~20 s apiece here).
    one_shape = {"policy": "buckets", "batch_sizes": [4], "seq_lengths": [64]}
    engine = engine_for(tiny_bert_dir, {"enable": True, "backend": "ipex", "dynamic": False}, shapes=one_shape,
                        ladder=["compile", "eager"], dtype="float32")
    optimization = engine.describe()["optimization"]
    assert optimization["active"] == "compile", optimization["attempts"]
    assert optimization["requested_compile"]["backend"] == "ipex"
    assert "ipex" in torch._dynamo.list_backends(exclude_tags=())
    fp32 = engine_for(tiny_bert_dir, ladder=["eager"], dtype="float32")
    torch.testing.assert_close(embeddings(engine, TEXTS), embeddings(fp32, TEXTS), atol=1e-4, rtol=1e-3)


def test_ipex_optimize_raising_goes_to_the_next_rung(tiny_bert_dir, monkeypatch):
    """Fault injection into the real library: ipex.optimize raises, eager serves, the reason is kept."""
    import intel_extension_for_pytorch as ipex

    def broken_optimize(*args, **kwargs):
        raise RuntimeError("injected: ipex.optimize failed")

    monkeypatch.setattr(ipex, "optimize", broken_optimize)
    engine = engine_for(tiny_bert_dir, ladder=["ipex", "eager"], dtype="float32")
    ipex_attempt = attempts_of(engine)["ipex"]
    assert ipex_attempt["status"] == "failed" and "injected: ipex.optimize failed" in ipex_attempt["reason"]
    assert engine.describe()["optimization"]["active"] == "eager"
    assert len(embeddings(engine, TEXTS)) == len(TEXTS)


def test_ipex_answers_that_drift_fail_the_gate(tiny_bert_dir, monkeypatch):
    """Fault injection: the IPEX-optimized module runs for real, then its embeddings are rotated (what a
    miscompiled kernel looks like to a client). The gate refuses the rung with the measured value."""
    import intel_extension_for_pytorch as ipex

    real_optimize = ipex.optimize

    def drifting_optimize(model, *args, **kwargs):
        optimized = real_optimize(model, *args, **kwargs)
        optimized.register_forward_hook(lambda module, inputs, output: torch.roll(output, 1, dims=-1))
        return optimized

    monkeypatch.setattr(ipex, "optimize", drifting_optimize)
    engine = engine_for(tiny_bert_dir, ladder=["ipex", "eager"], dtype="float32")
    ipex_attempt = attempts_of(engine)["ipex"]
    assert ipex_attempt["status"] == "failed" and "min_cosine" in ipex_attempt["reason"], ipex_attempt
    assert ipex_attempt["quality"]["value"] < ipex_attempt["quality"]["threshold"]
    assert engine.describe()["optimization"]["active"] == "eager"
