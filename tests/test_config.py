"""Every accepted pt2 form parses; each kind of invalid config gets its own clear error."""

from __future__ import annotations

import copy

import pytest

from handlers.config import (
    DEFAULT_TOLERANCE,
    CompileSpec,
    DType,
    HandlerSettings,
    RungName,
    Tolerance,
    load_config,
)
from handlers.errors import ConfigError


def test_no_pt2_section_means_no_compile_and_default_settings():
    config = load_config({"minWorkers": 1, "batchSize": 4})
    assert config.compile == CompileSpec(enabled=False)
    assert config.settings == HandlerSettings()
    assert config.warnings == ()


def test_none_yaml_is_all_defaults():
    assert load_config(None).compile.enabled is False


def test_current_form_with_every_key():
    raw = {"pt2": {"compile": {"enable": True, "backend": "inductor", "mode": "reduce-overhead", "dynamic": True,
                               "fullgraph": True}}}
    spec = load_config(raw).compile
    assert spec == CompileSpec(enabled=True, backend="inductor", mode="reduce-overhead", dynamic=True, fullgraph=True)
    assert spec.kwargs() == {"backend": "inductor", "mode": "reduce-overhead", "dynamic": True, "fullgraph": True}


def test_current_form_with_options():
    spec = load_config({"pt2": {"compile": {"enable": True, "options": {"epilogue_fusion": True}}}}).compile
    assert spec.kwargs()["options"] == {"epilogue_fusion": True}
    assert "mode" not in spec.kwargs()


def test_missing_enable_means_false_with_a_warning():
    config = load_config({"pt2": {"compile": {"backend": "inductor"}}})
    assert config.compile.enabled is False
    assert any("no 'enable'" in w for w in config.warnings)


def test_enable_false_is_off_without_warning():
    config = load_config({"pt2": {"compile": {"enable": False, "mode": "max-autotune"}}})
    assert config.compile.enabled is False and config.warnings == ()


def test_legacy_string_form_is_accepted_with_deprecation():
    config = load_config({"pt2": "inductor"})
    assert config.compile == CompileSpec(enabled=True, backend="inductor")
    assert any("deprecated" in w for w in config.warnings)


def test_legacy_dict_form_is_accepted_with_deprecation():
    config = load_config({"pt2": {"backend": "inductor", "mode": "max-autotune"}})
    assert config.compile == CompileSpec(enabled=True, backend="inductor", mode="max-autotune")
    assert any("deprecated" in w for w in config.warnings)


def test_legacy_forms_are_validated_as_strictly():
    with pytest.raises(ConfigError, match="not a registered torch.compile backend"):
        load_config({"pt2": "nope"})
    with pytest.raises(ConfigError, match=r"pt2: unknown key\(s\) colour"):
        load_config({"pt2": {"backend": "inductor", "colour": "blue"}})


def test_custom_backend_as_module_function():
    spec = load_config({"pt2": {"compile": {"enable": True, "backend": "tests.faulty_backends:raise_on_compile"}}})
    from tests.faulty_backends import raise_on_compile

    assert spec.compile.kwargs()["backend"] is raise_on_compile


def test_the_input_mapping_is_never_mutated():
    raw = {"pt2": {"compile": {"enable": True, "options": {"epilogue_fusion": True}}},
           "pt2_handlers": {"ladder": ["compile"], "warmup": {"batch_sizes": [1]}}}
    before = copy.deepcopy(raw)
    config = load_config(raw)
    config.compile.kwargs()["options"]["epilogue_fusion"] = False
    assert raw == before
    assert config.settings.ladder == (RungName.COMPILE, RungName.EAGER)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"pt2": {"compile": {"enable": True, "colour": 1}}}, r"pt2.compile: unknown key\(s\) colour; allowed:"),
        ({"pt2": {"compile": {"enable": True}, "extra": 1}}, r"pt2: unknown key\(s\) extra"),
        ({"pt2": {"compile": {"enable": "yes"}}}, r"pt2.compile.enable must be bool, got str 'yes'"),
        ({"pt2": {"compile": {"enable": True, "dynamic": 1}}}, r"pt2.compile.dynamic must be bool, got int"),
        ({"pt2": {"compile": {"enable": True, "options": [1]}}}, r"pt2.compile.options must be Mapping"),
        ({"pt2": 3}, r"pt2 must be a mapping or a backend name, got int"),
        ({"pt2": {"compile": {"enable": True, "mode": "default", "options": {"epilogue_fusion": True}}}},
         r"set either mode or options, not both"),
        ({"pt2": {"compile": {"enable": True, "backend": "tensorrt-fast"}}},
         r"pt2.compile.backend: 'tensorrt-fast' is not a registered torch.compile backend; use one of: .*inductor"),
        ({"pt2": {"compile": {"enable": True, "backend": "no_such_module:fn"}}},
         r"cannot load custom backend 'no_such_module:fn': ModuleNotFoundError"),
        ({"pt2": {"compile": {"enable": True, "mode": "fastest"}}},
         r"pt2.compile.mode: 'fastest' is not a torch.compile mode; use one of: default, .*reduce-overhead"),
        ({"pt2": {"compile": {"enable": True, "backend": "eager", "mode": "reduce-overhead"}}},
         r"mode and options apply only to backend 'inductor'"),
        ({"pt2": {"compile": {"enable": True, "options": {"no_such_option": 1}}}},
         r"unknown inductor option\(s\) no_such_option"),
        ({"pt2": {"export": {"aot_compile": True}}}, r"pt2.export .* is not supported"),
        ({"pt2_handlers": {"task": "translation"}},
         r"pt2_handlers.task: unknown task 'translation'; use one of: embeddings"),
        ({"pt2_handlers": {"dtype": "float8"}}, r"pt2_handlers.dtype: 'float8' is not allowed; use one of: float32"),
        ({"pt2_handlers": {"ladder": ["compile", "tensorrt"]}}, r"unknown rung 'tensorrt'; use some of: compile"),
        ({"pt2_handlers": {"ladder": ["eager", "compile"]}}, r"eager is the last resort and must come last"),
        ({"pt2_handlers": {"ladder": ["compile", "compile"]}}, r"each rung may appear once"),
        ({"pt2_handlers": {"max_length": 0}}, r"pt2_handlers.max_length must be a positive integer, got 0"),
        ({"pt2_handlers": {"max_length": True}}, r"pt2_handlers.max_length must be int, got bool"),
        ({"pt2_handlers": {"warmup": {"batch_sizes": []}}}, r"warmup.batch_sizes must be a non-empty list"),
        ({"pt2_handlers": {"warmup": {"seq_lengths": [16, -1]}}}, r"warmup.seq_lengths must be a non-empty list"),
        ({"pt2_handlers": {"warmup": {"shapes": [1]}}}, r"pt2_handlers.warmup: unknown key\(s\) shapes"),
        ({"pt2_handlers": {"parity": {"atol": -1, "rtol": 0}}}, r"pt2_handlers.parity.atol must be a number >= 0"),
        ({"pt2_handlers": {"max_runtime_failure": 3}}, r"pt2_handlers: unknown key\(s\) max_runtime_failure"),
        ({"pt2_handlers": "embeddings"}, r"pt2_handlers must be a mapping, got str"),
    ],
)
def test_invalid_configs_name_the_key_and_what_is_allowed(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_settings_section_with_every_key():
    settings = load_config({"pt2_handlers": {
        "task": "embeddings", "model_dir": "weights", "max_length": 128, "dtype": "bfloat16",
        "ladder": ["safe_compile", "eager"], "warmup": {"batch_sizes": [1, 8], "seq_lengths": [32]},
        "parity": {"atol": 0.1, "rtol": 0}, "max_runtime_failures": 5, "max_inputs_per_request": 8,
    }}).settings
    assert settings.model_dir == "weights" and settings.max_length == 128
    assert settings.dtype is DType.BFLOAT16
    assert settings.ladder == (RungName.SAFE_COMPILE, RungName.EAGER)
    assert settings.warmup.shapes() == [(1, 32), (8, 32)]
    assert settings.tolerance == Tolerance(atol=0.1, rtol=0.0)
    assert (settings.max_runtime_failures, settings.max_inputs_per_request) == (5, 8)


def test_tolerance_defaults_per_dtype():
    assert load_config({"pt2_handlers": {"dtype": "float16"}}).settings.tolerance == DEFAULT_TOLERANCE[DType.FLOAT16]
    assert HandlerSettings().tolerance == DEFAULT_TOLERANCE[DType.FLOAT32]


def test_safer_compile_drops_the_risky_parts():
    spec = CompileSpec(enabled=True, backend="tests.faulty_backends:raise_on_compile", mode=None, dynamic=True,
                       fullgraph=True)
    assert spec.safer() == CompileSpec(enabled=True, backend="inductor")
