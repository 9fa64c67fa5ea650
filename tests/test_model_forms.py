"""Every model form torch-model-archiver packs, through the Engine: model.py + a state_dict (.pth, .safetensors), a
torch.export program (.pt2); the tensor task and a task of one's own; what is refused and why."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from handlers.config import load_config
from handlers.errors import ConfigError, ModelLoadError
from handlers.models.files import ModelFiles
from handlers.models.state_dict import read_state_dict
from handlers.serving.engine import Engine

MODELS = Path(__file__).resolve().parent / "models"
EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "ranker"  # the docs' worked example
SEED = 0
# Batch buckets 1 and 4 only: each is a compile; fp32 keeps the check exact on every CPU kind.
FAST = {"pt2": {"compile": {"enable": True}}, "minWorkers": 1}
TENSOR = {"task": "tensor", "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}],
          "shapes": {"batch_sizes": [1, 4]}, "dtype": "float32"}


def ranker() -> torch.nn.Module:
    """The docs' example model with seeded weights (tests/conftest.py builds its archives with the same)."""
    from handlers.models.state_dict import module_class

    torch.manual_seed(SEED)
    return module_class(EXAMPLE / "model.py")().eval()


@pytest.fixture(scope="module")
def archive_root(tmp_path_factory) -> Path:
    """An unpacked archive: model.py, its state_dict as .pth and as .safetensors, an exported program, a task file."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("archive")
    for source in (EXAMPLE / "model.py", EXAMPLE / "ranking_task.py", MODELS / "untraceable.py", MODELS / "bessel.py"):
        shutil.copy(source, root / source.name)
    model = ranker()
    torch.save(model.state_dict(), root / "model.pth")
    save_file(model.state_dict(), str(root / "model.safetensors"))
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (), {"x": torch.randn(4, 16)}, dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(root / "model.pt2"))
    torch.manual_seed(SEED)
    from tests.models.untraceable import Untraceable

    torch.save(Untraceable().state_dict(), root / "untraceable.pth")
    from tests.models.bessel import Bessel

    torch.save(Bessel().state_dict(), root / "bessel.pth")
    return root


def engine(root: Path, settings: dict, files: ModelFiles, **pt2) -> Engine:
    config = load_config({**FAST, **pt2, "pt2_handlers": settings})
    torch._dynamo.reset()  # one worker serves one model: each load here starts as a worker does
    loaded = Engine(config, root, torch.device("cpu"), "m", files=files)
    loaded.load()
    return loaded


ROWS = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("rung", ["compile", pytest.param("openvino", marks=pytest.mark.openvino)])
@pytest.mark.parametrize("files", [ModelFiles("model.py", "model.pth"), ModelFiles("model.py", "model.safetensors"),
                                   ModelFiles(None, "model.pt2")], ids=["pth", "safetensors", "exported"])
def test_each_model_form_serves_the_tensor_task_optimized_equal_to_eager_fp32(archive_root, files, rung):
    served = engine(archive_root, {**TENSOR, "ladder": [rung, "eager"]}, files)
    assert served.active_rung == rung, served.describe()["optimization"]["attempts"]
    answers = served.predict([{"inputs": {"x": ROWS[:2].tolist()}}, {"inputs": ROWS[2:5].tolist()},
                              ROWS[5].tolist(), {"inputs": {"x": [[1.0, 2.0]]}}])
    with torch.no_grad():
        want = ranker()(ROWS)
    got = torch.tensor([*answers[0], *answers[1], *answers[2]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert "size 2 on axis 1; this model takes 16" in answers[3].message
    described = served.describe()
    assert described["model"]["form"] == files.form.value
    assert described["inputs"]["tensors"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]


def test_the_tensor_task_reads_open_inference_tensors(archive_root):
    served = engine(archive_root, TENSOR, ModelFiles("model.py", "model.pth"))
    body = {"id": "q", "inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                                   "data": ROWS[:2].flatten().tolist()}]}
    (answer,) = served.predict([body])
    assert answer["id"] == "q" and answer["outputs"][0]["name"] == "output"
    assert answer["outputs"][0]["shape"] == [2] and answer["outputs"][0]["datatype"] == "FP32"
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(answer["outputs"][0]["data"]), ranker()(ROWS[:2]), rtol=1e-4,
                                   atol=1e-5)


def test_a_task_of_ones_own_from_a_file_in_the_archive(archive_root):
    served = engine(archive_root, {"task": "ranking_task:RankingTask", "dtype": "float32",
                                   "shapes": {"batch_sizes": [1, 4]}}, ModelFiles("model.py", "model.pth"))
    assert served.active_rung in ("openvino", "compile")  # the default ladder: they race, the faster serves
    (ranked, refused) = served.predict([{"candidates": ROWS[:3].tolist()}, {"candidates": [[1.0]]}])
    with torch.no_grad():
        scores = ranker()(ROWS[:3])
    assert [item["index"] for item in ranked] == scores.argsort(descending=True).tolist()
    assert refused.status == 400 and "16 numbers" in refused.message


def test_a_model_dynamo_cannot_compile_lands_on_eager_and_says_so(archive_root):
    served = engine(archive_root, {**TENSOR, "ladder": ["compile", "eager"]},
                    ModelFiles("untraceable.py", "untraceable.pth"))
    attempts = served.describe()["optimization"]["attempts"]
    assert served.active_rung == "eager", attempts
    assert attempts[0]["rung"] == "compile" and attempts[0]["status"] == "failed" and attempts[0]["reason"], attempts
    (answer,) = served.predict([ROWS[:2].tolist()])
    assert len(answer) == 2 and len(answer[0]) == 4


@pytest.mark.openvino
def test_a_model_openvino_cannot_convert_is_served_by_the_next_rung(archive_root):
    """No request fails because of OpenVINO: its conversion fails at load, with the converter's reason, and the
    compile rung serves."""
    served = engine(archive_root, TENSOR, ModelFiles("bessel.py", "bessel.pth"))
    attempts = served.describe()["optimization"]["attempts"]
    assert served.active_rung == "compile", attempts
    failed = next(attempt for attempt in attempts if attempt["rung"] == "openvino")
    assert failed["status"] == "failed" and "OpConversionFailure" in failed["reason"], failed
    (answer,) = served.predict([ROWS[:3].tolist()])
    from tests.models.bessel import Bessel

    model = Bessel()
    model.load_state_dict(torch.load(archive_root / "bessel.pth"))
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(answer), model(ROWS[:3]), rtol=1e-4, atol=1e-5)


class Whole(torch.nn.Module):
    def forward(self, x):
        return x


class Payload:
    """A pickle that would write a file if it were ever unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


@pytest.mark.parametrize("kind", ["whole-model", "code"])
def test_a_pickle_that_is_more_than_tensors_is_refused_without_being_unpickled(tmp_path, kind):
    weights, witness = tmp_path / "model.pth", tmp_path / "witness"
    if kind == "code":
        torch.save({"w": torch.ones(2), "payload": Payload(witness)}, weights)
    else:
        torch.save(Whole(), weights)
    with pytest.raises(ModelLoadError) as refused:
        read_state_dict(weights)
    assert "is a pickle that imports" in refused.value.message
    assert "torch.save(model.state_dict(), 'model.pth')" in refused.value.message
    assert not witness.exists()
    pickle.loads(pickle.dumps(1))  # the module's own pickle still works: nothing was patched


def test_the_archive_files_must_make_a_model(archive_root):
    with pytest.raises(ModelLoadError, match="has no --serialized-file"):
        ModelFiles("model.py", None).check()
    with pytest.raises(ModelLoadError, match="only a torch.export program"):
        ModelFiles(None, "model.pth").check()
    with pytest.raises(ModelLoadError, match="missing key"):
        engine(archive_root, TENSOR, ModelFiles("untraceable.py", "model.pth"))
    with pytest.raises(ConfigError, match="cannot import no_such_module"):
        engine(archive_root, {"task": "no_such_module:Task"}, ModelFiles("model.py", "model.pth"))
    with pytest.raises(ModelLoadError, match="Hugging Face save_pretrained directory"):
        engine(archive_root, {"task": "embeddings"}, ModelFiles("model.py", "model.pth"))


def test_package_takes_the_archivers_model_flags_and_a_hand_run_archiver_makes_the_same_archive(tmp_path,
                                                                                                archive_root):
    """``python -m handlers package --model-file --serialized-file --extra-files``, and torch-model-archiver run by
    hand as the docs say (handlers/ and the task staged in a directory of their own): the same files, the same
    manifest."""
    import json
    import subprocess
    import sys
    import zipfile

    from handlers.serving import archive as package

    repo = EXAMPLE.parent.parent.parent
    config = repo / "model_configs" / "ranker-ranking-task.yaml"
    subprocess.run([sys.executable, "-m", "handlers", "package", "--name", "ranking", "--config", str(config),
                    "--model-file", str(archive_root / "model.py"),
                    "--serialized-file", str(archive_root / "model.pth"),
                    "--extra-files", str(EXAMPLE / "ranking_task.py"), "--export-path", str(tmp_path / "tool")],
                   check=True, capture_output=True, timeout=300, cwd=repo)
    stage = tmp_path / "stage"
    shutil.copytree(repo / "handlers", stage / "handlers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(EXAMPLE / "ranking_task.py", stage)
    (tmp_path / "hand").mkdir()
    subprocess.run([package.archiver(), "--model-name", "ranking", "--version", "1.0",
                    "--handler", str(stage / "handlers" / "serving" / "torchserve_handler.py"),
                    "--extra-files", str(stage), "--model-file", str(archive_root / "model.py"),
                    "--serialized-file", str(archive_root / "model.pth"), "--config-file", str(config),
                    "--export-path", str(tmp_path / "hand"), "--archive-format", "zip-store"],
                   check=True, capture_output=True, timeout=300)
    archives = [zipfile.ZipFile(tmp_path / kind / "ranking.mar") for kind in ("tool", "hand")]
    names = [set(mar.namelist()) for mar in archives]
    assert names[0] == names[1] and {"model.py", "model.pth", "ranking_task.py", "torchserve_handler.py"} <= names[0]
    manifests = [json.loads(mar.read("MAR-INF/MANIFEST.json"))["model"] for mar in archives]
    assert manifests[0] == manifests[1] and manifests[0]["serializedFile"] == "model.pth"


def test_package_refuses_a_pickle_that_is_more_than_tensors(tmp_path, archive_root):
    from handlers.serving import archive as package

    torch.save(Whole(), tmp_path / "whole.pth")
    with pytest.raises(SystemExit, match="is a pickle that imports .*Whole.*torch.save\\(model.state_dict"):
        package.build("whole", None, EXAMPLE.parent.parent.parent / "model_configs" / "ranker-tensor.yaml",
                      tmp_path / "store", files=package.ModelForm(archive_root / "model.py", tmp_path / "whole.pth"))
    assert not (tmp_path / "store").exists()
