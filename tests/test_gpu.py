"""The CUDA-graph path, on a GPU worker: `mode: reduce-overhead` with static buckets, every bucket warmed,
outputs cloned before the next replay. Run on a GPU machine (with a CUDA build of torch) as:

    pytest -m gpu

Deselected (not skipped) where there is no CUDA device: see tests/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handlers.config import CompileSpec, DType, load_config
from handlers.engine import Engine
from handlers.ladder import run_ladder
from handlers.rungs import CompileRung, EagerRung
from handlers.tasks.embeddings import CosineGate

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
GRAPHS = {"pt2": {"compile": {"enable": True, "backend": "inductor", "mode": "reduce-overhead"}},
          "pt2_handlers": {"ladder": ["compile", "eager"], "shapes": {"policy": "buckets", "batch_sizes": [1, 2],
                                                                       "seq_lengths": [8, 16], "after_ready": "fail"}}}


@pytest.fixture(scope="module")
def gpu_engine(tiny_bert_dir):
    raw = json.loads(json.dumps(GRAPHS))
    raw["pt2_handlers"]["model_dir"] = str(tiny_bert_dir)
    engine = Engine(load_config(raw), Path("/"), CUDA, "tiny-gpu")
    engine.load()
    return engine


def test_cuda_graphs_are_accepted_on_every_bucket(gpu_engine):
    optimization = gpu_engine.describe()["optimization"]
    assert optimization["active"] == "compile" and optimization["notes"] == []
    assert optimization["dtype"] in ("bfloat16", "float16")
    (accepted,) = [a for a in optimization["attempts"] if a["status"] == "accepted"]
    assert accepted["dtype"] == optimization["dtype"] and accepted["quality"]["value"] >= 0.999


def test_a_replay_never_overwrites_an_earlier_answer(gpu_engine):
    first = gpu_engine.predict([{"inputs": ["alpha beta", "gamma"]}])[0]["embeddings"]
    kept = [list(row) for row in first]
    second = gpu_engine.predict([{"inputs": ["something else entirely", "and more"]}])[0]["embeddings"]
    assert first == kept and first != second
    again = gpu_engine.predict([{"inputs": ["alpha beta", "gamma"]}])[0]["embeddings"]
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(again), torch.tensor(kept), dim=-1)
    assert cosine.min() >= 0.9999
    runtime = gpu_engine.describe()["optimization"]["runtime"]
    assert (runtime["compiles_after_ready"], runtime["eager_batches"], runtime["runtime_failures"]) == (0, 0, 0)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())

    def forward(self, x):
        return self.net(x)


def test_compile_rung_marks_steps_and_clones_on_cuda():
    torch.manual_seed(0)
    module = Mlp().to(CUDA).eval()
    batches = [{"x": torch.randn(2, 8, device=CUDA)}]
    spec = CompileSpec(enabled=True, mode="reduce-overhead", dynamic=False)
    result = run_ladder(module, (DType.FLOAT32,), [CompileRung("compile", spec), EagerRung()], batches,
                        lambda dtype: CosineGate(0.9999))
    assert result.active == "compile"
    with torch.inference_mode():
        first = result.forward(**batches[0])
        kept = first.clone()
        result.forward(x=torch.randn(2, 8, device=CUDA))  # a replay that would reuse first's buffer
        torch.testing.assert_close(first, kept)
        torch.testing.assert_close(first, module(**batches[0]))
