"""AOT archives (``pt2.export.aot_compile``): packages built by ``python -m handlers package`` in a process of their
own, proven and fingerprinted there; a worker that serves them without compiling; and every package that does not fit
the host (another torch, an instruction set the CPU's kernels may not use, a changed file, an unreadable index) left
out before its code loads, the worker READY on the JIT ladder with the reason in describe, its answers right."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handlers.config import load_config_file
from handlers.models.files import ModelFiles
from handlers.rungs import aot_fingerprint
from handlers.serving.engine import Engine

pytestmark = pytest.mark.default_profile  # what torch's version does not change runs once

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "tests" / "configs" / "ranker-aot.yaml"
FILES = ModelFiles("model.py", "model.pth")
ROWS = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))


def package(out: Path, name: str, config: Path, *model_flags: str, env: dict[str, str] | None = None) -> Path:
    """An archive as a directory (``--archive-format no-archive``), built by the command line in a process of its
    own: this one never built its packages (a package that loads only where it was built would fail here)."""
    built = subprocess.run([sys.executable, "-m", "handlers", "package", "--name", name, "--config", str(config),
                            *model_flags, "--export-path", str(out), "--archive-format", "no-archive"],
                           cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    print(built.stdout[-3000:], built.stderr[-3000:])
    assert built.returncode == 0, built.stderr[-3000:]
    assert "[package] aot: float32: compiled in" in built.stdout
    return out / name


@pytest.fixture(scope="module")
def ranker_files(tmp_path_factory) -> Path:
    from tests.conftest import example_ranker

    return example_ranker(tmp_path_factory.mktemp("ranker"))


@pytest.fixture(scope="module")
def aot_archive(tmp_path_factory, ranker_files) -> Path:
    """The ranker's archive (model.py + its state_dict) with its AOT package and its compile artifacts."""
    return package(tmp_path_factory.mktemp("aot-store"), "ranker-aot", CONFIG, "--model-file",
                   str(ranker_files / "model.py"), "--serialized-file", str(ranker_files / "model.pth"))


@pytest.fixture
def archive_copy(aot_archive, tmp_path) -> Path:
    """The archive as this test's own copy, free to be damaged."""
    return Path(shutil.copytree(aot_archive, tmp_path / "archive"))


def load(root: Path) -> Engine:
    torch._dynamo.reset()  # one worker serves one model: each load here starts as a worker does
    engine = Engine(load_config_file(CONFIG), root, torch.device("cpu"), "ranker-aot", files=FILES)
    engine.load()
    return engine


def answers_are_eagers(engine: Engine) -> None:
    from tests.test_model_forms import ranker

    answers = engine.predict([{"inputs": {"x": ROWS[:2].tolist()}}, {"inputs": ROWS[2:6].tolist()}])
    with torch.no_grad():
        want = ranker()(ROWS)
    torch.testing.assert_close(torch.tensor([*answers[0], *answers[1]]), want, rtol=1e-4, atol=1e-5)


def index(root: Path) -> list[dict]:
    return json.loads((root / aot_fingerprint.DIRECTORY / aot_fingerprint.INDEX).read_text())["packages"]


def rewrite_index(root: Path, **changes) -> None:
    path = root / aot_fingerprint.DIRECTORY / aot_fingerprint.INDEX
    raw = json.loads(path.read_text())
    raw["packages"] = [{**package, **changes} for package in raw["packages"]]
    path.write_text(json.dumps(raw))


def test_packaging_writes_each_package_proven_with_its_fingerprint(aot_archive):
    assert (aot_archive / "compile_artifacts" / "index.json").is_file()
    [entry] = index(aot_archive)
    path = aot_archive / aot_fingerprint.DIRECTORY / entry["file"]
    assert entry["precision"] == "float32"
    assert entry["sha256"] == aot_fingerprint.sha256_of(path)
    assert entry["size_bytes"] == path.stat().st_size
    assert entry["torch"] == torch.__version__ and entry["device"] == "cpu"
    assert set(entry["cpu_features"]) == aot_fingerprint.cpu_features()
    assert entry["inputs"] == ["x"]
    assert entry["gate"]["value"] >= entry["gate"]["threshold"] > 0
    assert (aot_archive / "model.pth").is_file()  # the eager weights stay, for the gate and the fallback


def test_a_worker_serves_the_package_without_compiling(archive_copy):
    engine = load(archive_copy)
    optimization = engine.describe()["optimization"]
    assert engine.active_rung == "aot", optimization["attempts"]
    assert optimization["attempts"][0]["status"] == "accepted"
    assert optimization["attempts"][0]["quality"]["value"] >= optimization["attempts"][0]["quality"]["threshold"]
    use = optimization["compile_cache"]["use_at_load"]
    assert all(counts["miss"] == 0 and counts["hit"] == 0 for counts in use.values()), use  # nothing was compiled
    answers_are_eagers(engine)


def test_an_exported_program_gets_its_package_too(tmp_path, ranker_files, private_inductor_cache):
    """The other model form torch-model-archiver packs alone: a torch.export program (``--serialized-file
    model.pt2``), exported again with its task's module and compiled ahead of time."""
    import yaml

    raw = yaml.safe_load(CONFIG.read_text())
    raw["pt2_handlers"]["compile_artifacts"] = False
    config = tmp_path / "exported-aot.yaml"
    config.write_text(yaml.safe_dump(raw))
    root = package(tmp_path / "store", "exported-aot", config, "--serialized-file", str(ranker_files / "model.pt2"))
    torch._dynamo.reset()
    engine = Engine(load_config_file(config), root, torch.device("cpu"), "exported-aot",
                    files=ModelFiles(None, "model.pt2"))
    engine.load()
    assert engine.active_rung == "aot", engine.describe()["optimization"]["attempts"]
    answers_are_eagers(engine)


def _another_instruction_set() -> str:
    """An instruction set this CPU's kernels may not use (AMX FP16 is the rarest; else a name no CPU reports)."""
    usable = aot_fingerprint.cpu_features()
    return next((name for name in ("amx_fp16", "avx10_2", "avx512_fp16") if name not in usable), "sve")


@pytest.mark.parametrize("damage, reason", [
    ("torch", "built with torch 2.0.0, this worker runs"),
    ("instruction_set", "which this CPU's may not"),
    ("changed_file", "is not the package that was proven"),
    ("truncated_file", "is not the package that was proven"),
    ("unreadable_index", "cannot be read"),
])
def test_a_package_that_does_not_fit_the_host_falls_to_the_jit_ladder(archive_copy, damage, reason):
    packaged = archive_copy / aot_fingerprint.DIRECTORY / index(archive_copy)[0]["file"]
    if damage == "torch":
        rewrite_index(archive_copy, torch="2.0.0")
    elif damage == "instruction_set":
        rewrite_index(archive_copy, cpu_features=[*index(archive_copy)[0]["cpu_features"], _another_instruction_set()])
    elif damage == "changed_file":
        data = bytearray(packaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        packaged.write_bytes(bytes(data))
    elif damage == "truncated_file":
        packaged.write_bytes(packaged.read_bytes()[:4096])
    else:
        (archive_copy / aot_fingerprint.DIRECTORY / aot_fingerprint.INDEX).write_text("{not json")
    engine = load(archive_copy)
    attempts = engine.describe()["optimization"]["attempts"]
    assert engine.active_rung == "compile", attempts
    assert attempts[0]["rung"] == "aot" and attempts[0]["status"] in ("skipped", "failed"), attempts[0]
    assert reason in attempts[0]["reason"], attempts[0]
    answers_are_eagers(engine)


def test_a_package_built_for_avx512_is_refused_where_kernels_are_held_to_avx2(aot_archive, monkeypatch):
    """As on an AVX2-only CPU (torch's kernels held to AVX2 stand for one): a package whose kernels could use AVX-512
    must not load, whatever this CPU has. On an AVX2-only CPU the package needs nothing more, and fits."""
    [entry] = index(aot_archive)
    fingerprint = aot_fingerprint.Fingerprint.from_json(entry)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    reason = aot_fingerprint.misfit(fingerprint, torch.device("cpu"))
    built_for_avx512 = any(name.startswith(("avx512", "amx")) for name in entry["cpu_features"])
    if built_for_avx512:
        assert reason is not None and "avx512" in reason, reason
    else:
        assert reason is None


def test_the_jit_fallback_on_a_new_host_compiles_from_the_archives_artifacts(archive_copy, private_inductor_cache):
    """Where the package does not fit, the compile rung on an empty compile cache reads the graphs and kernels the
    packaging load compiled (torch's cache artifacts in the archive): inductor generates no code."""
    rewrite_index(archive_copy, torch="2.0.0")
    engine = load(archive_copy)
    cache = engine.describe()["optimization"]["compile_cache"]
    assert engine.active_rung == "compile"
    assert cache["archive_artifacts"]["loaded"] is True, cache
    assert cache["use_at_load"]["fx_graph"]["miss"] == 0 < cache["use_at_load"]["fx_graph"]["hit"], cache
    answers_are_eagers(engine)


def test_compile_artifacts_built_elsewhere_are_left_out_with_the_reason(archive_copy, private_inductor_cache):
    path = archive_copy / "compile_artifacts" / "index.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "torch": "2.0.0"}))
    rewrite_index(archive_copy, torch="2.0.0")
    engine = load(archive_copy)
    cache = engine.describe()["optimization"]["compile_cache"]
    assert cache["archive_artifacts"] == {"loaded": False, "reason": f"built with torch 2.0.0, this worker runs "
                                                                     f"{torch.__version__}"}
    assert engine.active_rung == "compile" and cache["use_at_load"]["fx_graph"]["miss"] > 0
    answers_are_eagers(engine)


def test_packaging_refuses_aot_for_a_task_that_runs_a_decode_loop(tmp_path):
    """Generation runs a decode loop over its cache, not one forward of an exported module: no package, and why."""
    from handlers.config import load_config
    from handlers.models.files import SAVE_PRETRAINED
    from handlers.serving import aot_packages

    config = load_config({"pt2": {"export": {"aot_compile": True}}, "pt2_handlers": {"task": "text-generation"}})
    with pytest.raises(SystemExit, match="text-generation runs a decode loop over its cache"):
        aot_packages.build(tmp_path, config, SAVE_PRETRAINED, "llm")
