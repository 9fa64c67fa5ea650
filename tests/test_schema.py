"""One schema for the model YAML: every mistake reported in one run, the shipped JSON Schema and
the configuration reference generated from the code, and the task catalog config checks against held to the
task classes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from handlers.config import DType, load_config
from handlers.config.task_facts import TASK_FACTS
from handlers.errors import ConfigError
from handlers.tasks import check_task

REPO = Path(__file__).resolve().parent.parent
GEN_SCHEMA = REPO / "scripts" / "gen_schema.py"  # the maintainer's tool that writes the two files below, run as one
SCHEMA_PATH = REPO / "schema" / "model-config.schema.json"
REFERENCE_PATH = REPO / "docs" / "reference" / "configuration.md"
MODELINE = "# yaml-language-server: $schema=../schema/model-config.schema.json"  # from model_configs/*.yaml

MODEL_YAMLS = sorted(path for path in (REPO / "model_configs").glob("*.yaml") if path.name != "metrics.yaml")
# The shipped embeddings YAML with six mistakes, as a user makes them: (the line, as mistyped) and what names it.
SIX_MISTAKES = {
    ("    enable: true", '    enable: "yes"'): "pt2.compile.enable must be bool, got str 'yes'",
    ("    backend: inductor", "    backend: inductr"):
        "pt2.compile.backend: 'inductr' is not a registered torch.compile backend (did you mean inductor?); use one of",
    ("    mode: reduce-overhead", "    mdoe: reduce-overhead"):
        "pt2.compile: unknown key(s) mdoe (did you mean mode?); allowed: backend, dynamic, enable, fullgraph, mode,",
    ("  task: embeddings", "  task: embedings"):
        "pt2_handlers.task: unknown task 'embedings' (did you mean embeddings?); use one of: embeddings,",
    ("  model_dir: model", "  batch_size: 4\n  model_dir: model"):
        "pt2_handlers: unknown key(s) batch_size (did you mean shapes.batch_sizes?); allowed: attention, "
        "batch_metrics_every_s, compile_artifacts, compile_cache,",
    ("  dtype: auto", "  dtype: bf16"):
        "pt2_handlers.dtype: 'bf16' is not allowed (did you mean bfloat16?); use one of: auto, float32, bfloat16",
}
DTYPE_OF_GATE_KEY = (DType.FLOAT32, DType.BFLOAT16, DType.INT8)  # GateFacts.keys' order


def six_mistakes_yaml(path: Path) -> Path:
    text = (REPO / "model_configs" / "minilm-embeddings.yaml").read_text()
    for (line, mistyped) in SIX_MISTAKES:
        assert text.count(f"{line}") >= 1, line
        text = text.replace(f"\n{line}", f"\n{mistyped}", 1)
    path.write_text(text)
    return path


def test_six_mistakes_are_reported_in_one_run_of_the_check_cli(tmp_path):
    typo = six_mistakes_yaml(tmp_path / "typo.yaml")
    checked = subprocess.run([sys.executable, "-m", "handlers", "check", str(typo)], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert checked.returncode == 1, checked.stderr
    lines = checked.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith(f"{typo}: INVALID: ") for line in lines), checked.stdout
    for named in SIX_MISTAKES.values():
        assert sum(named in line for line in lines) == 1, (named, checked.stdout)


def test_six_mistakes_make_one_config_error_and_leave_the_yaml_as_it_was(tmp_path):
    raw = yaml.safe_load(six_mistakes_yaml(tmp_path / "typo.yaml").read_text())
    before = copy.deepcopy(raw)
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    assert raw == before
    assert len(caught.value.problems) == 6
    assert caught.value.message.startswith("6 problems:\n  pt2.compile.enable must be bool")
    for named, problem in zip(SIX_MISTAKES.values(), caught.value.problems, strict=True):  # in the YAML's order
        assert problem.startswith(named)


def test_the_shipped_schema_and_reference_are_generated_from_the_code():
    checked = subprocess.run([sys.executable, str(GEN_SCHEMA), "--check"], cwd=REPO, capture_output=True, text=True,
                             timeout=300)  # says "<file> is stale: run scripts/gen_schema.py" for each stale one
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_reference_names_every_key_the_schema_knows():
    reference = REFERENCE_PATH.read_text()
    schema = json.loads(SCHEMA_PATH.read_text())
    for section in ("CompileSection", "SettingsSection", "ShapesSection", "QualityGate"):
        for key in schema["$defs"][section]["properties"]:
            assert f"| `{key}` |" in reference, (section, key)
    for task in TASK_FACTS:
        assert f"| `{task}` |" in reference


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda path: path.name)
def test_every_shipped_model_yaml_points_editors_at_the_schema(path):
    assert path.read_text().splitlines()[0] == MODELINE
    assert (path.parent / MODELINE.partition("$schema=")[2]).resolve() == SCHEMA_PATH


# jsonschema comes with the deploy extra, installed in the default profile only: these run there (default_profile),
# and are deselected, with the reason, in the ipex profile; the schema does not depend on torch's version.
@pytest.mark.default_profile
@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda path: path.name)
def test_every_shipped_model_yaml_passes_the_schema(path):
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(path.read_text()))) == []


@pytest.mark.default_profile
def test_an_editor_flags_the_mistakes_the_schema_can_see(tmp_path):
    """All but the backend: which backends exist depends on torch's version, so the schema only suggests them."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    raw = yaml.safe_load(six_mistakes_yaml(tmp_path / "typo.yaml").read_text())
    flagged = {"/".join(map(str, error.absolute_path)) or error.message
               for error in jsonschema.Draft202012Validator(schema).iter_errors(raw)}
    assert {"pt2", "pt2_handlers"} <= flagged  # pt2: no form fits (enable, mdoe); pt2_handlers: batch_size
    assert {"pt2_handlers/task", "pt2_handlers/dtype"} <= flagged
    raw["pt2_handlers"] = {"task": "text-generation", "quality_gate": {"min_cosine": 0.9}}
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(raw))
    assert any(list(error.absolute_path) == ["pt2_handlers", "quality_gate"] for error in errors), errors


@pytest.mark.parametrize("name", sorted(TASK_FACTS))
def test_the_catalog_names_each_task_class_and_its_gate(name):
    """Config validates against handlers/config/task_facts.py; the task class found there reads its facts from it, and
    its gate's defaults are the catalog's."""
    facts, task_class = TASK_FACTS[name], check_task(name)
    assert f"{task_class.__module__}:{task_class.__name__}" == facts.location and task_class.name == name
    assert task_class.facts() is facts
    assert task_class.quality_gate(DType.FLOAT32, {}).threshold == pytest.approx(
        facts.gate.defaults[0] if facts.gate.keys[0].startswith("min") else 1 - facts.gate.defaults[0])


def task_settings(name: str) -> dict:
    """The least pt2_handlers section that serves the task: the tensor task also needs its inputs."""
    inputs = [{"name": "x", "shape": ["batch", 4]}] if TASK_FACTS[name].needs_inputs else None
    return {"task": name, **({"inputs": inputs} if inputs else {})}


@pytest.mark.parametrize("name", sorted(TASK_FACTS))
def test_config_checks_each_gate_key_as_the_task_does(name):
    """The catalog's defaults are the task's, and a value out of the catalog's range gets the task's own message
    from load_config (which reports it with the rest, where the task's check stops at the first)."""
    gate, task_class = TASK_FACTS[name].gate, check_task(name)
    low, high = gate.bounds
    for key, default, dtype in zip(gate.keys, gate.defaults, DTYPE_OF_GATE_KEY, strict=False):
        assert task_class.quality_gate(dtype, {key: default}).threshold == task_class.quality_gate(dtype, {}).threshold
        for edge in (low, high):
            task_class.quality_gate(dtype, {key: edge})
            load_config({"pt2_handlers": {**task_settings(name), "quality_gate": {key: edge}}})
        for outside in (low - 0.5, high + 0.5):
            with pytest.raises(ConfigError) as by_task:
                task_class.quality_gate(dtype, {key: outside})
            with pytest.raises(ConfigError) as by_config:
                load_config({"pt2_handlers": {**task_settings(name), "quality_gate": {key: outside}}})
            assert by_config.value.message == by_task.value.message
