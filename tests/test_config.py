"""Every accepted pt2 form parses; each kind of invalid config gets its own clear error."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from handlers.config import CompileSpec, DType, HandlerSettings, RungName, TooLong, load_config
from handlers.config.shapes import AfterReady, PolicyKind, ShapePolicy
from handlers.cpu.threads import resolve_threads
from handlers.errors import ConfigError
from handlers.precision.choice import resolve_precisions

MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "model_configs"


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
           "pt2_handlers": {"ladder": ["compile"], "shapes": {"batch_sizes": [1]}, "quality_gate": {"min_cosine": 0.9}}}
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
        ({"pt2": {"compile": {"enable": True, "options": [1]}}},
         r"pt2.compile.options must be a mapping, got list \[1\]"),
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
        ({"pt2": {"export": {"aot_compile": "yes"}}}, r"pt2.export.aot_compile must be bool, got str 'yes'"),
        ({"pt2": {"export": {"aot_compil": True}}}, r"pt2.export: unknown key\(s\) aot_compil \(did you mean "),
        ({"pt2": {"exprt": {"aot_compile": True}}}, r"pt2: unknown key\(s\) exprt \(did you mean export\?\)"),
        ({"pt2_handlers": {"task": "translation"}},
         r"pt2_handlers.task: unknown task 'translation'; use one of: embeddings"),
        ({"pt2_handlers": {"dtype": "float8"}},
         r"pt2_handlers.dtype: 'float8' is not allowed \(did you mean float32\?\); use one of: auto, float32"),
        ({"pt2_handlers": {"ladder": ["compile", "tensorrt"]}},
         r"unknown rung 'tensorrt'; use some of: aot, openvino, compile"),
        ({"pt2_handlers": {"ladder": ["eager", "compile"]}}, r"eager is the last resort and must come last"),
        ({"pt2_handlers": {"ladder": ["compile", "compile"]}}, r"each rung may appear once"),
        ({"pt2_handlers": {"max_length": 0}}, r"pt2_handlers.max_length must be a positive integer, got 0"),
        ({"pt2_handlers": {"max_length": True}}, r"pt2_handlers.max_length must be int, got bool"),
        ({"pt2_handlers": {"shapes": {"batch_sizes": []}}}, r"shapes.batch_sizes must be a non-empty list"),
        ({"pt2_handlers": {"shapes": {"seq_lengths": [16, -1]}}},
         r"pt2_handlers.shapes.seq_lengths\[1\] must be a positive integer, got -1"),
        ({"pt2_handlers": {"shapes": {"buckets": [1]}}}, r"pt2_handlers.shapes: unknown key\(s\) buckets"),
        ({"pt2_handlers": {"shapes": {"policy": "static"}}},
         r"shapes.policy: 'static' is not allowed; use one of: buckets"),
        ({"pt2_handlers": {"shapes": {"after_ready": "ignore"}}},
         r"after_ready: 'ignore' is not allowed; use one of: eager"),
        ({"pt2_handlers": {"shapes": {"policy": "dynamic", "batch_sizes": [4, 8]}}},
         r"the dynamic policy warms batch size 1 and one >= 2"),
        ({"pt2": {"compile": {"enable": True, "dynamic": False}}, "pt2_handlers": {"shapes": {"policy": "dynamic"}}},
         r"pt2_handlers.shapes.policy: dynamic contradicts pt2.compile.dynamic: false; drop one of them"),
        ({"pt2_handlers": {"quality_gate": {"min_cosine": 2}}}, r"quality_gate.min_cosine is a cosine in \[-1, 1\]"),
        ({"pt2_handlers": {"quality_gate": {"atol": 0.1}}},
         r"quality_gate: unknown key\(s\) atol; allowed: min_cosine"),
        ({"pt2_handlers": {"threads": 0}}, r"pt2_handlers.threads must be a positive integer"),
        ({"pt2_handlers": {"threads": "many"}}, r"pt2_handlers.threads must be int"),
        ({"pt2_handlers": {"compile_cache": 3}}, r"pt2_handlers.compile_cache must be str"),
        ({"minWorkers": 0}, r"minWorkers must be a positive integer"),
        ({"batchSize": 4, "maxBatchDelay": 0}, r"maxBatchDelay is 0, which TorchServe 0.12 reads as unset: it would "
                                               r"hold each lone request for its default 100 ms"),
        ({"maxBatchDelay": -1}, r"maxBatchDelay must be 0 or more, got -1"),
        ({"asyncCommunication": True}, r"asyncCommunication is true, which has TorchServe 0.12 await each "
                                        r"request's answer from the handler; .*: remove asyncCommunication"),
        ({"pt2_handlers": {"max_runtime_failure": 3}}, r"pt2_handlers: unknown key\(s\) max_runtime_failure"),
        ({"pt2_handlers": "embeddings"}, r"pt2_handlers must be a mapping, got str"),
        ({"pt2_handlers": {"too_long": "cut"}}, r"pt2_handlers.too_long: 'cut' is not allowed; use one of: reject, "
                                                r"truncate"),
    ],
)
def test_invalid_configs_name_the_key_and_what_is_allowed(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


@pytest.mark.parametrize(("raw", "hint"), [
    ({"pt2": {"compile": {"enable": True, "mdoe": "default"}}}, "unknown key(s) mdoe (did you mean mode?)"),
    ({"pt2": {"compile": {"enable": True, "mode": "reduce_overhead"}}}, "(did you mean reduce-overhead?)"),
    ({"pt2": {"compile": {"enable": True, "options": {"cpp_wraper": True}}}}, "(did you mean cpp_wrapper?)"),
    ({"pt2_handlers": {"task": "text-generaton"}}, "unknown task 'text-generaton' (did you mean text-generation?)"),
    ({"pt2_handlers": {"dtype": "bfloat"}}, "'bfloat' is not allowed (did you mean bfloat16?)"),
    ({"pt2_handlers": {"ladder": ["compil"]}}, "unknown rung 'compil' (did you mean compile?)"),
    ({"pt2_handlers": {"shapes": {"batch_size": [1]}}}, "unknown key(s) batch_size (did you mean batch_sizes?)"),
    ({"pt2_handlers": {"max_runtime_failure": 3}}, "(did you mean max_runtime_failures?)"),
])
def test_a_misspelt_name_gets_the_nearest_valid_one(raw, hint):
    with pytest.raises(ConfigError) as error:
        load_config(raw)
    assert hint in str(error.value)


def test_a_key_far_from_every_valid_one_gets_no_guess():
    with pytest.raises(ConfigError) as error:
        load_config({"pt2": {"compile": {"enable": True, "colour": 1}}})
    assert "did you mean" not in str(error.value)


def test_every_problem_is_reported_at_once_in_the_yamls_order():
    raw = {"pt2": {"compile": {"enable": True, "dynamic": False, "fullgraph": "no"}},
           "pt2_handlers": {"ladder": ["compil", "eager", "tensorrt"],
                            "shapes": {"policy": "dynamic", "batch_size": [1]},
                            "quality_gate": {"min_cosine": 2, "min_cosine_half": "high", "atol": 1}, "threads": 0},
           "minWorkers": True}
    with pytest.raises(ConfigError) as caught:
        load_config(raw)
    assert [problem.split(" ")[0].rstrip(":") for problem in caught.value.problems] == [
        "pt2.compile.fullgraph", "pt2_handlers.ladder[0]", "pt2_handlers.ladder[2]", "pt2_handlers.shapes.policy",
        "pt2_handlers.shapes", "pt2_handlers.quality_gate", "pt2_handlers.quality_gate.min_cosine",
        "pt2_handlers.quality_gate.min_cosine_half", "pt2_handlers.threads", "minWorkers"]
    assert "shapes: unknown key(s) batch_size (did you mean batch_sizes?)" in caught.value.problems[4]
    assert caught.value.message.startswith("10 problems:\n  pt2.compile.fullgraph must be bool, got str 'no'\n")


def test_a_check_on_a_wrong_field_is_left_to_its_own_error():
    """Which gate keys, shapes and precisions are allowed depends on the task: with the task wrong, only it is named."""
    with pytest.raises(ConfigError) as caught:
        load_config({"pt2_handlers": {"task": "text-generaton", "dtype": "bfloat16", "quality_gate": {"min_cosine": 2},
                                      "shapes": {"policy": "dynamic", "batch_sizes": [1, 2]}}})
    assert caught.value.problems == (
        "pt2_handlers.task: unknown task 'text-generaton' (did you mean text-generation?); use one of: embeddings, "
        "image-classification, question-answering, tensor, text-classification, text-generation, "
        "token-classification, or module:Class for a task of your own",)


def test_a_task_default_is_checked_like_a_written_value():
    """text-generation refuses the dynamic policy that pt2.compile.dynamic implies, with no shapes key written."""
    with pytest.raises(ConfigError, match=r"pt2_handlers.shapes: text-generation compiles static shapes only"):
        load_config({"pt2": {"compile": {"enable": True, "dynamic": True}},
                     "pt2_handlers": {"task": "text-generation"}})


def test_a_key_left_empty_means_its_default():
    config = load_config({"pt2": None, "pt2_handlers": {"task": None, "shapes": {"policy": None}, "threads": None},
                          "minWorkers": None})
    assert config == load_config({})


def test_a_value_is_quoted_as_given_even_with_braces():
    with pytest.raises(ConfigError, match=r"unknown task '\{task\}'"):
        load_config({"pt2_handlers": {"task": "{task}"}})


def test_int8_is_taken_only_when_named():
    assert load_config({"pt2_handlers": {"dtype": "int8"}}).settings.dtype == (DType.INT8,)
    assert load_config({"pt2_handlers": {"dtype": ["int8", "float32"]}}).settings.dtype == (DType.INT8, DType.FLOAT32)
    with pytest.raises(ConfigError, match=r"pt2_handlers.dtype: 'fp16' is not allowed \(did you mean float16\?\)"):
        load_config({"pt2_handlers": {"dtype": "fp16"}})


def test_settings_section_with_every_key():
    settings = load_config({"pt2_handlers": {
        "task": "embeddings", "model_dir": "weights", "max_length": 128, "dtype": "bfloat16",
        "ladder": ["safe_compile", "eager"], "shapes": {"policy": "buckets", "batch_sizes": [1, 8],
                                                       "seq_lengths": [32], "after_ready": "fail"},
        "quality_gate": {"min_cosine": 0.99, "min_cosine_half": 0.98}, "freezing": False, "threads": 3,
        "compile_cache": "/srv/cache", "max_runtime_failures": 5, "max_inputs_per_request": 8,
        "too_long": "reject", "batch_metrics_every_s": 5,
    }}).settings
    assert settings.model_dir == "weights" and settings.max_length == 128
    assert settings.too_long is TooLong.REJECT
    assert settings.dtype == (DType.BFLOAT16,)
    assert settings.ladder == (RungName.SAFE_COMPILE, RungName.EAGER)
    assert settings.shapes == ShapePolicy(PolicyKind.BUCKETS, (1, 8), (32,), AfterReady.FAIL)
    assert settings.shapes.warmup_shapes() == [(1, 32), (8, 32)]
    assert dict(settings.quality_gate) == {"min_cosine": 0.99, "min_cosine_half": 0.98}
    assert (settings.freezing, settings.threads, settings.compile_cache) == (False, 3, "/srv/cache")
    assert (settings.max_runtime_failures, settings.max_inputs_per_request) == (5, 8)
    assert settings.batch_metrics_every_s == 5.0


@pytest.mark.parametrize("every_s", [-1, True, "1s"])
def test_batch_metrics_every_s_is_a_number_of_seconds(every_s):
    assert load_config({}).settings.batch_metrics_every_s == 1.0
    assert load_config({"pt2_handlers": {"batch_metrics_every_s": 0}}).settings.batch_metrics_every_s == 0.0
    with pytest.raises(ConfigError, match="pt2_handlers.batch_metrics_every_s"):
        load_config({"pt2_handlers": {"batch_metrics_every_s": every_s}})


def test_seq_multiple_is_read_from_the_shapes_section():
    shapes = load_config({"pt2_handlers": {"shapes": {"policy": "dynamic", "batch_sizes": [1, 4],
                                                      "seq_multiple": 8}}}).settings.shapes
    assert shapes.seq_multiple == 8
    assert load_config({}).settings.shapes.seq_multiple is None  # chosen at load from the precision served
    with pytest.raises(ConfigError, match="seq_multiple must be a positive integer"):
        load_config({"pt2_handlers": {"shapes": {"seq_multiple": 0}}})


def test_defaults_are_the_cpu_fast_path():
    settings = HandlerSettings()
    # freezing is off unless the YAML asks: faster forwards, slower warm starts
    assert settings.dtype == (DType.AUTO,) and not settings.freezing and settings.threads is None
    assert settings.shapes.after_ready is AfterReady.EAGER
    assert load_config({"pt2_handlers": {"threads": "auto"}}).settings.threads is None


def test_shape_policy_follows_pt2_dynamic_when_not_given():
    assert load_config({"pt2": {"compile": {"enable": True, "dynamic": True}}}).settings.shapes.dynamic
    assert load_config({"pt2": {"compile": {"enable": True}}}).settings.shapes.kind is PolicyKind.BUCKETS


def test_served_compile_adds_freezing_and_spells_the_mode_as_options():
    config = load_config({"pt2": {"compile": {"enable": True, "mode": "reduce-overhead"}},
                          "pt2_handlers": {"freezing": True}})
    kwargs = config.served_compile.kwargs()
    assert "mode" not in kwargs and kwargs["dynamic"] is False
    assert kwargs["options"]["freezing"] is True and kwargs["options"]["triton.cudagraphs"] is True
    unfrozen = load_config({"pt2": {"compile": {"enable": True, "mode": "reduce-overhead"}}}).served_compile.kwargs()
    assert unfrozen["mode"] == "reduce-overhead" and "options" not in unfrozen
    eager_backend = load_config({"pt2": {"compile": {"enable": True, "backend": "eager"}}}).served_compile
    assert eager_backend.freezing is False  # freezing is an inductor pass


@pytest.mark.parametrize(("features", "precisions", "said"), [
    ({"amx_bf16": False, "avx512_bf16": True}, (DType.BFLOAT16, DType.FLOAT32), "the CPU has avx512_bf16"),
    ({"amx_bf16": True, "avx512_bf16": True}, (DType.BFLOAT16, DType.FLOAT32), "the CPU has amx_bf16/avx512_bf16"),
    ({"amx_bf16": False, "avx512_bf16": False}, (DType.FLOAT32,), "bf16 would be emulated"),
])
def test_dtype_auto_resolves_to_an_ordered_list_from_the_cpu_flags(features, precisions, said):
    """Both CPU kinds on any machine: the flags are injected, not read from this CPU."""
    choice = resolve_precisions((DType.AUTO,), torch.device("cpu"), features)
    assert choice.value == precisions and said in choice.reason


def test_dtype_auto_asks_torch_for_the_cpu_flags_by_default(monkeypatch):
    from handlers.cpu import features as cpu

    monkeypatch.setattr(cpu, "cpu_features", lambda: {"amx_bf16": False, "avx512_bf16": False})
    assert resolve_precisions((DType.AUTO,), torch.device("cpu")).value == (DType.FLOAT32,)


AVX512_AND_AMX = {"amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni"}


@pytest.mark.parametrize(("aten", "onednn", "held"), [
    ("AVX512", None, set()),
    ("AVX512", "ALL", set()),
    ("AVX512", "no such level", set()),
    ("AVX2", None, AVX512_AND_AMX),  # ATEN_CPU_CAPABILITY=avx2: inductor emits AVX2 too
    # oneDNN's levels are sets of extensions: AVX-VNNI is in AVX2_VNNI, not in the AVX-512 levels that have their own
    ("AVX512", "AVX512_CORE_AMX", {"avx_vnni"}),  # oneDNN's older name for AVX10_1_512_AMX
    ("AVX512", "avx512_core_bf16", {"amx_bf16", "amx_int8", "avx_vnni"}),
    ("AVX512", "AVX512_CORE_VNNI", {"amx_bf16", "amx_int8", "avx512_bf16", "avx_vnni"}),
    ("AVX512", "AVX512_CORE", AVX512_AND_AMX | {"avx_vnni"}),
    ("AVX512", "AVX2_VNNI", AVX512_AND_AMX),
    ("AVX512", "AVX2", AVX512_AND_AMX | {"avx_vnni"}),
])
def test_features_torch_or_onednn_are_held_below_are_not_used(aten, onednn, held):
    from handlers.cpu.features import features_held_back

    assert features_held_back(aten, onednn) == held


def test_kernels_held_to_avx2_serve_fp32_and_take_7_bit_int8_weights_as_an_avx2_cpu_does():
    """A real worker-like process with torch's and oneDNN's own switches set, as PT2_TEST_ISA=avx2 runs the suite.
    int8, where torchao imports, is tried with 7-bit weights, which AVX2's int16 pair sums cannot saturate."""
    import subprocess
    import sys

    probe = ("import torch; from handlers.cpu import features; from handlers.precision import choice, quantize\n"
             "from handlers.config import DType as D\n"
             "cpu = torch.device('cpu')\n"
             "print(choice.resolve_precisions((D.AUTO,), cpu).value == (D.FLOAT32,))\n"
             "int8 = (D.INT8,) if quantize.probe_torchao()[0] is not None else ()\n"
             "print(choice.resolve_precisions((D.INT8, D.AUTO), cpu).value == (*int8, D.FLOAT32))\n"
             "print(choice.resolve_precisions((D.AUTO,), cpu).reason)\n"
             "print(sorted(name for name, found in features.cpu_has().items() if found))\n"
             "print(choice.int8_weights().name)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.splitlines()
    assert out[:2] == ["True", "True"] and out[4] == "SEVEN_BITS", out
    if any(name in out[3] for name in AVX512_AND_AMX | {"avx_vnni"}):  # a CPU with them: describe says who held them
        assert "held back here:" in out[2] and "torch dispatches at AVX2, ONEDNN_MAX_CPU_ISA=AVX2" in out[2], out[2]
    else:
        assert "held back" not in out[2], out[2]


@pytest.mark.parametrize(("dtype", "precisions"), [
    ("float16", (DType.FLOAT16,)),
    ("bfloat16", (DType.BFLOAT16,)),
    (["bfloat16", "float32"], (DType.BFLOAT16, DType.FLOAT32)),
    (["float32"], (DType.FLOAT32,)),
    (["float16", "auto"], (DType.FLOAT16, *resolve_precisions((DType.AUTO,), torch.device("cpu")).value)),
])
def test_an_explicit_dtype_or_list_is_tried_as_written(dtype, precisions):
    configured = load_config({"pt2_handlers": {"dtype": dtype}}).settings.dtype
    assert resolve_precisions(configured, torch.device("cpu")).value == precisions


@pytest.mark.parametrize(("dtype", "message"), [
    (["auto", "int8"], "dtype[0]: auto may only end a list, after a precision: [int8, auto] tries int8, then"),
    (["auto"], "dtype[0]: auto may only end a list, after a precision"),
    (["int8", "avto"], "'avto' is not a precision (did you mean auto?); a list takes some of: float32, bfloat16, "
                       "float16, int8, and auto last"),
    (["bfloat61"], "'bfloat61' is not a precision (did you mean bfloat16?)"),
    (["float32", "float32"], "a list names each precision once, at least one"),
    ([], "a list names each precision once, at least one"),
    (3, "pt2_handlers.dtype must be str or list, got int 3"),
])
def test_a_bad_dtype_list_is_refused_with_what_is_allowed(dtype, message):
    with pytest.raises(ConfigError) as caught:
        load_config({"pt2_handlers": {"dtype": dtype}})
    assert message in str(caught.value)


def test_threads_share_the_cores_among_workers(monkeypatch):
    from handlers.cpu import threads

    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    cpu = torch.device("cpu")
    assert resolve_threads(None, 1, cpu).value == 2
    assert resolve_threads(None, 2, cpu).value == 1  # two workers on two cores: one thread each
    assert resolve_threads(None, 4, cpu).value == 1
    assert resolve_threads(3, 2, cpu).value == 3
    assert load_config({"minWorkers": 2}).workers == 2


def test_threads_auto_follows_omp_num_threads_where_a_launcher_set_it(monkeypatch):
    """TorchServe's cpu_launcher pins each worker to its own cores and sets OMP_NUM_THREADS for it: dividing
    those cores by minWorkers again would leave cores idle."""
    from handlers.cpu import threads

    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    cpu = torch.device("cpu")
    choice = resolve_threads(None, 2, cpu, {"OMP_NUM_THREADS": "4"})
    assert (choice.value, choice.reason) == (4, "auto: OMP_NUM_THREADS=4 in this worker's environment")
    assert resolve_threads(None, 2, cpu, {"OMP_NUM_THREADS": "0"}).value == 4  # not a setting: cores / workers
    assert resolve_threads(None, 2, cpu, {}).value == 4
    assert resolve_threads(2, 2, cpu, {"OMP_NUM_THREADS": "4"}).value == 2  # the YAML wins


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({}, None),
])
def test_a_container_cpu_limit_caps_the_usable_cores(tmp_path, files, quota):
    """A Kubernetes limits.cpu is a cgroup quota, not an affinity: threads auto must not exceed it (each thread
    past it waits in OpenMP barriers for time the container no longer has)."""
    from handlers.cpu.threads import available_cores, cpu_quota

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path) == (affinity if quota is None else max(1, min(affinity, int(quota))))


def test_safer_compile_drops_the_risky_parts():
    spec = CompileSpec(enabled=True, backend="tests.faulty_backends:raise_on_compile", mode=None, dynamic=True,
                       fullgraph=True)
    assert spec.safer() == CompileSpec(enabled=True, backend="inductor", dynamic=True)
    assert spec.with_shapes(dynamic=False, freezing=True).safer().freezing is False
    shaped = spec.with_shapes(dynamic=True, freezing=False)
    assert shaped.one_graph and not shaped.safer().one_graph  # the safer rung keeps torch's size-1 graph
    assert not spec.with_shapes(dynamic=False, freezing=False).one_graph


@pytest.mark.parametrize("name", sorted(path.name for path in MODEL_CONFIGS.glob("minilm-*.yaml")))
def test_every_shipped_model_yaml_loads(name):
    import yaml

    config = load_config(yaml.safe_load((MODEL_CONFIGS / name).read_text()))
    assert config.compile.enabled and config.settings.task in name  # minilm-embeddings-int8.yaml: embeddings


def test_the_grafana_dashboard_uses_only_declared_metrics():
    """deploy/grafana-dashboard.json queries exactly the names model_configs/metrics.yaml declares (and
    TorchServe's own), so a renamed metric breaks this test, not the dashboard."""
    import json
    import re

    import yaml

    repo = Path(__file__).resolve().parent.parent
    declared = yaml.safe_load((repo / "model_configs" / "metrics.yaml").read_text())
    names = {metric["name"] for section in ("ts_metrics", "model_metrics") for kind in declared[section].values()
             for metric in kind}
    dashboard = json.loads((repo / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\b((?:Pt2|ts_)\w+)\b", expr)}
    assert used and used <= names, used - names
    pt2 = {name for name in names if name.startswith("Pt2")}
    assert pt2 <= used, f"metrics not on the dashboard: {pt2 - used}"


def test_pt2_export_aot_compile_is_read_as_torchserve_writes_it_and_puts_the_aot_rung_first():
    """TorchServe's own key: pt2.export.aot_compile, beside pt2.compile or alone (then compile stays off, with a
    warning that the JIT fallback does not compile)."""
    from handlers.rungs import ladder_of

    both = load_config({"pt2": {"compile": {"enable": True}, "export": {"aot_compile": True}}})
    assert both.aot_compile and both.compile.enabled and both.warnings == ()
    assert [rung.value for rung in ladder_of(both)] == ["aot", "openvino", "compile", "safe_compile", "ipex", "eager"]
    alone = load_config({"pt2": {"export": {"aot_compile": True}}})
    assert alone.aot_compile and not alone.compile.enabled
    assert "pt2.compile is not set" in alone.warnings[0]
    listed = load_config({"pt2": {"export": {"aot_compile": True}}, "pt2_handlers": {"ladder": ["compile", "aot"]}})
    assert [rung.value for rung in ladder_of(listed)] == ["compile", "aot", "eager"]  # where the YAML puts it
    off = load_config({"pt2": {"compile": {"enable": True}, "export": {"aot_compile": False}}})
    assert not off.aot_compile and "aot" not in [rung.value for rung in ladder_of(off)]
