"""The IPEX rung for real, in the ipex profile (torch 2.8 + intel-extension-for-pytorch 2.8): IPEX imports,
ipex.optimize in fp32 and bf16 through warmup + the quality gate, torch.compile(backend="ipex"), and its failures
going to the next rung with the reason. Elsewhere these tests are deselected (conftest says why); scripts/test.sh
runs them in the ipex profile's venv, where an IPEX that does not import fails the run (PT2_PROFILE=ipex)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.cpu.features import linux_cpu_flags
from handlers.rungs.ipex import probe_ipex
from handlers.serving.engine import Engine

pytestmark = pytest.mark.ipex

TEXTS = ["TorchServe makes serving easy.", "IPEX optimizes the linear layers.", "short", "the cat sat " * 20]
SHAPES = {"batch_sizes": [1, 2], "seq_lengths": [16, 64]}
# IPEX prepacks bf16 weights for oneDNN only with these (ipex.optimize raises without them).
BF16_PREPACK_FLAGS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def engine_for(model_dir: Path, compile_section=None, shapes=SHAPES, **settings) -> Engine:
    raw = {"pt2": {"compile": compile_section or {"enable": False}},
           "pt2_handlers": {"model_dir": str(model_dir), "shapes": shapes, **settings}}
    engine = Engine(load_config(json.loads(json.dumps(raw))), Path("/"), torch.device("cpu"), "ipex-test")
    engine.load()
    return engine


def attempts_of(engine: Engine) -> dict[tuple[str, str], dict]:
    """The ladder's attempts by (rung, dtype): one rung may be tried at several precisions. The screens (eager
    at a half precision, run before any rung tries it) are left out."""
    attempts = [a for a in engine.describe()["optimization"]["attempts"] if not a["screen"]]
    by_step = {(a["rung"], a["dtype"]): a for a in attempts}
    assert len(by_step) == len(attempts), attempts  # each (rung, dtype) is tried at most once
    return by_step


def bf16_prepack_supported() -> bool:
    flags = linux_cpu_flags()
    return any(needed <= flags for needed in BF16_PREPACK_FLAGS)


def embeddings(engine: Engine, texts: list[str]) -> torch.Tensor:
    return torch.tensor(engine.predict([{"inputs": texts}])[0]["embeddings"])


def test_ipex_imports_and_its_rung_is_accepted(tiny_bert_dir):
    """What the ipex profile is for: IPEX imports beside this torch and transformers, the probe hands the module
    to the ladder, and the ipex rung serves."""
    import intel_extension_for_pytorch as ipex
    import transformers

    module, reason = probe_ipex()
    assert reason is None and module is ipex, reason
    assert ipex.__version__.split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2], (
        ipex.__version__, torch.__version__)
    engine = engine_for(tiny_bert_dir, ladder=["ipex", "eager"], dtype="float32")
    optimization = engine.describe()["optimization"]
    assert optimization["active"] == "ipex", (transformers.__version__, optimization["attempts"])
    assert attempts_of(engine)[("ipex", "float32")]["status"] == "accepted"


@pytest.mark.slow
def test_minilm_through_the_ipex_rung_equals_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    engine = engine_for(minilm_dir, ladder=["ipex", "eager"], dtype="float32")
    optimization = engine.describe()["optimization"]
    assert optimization["active"] == "ipex", optimization["attempts"]
    ipex = attempts_of(engine)[("ipex", "float32")]
    assert ipex["status"] == "accepted"
    assert ipex["quality"]["value"] >= ipex["quality"]["threshold"] == 0.9999
    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, normalize_embeddings=True,
                                                                      convert_to_tensor=True).cpu()
    cosine = torch.nn.functional.cosine_similarity(embeddings(engine, TEXTS), want, dim=1)
    assert cosine.min().item() >= 0.9999, cosine
    assert engine.runtime_failures == 0


def test_ipex_bf16_is_accepted_through_the_gate_on_a_cpu_that_prepacks_bf16(minilm_dir):
    """bf16 is what dtype auto tries first on AMX / AVX512-BF16 CPUs; forced here (bf16 alone) so the ipex rung
    runs in it on any CPU. MiniLM, whose bf16 answers pass the gate eagerly (its screen), so the ipex rung is
    tried. Where IPEX can prepack bf16 weights it must be accepted through the gate and serve; elsewhere
    ipex.optimize raises, the reason goes into describe and bf16 eager serves."""
    engine = engine_for(minilm_dir, ladder=["ipex", "eager"], dtype="bfloat16")
    optimization = engine.describe()["optimization"]
    attempts = attempts_of(engine)
    assert ("ipex", "bfloat16") in attempts, optimization["attempts"]  # not refused by the bf16 screen
    ipex = attempts[("ipex", "bfloat16")]
    if bf16_prepack_supported():
        assert ipex["status"] == "accepted", ipex
        assert ipex["quality"]["value"] >= ipex["quality"]["threshold"] == 0.999
        assert optimization["active"] == "ipex" and optimization["dtype"] == "bfloat16"
    else:
        print(f"this CPU lacks {' or '.join('/'.join(sorted(f)) for f in BF16_PREPACK_FLAGS)}: IPEX cannot "
              "prepack bf16 weights here, so the rung must fail with IPEX's reason (not accepted)")
        assert ipex["status"] == "failed" and "BF16 weight prepack needs the cpu support" in ipex["reason"], ipex
        assert optimization["active"] == "eager"
    fp32 = engine_for(minilm_dir, ladder=["eager"], dtype="float32")
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
    ipex_attempt = attempts_of(engine)[("ipex", "float32")]
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
    ipex_attempt = attempts_of(engine)[("ipex", "float32")]
    assert ipex_attempt["status"] == "failed" and "min_cosine" in ipex_attempt["reason"], ipex_attempt
    assert ipex_attempt["quality"]["value"] < ipex_attempt["quality"]["threshold"]
    assert engine.describe()["optimization"]["active"] == "eager"
