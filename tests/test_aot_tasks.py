"""AOT packages for every shipped text task, and for a target named on the command line (AVX2-only nodes from an
AVX-512 host). Run once, in the ipex stage where scripts/test.sh runs one (tests/conftest.py: ``ipex_stage``): what
they check does not depend on torch's version, and tests/test_aot.py proves the packages under the default profile's
torch. Each packages with the command line, in a process of its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.config import load_config_file
from handlers.rungs import aot_fingerprint
from handlers.serving.engine import Engine
from tests.test_aot import CONFIG, REPO, index, package

pytestmark = pytest.mark.ipex_stage


@pytest.fixture(scope="module")
def ranker_files(tmp_path_factory) -> Path:
    from tests.conftest import example_ranker

    return example_ranker(tmp_path_factory.mktemp("ranker"))


def test_packaging_for_avx2_nodes_from_an_avx512_host(tmp_path, ranker_files, monkeypatch):
    """The target named on the command line: torch's kernels held to AVX2 while packaging (``ATEN_CPU_CAPABILITY=avx2
    python -m handlers package ...``) build a package whose kernels use AVX2 alone, which an AVX2-only CPU fits."""
    import yaml

    raw = yaml.safe_load(CONFIG.read_text())
    raw["pt2_handlers"]["compile_artifacts"] = False
    config = tmp_path / "avx2-aot.yaml"
    config.write_text(yaml.safe_dump(raw))
    root = package(tmp_path / "store", "avx2-aot", config, "--model-file", str(ranker_files / "model.py"),
                   "--serialized-file", str(ranker_files / "model.pth"), env={"ATEN_CPU_CAPABILITY": "avx2"})
    [entry] = index(root)
    assert not [name for name in entry["cpu_features"] if name.startswith(("avx512", "amx"))], entry
    assert entry["vector_isa"] in ("avx2", "none"), entry
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # as on an AVX2-only CPU
    assert aot_fingerprint.misfit(aot_fingerprint.Fingerprint.from_json(entry), torch.device("cpu")) is None


TEXT_TASKS = {"minilm-sentiment": ("minilm-text-classification.yaml", {"text": "a fine day for a walk"}),
              "minilm-ner": ("minilm-token-classification.yaml", {"text": "Anna moved from Paris to Berlin"}),
              "minilm-qa": ("minilm-question-answering.yaml",
                            {"question": "Where does Anna live?", "context": "Anna lives in Berlin with her cat."})}


@pytest.mark.parametrize("model", list(TEXT_TASKS))
def test_each_text_task_serves_its_package(tmp_path, task_model_dirs, model):
    """The shipped text tasks' YAMLs with pt2.export.aot_compile, in float32 (their random heads fail bf16's gate):
    the package is proven at packaging and again at load, serves, and answers as the eager reference does."""
    import yaml

    shipped, body = TEXT_TASKS[model]
    raw = yaml.safe_load((REPO / "model_configs" / shipped).read_text())
    raw["pt2"]["export"] = {"aot_compile": True}
    raw["pt2_handlers"]["dtype"] = "float32"
    config = tmp_path / f"{model}-aot.yaml"
    config.write_text(yaml.safe_dump(raw))
    root = package(tmp_path / "store", f"{model}-aot", config, "--model-dir", str(task_model_dirs[model]))
    torch._dynamo.reset()
    served = Engine(load_config_file(config), root, torch.device("cpu"), model)
    served.load()
    assert served.active_rung == "aot", served.describe()["optimization"]["attempts"]
    raw["pt2_handlers"]["ladder"] = ["eager"]
    raw["pt2"] = {}
    (tmp_path / "eager.yaml").write_text(yaml.safe_dump(raw))
    eager = Engine(load_config_file(tmp_path / "eager.yaml"), root, torch.device("cpu"), model)
    eager.load()
    [got], [want] = served.predict([body]), eager.predict([body])
    assert_same_answers(got, want)


def assert_same_answers(got, want, tolerance: float = 1e-3) -> None:
    """The same labels, spans and texts; scores within ``tolerance`` (fp32 compiled against fp32 eager)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (got, want)
        for key in want:
            assert_same_answers(got[key], want[key], tolerance)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for one, other in zip(got, want, strict=True):
            assert_same_answers(one, other, tolerance)
    elif isinstance(want, float):
        assert abs(got - want) <= tolerance, (got, want)
    else:
        assert got == want, (got, want)
