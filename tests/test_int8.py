"""int8, the opt-in precision: where it is tried, how its gate judges, and real models through the ladder in it.

The engine tests compile with dynamo's ``eager`` backend (the order of attempts and the gate are what is tested;
tests/test_torchserve.py serves the shipped int8 archive compiled by inductor)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from handlers.config import Choice, CompileSpec, ConfigError, DType, load_config
from handlers.cpu import features as cpu
from handlers.ladder import QualityError, race
from handlers.precision import choice as precisions
from handlers.precision import quantize
from handlers.serving.engine import Engine
from handlers.tasks.base import score_gate, softmax_scores

CPU = torch.device("cpu")
INT8, BF16, FP32, AUTO = DType.INT8, DType.BFLOAT16, DType.FLOAT32, DType.AUTO
VNNI_AND_BF16 = {"avx512_bf16": True, "avx512_vnni": True}
AVX2_ONLY: dict[str, bool] = {}
SHAPES = {"policy": "dynamic", "batch_sizes": [1, 2], "seq_lengths": [32]}
TEXTS = ["int8 keeps two nines of cosine", "a second, rather longer sentence about quantized linear layers"]


@pytest.mark.torchao
def test_int8_is_tried_on_every_cpu_its_weights_in_7_bits_where_the_cpu_has_no_int8_dot_products():
    configured = (INT8, BF16, FP32)
    for features in (VNNI_AND_BF16, AVX2_ONLY):
        assert precisions.resolve_precisions(configured, CPU, features) == Choice(configured, "configured")
    assert precisions.int8_weights(VNNI_AND_BF16) is quantize.Int8Weights.FULL
    assert precisions.int8_weights({"avx_vnni": True}) is quantize.Int8Weights.FULL
    assert precisions.int8_weights(AVX2_ONLY) is quantize.Int8Weights.SEVEN_BITS
    assert quantize.Int8Weights.SEVEN_BITS.describe().startswith("weights in [-64, 63]: the CPU has none of amx_int8")
    assert "int8 is CPU-only here" in quantize.int8_problem(torch.device("cuda"))


@pytest.mark.torchao
def test_auto_never_picks_int8_and_int8_then_auto_takes_what_auto_picks():
    amx = {"amx_bf16": True, "amx_int8": True}
    assert precisions.resolve_precisions((AUTO,), CPU, amx).value == (BF16, FP32)
    choice = precisions.resolve_precisions((INT8, AUTO), CPU, amx)
    assert choice.value == (INT8, BF16, FP32) and "auto: the CPU has amx_bf16" in choice.reason
    assert precisions.resolve_precisions((INT8, AUTO), CPU, {"avx512_vnni": True}).value == (INT8, FP32)
    assert precisions.resolve_precisions((INT8, AUTO), CPU, AVX2_ONLY).value == (INT8, FP32)


def test_without_torchao_int8_is_left_out_and_describe_says_why():
    """The ipex profile (torch 2.8) has no torchao; the default profile has, and there int8 is kept."""
    problem = quantize.probe_torchao()[1]
    choice = precisions.resolve_precisions((INT8, FP32), CPU, VNNI_AND_BF16)
    if problem is None:
        assert choice.value == (INT8, FP32)
    else:
        assert choice.value == (FP32,) and choice.reason == f"configured, less int8: {problem}"
        assert "torchao" in problem


def test_the_int8_score_gate_wants_every_top_label_kept():
    want = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.1, 0.0]])
    got = torch.tensor([[2.0, 1.0, 0.0], [0.1, 0.0, 0.0]])  # the second row's label flips; scores move ~0.05
    half = score_gate(BF16, {}, softmax_scores)
    assert 0.9 < half.measure(got, want) < 0.99  # bf16's gate judges the score error alone
    with pytest.raises(QualityError, match=r"1 of 2 top labels differ from fp32 eager's") as failed:
        score_gate(INT8, {}, softmax_scores).measure(got, want)
    assert failed.value.quality.metric == "score_agreement" and failed.value.quality.threshold == 0.95
    assert score_gate(INT8, {}, softmax_scores).measure(want, want) == 1.0


def test_the_int8_gate_thresholds_are_configurable_and_checked():
    raw = {"pt2_handlers": {"task": "embeddings", "quality_gate": {"min_cosine_int8": 0.995}}}
    assert dict(load_config(raw).settings.quality_gate) == {"min_cosine_int8": 0.995}
    raw["pt2_handlers"]["quality_gate"] = {"min_cosine_int8": 1.5}
    with pytest.raises(ConfigError, match=r"min_cosine_int8 is a cosine in \[-1, 1\]"):
        load_config(raw)


def test_generation_refuses_int8_in_the_yaml():
    with pytest.raises(ConfigError, match="text-generation serves float32"):
        load_config({"pt2_handlers": {"task": "text-generation", "dtype": ["int8", "float32"]}})


def load(model_dir: Path, task: str, dtype, **settings) -> Engine:
    torch._dynamo.reset()
    raw = {"pt2": {"compile": {"enable": True, "backend": "eager"}},
           "pt2_handlers": {"task": task, "model_dir": str(model_dir), "dtype": dtype, "shapes": SHAPES,
                            "ladder": ["compile", "safe_compile", "ipex", "eager"], **settings}}
    engine = Engine(load_config(raw), Path("/"), CPU, model_dir.name)
    engine.load()
    return engine


def steps(optimization: dict) -> list[tuple[str, str, str]]:
    return [(a["rung"], a["dtype"], a["status"]) for a in optimization["attempts"]]


def assert_raced(optimization: dict, rival: str) -> str:
    """int8 passed its screen and the compile's gate, and was raced against the compile in ``rival``: the faster
    (int8 only if at least 5 % faster) serves, the other is "slower", both with their times and describe's
    reason naming the outcome. Which one wins depends on the CPU (AMX makes bf16 faster); returns it."""
    attempts = optimization["attempts"]
    raced = {a["dtype"]: a for a in attempts  # TorchServe drops nulls; auto's bf16 screen races fp32 eager
             if a.get("forward_ms") is not None and not a["screen"] and a["rung"] == "compile"}
    assert set(raced) == {"int8", rival} and all(a["rung"] == "compile" for a in raced.values()), attempts
    statuses = {dtype: attempt["status"] for dtype, attempt in raced.items()}
    assert sorted(statuses.values()) == ["accepted", "slower"], attempts
    served = next(dtype for dtype, status in statuses.items() if status == "accepted")
    # Where the rung race ran (openvino serving all shapes, or some of them), it timed compile's winner again, over
    # its int8 race's times: those times are compared only where no rung race ran.
    if not optimization.get("rung_race"):
        assert served == ("int8" if race.pays(raced["int8"]["forward_ms"], raced[rival]["forward_ms"]) else rival)
    int8_steps = [step for step in steps(optimization) if step[1] == "int8"]  # bf16's screen may come first
    assert int8_steps == [("eager", "int8", "passed"), ("compile", "int8", raced["int8"]["status"])]
    if optimization["active"] != "compile":  # the compile rung's winner lost the rung race: openvino serves
        assert optimization["active"] == "openvino" and optimization["rung_race"]["served"].startswith("openvino"), \
            optimization
        return optimization["dtype"]
    assert optimization["dtype"] == served
    if served != "int8":
        assert "int8 passed the gate but was not faster here" in optimization["dtype_reason"], optimization
    return served


CALIBRATION_TEXTS = [  # what a search box might be sent, 12 texts: 9 to calibrate on, 3 held out
    "How do I reset my password without access to my old email address?",
    "Refunds are processed within five to seven business days after we receive the item.",
    "cheap flights to lisbon in march",
    "The committee postponed the vote so that members could review the amended budget.",
    "Why does my sourdough bread come out dense and flat?",
    "Kubernetes schedules pods onto nodes based on resource requests and affinity rules.",
    "Symptoms of dehydration include thirst, dark urine, fatigue and headache.",
    "The orchestra opened the season with a symphony and a new piece by a local composer.",
    "best running shoes for flat feet",
    "A memory leak in the worker process made latency climb until it was restarted.",
    "The bank raised its interest rate by a quarter point, citing inflation in services.",
    "Wildfires forced thousands of residents to leave as winds pushed the flames toward the valley.",
]


@pytest.mark.torchao
@pytest.mark.parametrize("calibration_file", [False, True], ids=["vocabulary-sample", "calibration-file"])
def test_minilm_embeddings_compile_in_int8_within_the_gate(minilm_dir, reference, tmp_path,
                                                           calibration_file):
    """int8 is calibrated on the archive's file, or on a vocabulary sample, and judged on the warmup batches and
    on held-out texts it was not calibrated on: describe says which, and gives the held-out value."""
    settings = {}
    if calibration_file:
        (tmp_path / "calibration.txt").write_text("\n".join(CALIBRATION_TEXTS), encoding="utf-8")
        settings["int8_calibration"] = str(tmp_path / "calibration.txt")  # the test's archive root is /
    engine = load(minilm_dir, "embeddings", ["int8", "float32"], **settings)
    optimization = engine.describe()["optimization"]
    served = assert_raced(optimization, "float32")
    assert (optimization["active"], optimization["dtype"]) == ("compile", served)
    warmed = len(engine.shapes.warmup_shapes())  # a held-out batch at each warmup shape: nothing new to compile
    path = tmp_path / "calibration.txt"
    said = (f"calibrated on 9 texts of {path} (5 batches); judged on the {warmed} warmup batches and {warmed} held-out "
            f"batches of the other 3 texts of {path}") if calibration_file else (
        f"calibrated on the warmup batches ({warmed} batches); judged on the {warmed} warmup batches and {warmed} "
        f"held-out batches of {sum(size for size, _ in engine.shapes.warmup_shapes())} texts of the vocabulary's")
    assert optimization["int8_calibration"].startswith(said), optimization["int8_calibration"]
    assert optimization["int8_weights"] == precisions.int8_weights().describe()
    for attempt in optimization["attempts"][:2]:
        assert attempt["quality"]["metric"] == "min_cosine"
        assert attempt["quality"]["threshold"] == 0.99 <= attempt["quality"]["value"] < 0.9999
        assert attempt["quality"]["value"] <= attempt["quality"]["held_out"] < 0.9999
    [answer] = engine.predict([{"inputs": TEXTS}])
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(answer["embeddings"]), reference(TEXTS), dim=-1)
    assert cosine.min().item() >= (0.99 if served == "int8" else 0.9999)


@pytest.mark.torchao
def test_a_head_whose_labels_int8_flips_is_screened_out_and_compiles_in_fp32(task_model_dirs):
    """The seeded NER head moves probabilities by 2-4 % even in bf16; in int8 its labels change: the int8 screen
    says so, and one compile serves fp32."""
    engine = load(task_model_dirs["minilm-ner"], "token-classification", ["int8", "float32"])
    optimization = engine.describe()["optimization"]
    assert steps(optimization) == [("eager", "int8", "failed"), ("compile", "float32", "accepted")]
    screen = optimization["attempts"][0]
    assert screen["screen"] and "so no rung runs in int8" in screen["reason"]
    assert screen["quality"]["metric"] == "score_agreement" and screen["quality"]["threshold"] == 0.95


@pytest.mark.torchao
def test_int8_quantizes_the_linears_and_leaves_the_rest_in_the_float_dtype_asked_for():
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                   torch.nn.Linear(64, 8))

    from torchao.utils import TorchAOBaseTensor

    reference = model()
    rows = torch.randn(4, 64)
    for rest in (torch.float32, torch.bfloat16):
        served = quantize.in_precision(model(), INT8, rest=rest)
        linear, norm = served[0].weight, served[1].weight
        assert isinstance(linear, TorchAOBaseTensor) and not isinstance(norm, TorchAOBaseTensor), type(linear)
        assert linear.act_quant_kwargs is not None  # activations quantized per row, on the fly
        assert norm.dtype == rest
        with torch.inference_mode():
            got = served(rows.to(rest)).float()
        cosine = torch.nn.functional.cosine_similarity(got, reference(rows), dim=-1).min().item()
        if int_mm_is_exact():  # the matmul torchao's dynamic scheme runs; it saturates on some CPUs (below)
            assert cosine > 0.99, (rest, cosine)


def int_mm_is_exact() -> bool:
    """Whether torch's s8 x s8 -> s32 matmul (under torchao's dynamic scheme) gives the exact products here."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (64, 32), dtype=torch.int8, generator=generator)
    return torch.equal(torch._int_mm(a, b), a.int() @ b.int())


def int8_matmul_is_exact(weights: quantize.Int8Weights) -> bool:
    """Whether the int8 rung's matmul (oneDNN's u8 x s8 ``qlinear``, which PT2E's int8 compiles to, frozen), its
    weights in ``weights``' range, gives the PT2E reference's answers here, for activations spread over the whole
    uint8 range."""
    from handlers.rungs import CompileRung

    generator = torch.Generator().manual_seed(0)
    examples = [{"inputs": torch.randn(64, 256, generator=generator) * 4} for _ in range(2)]

    class OneLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(256, 256)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.linear(inputs)

    module = quantize.static_int8(OneLinear().eval(), examples, keep_float=lambda name, layer: False, weights=weights)
    rung = CompileRung("compile", CompileSpec(enabled=True, backend="inductor"))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = module(**examples[0])
            with rung.warmup_context(1):
                got = rung.apply(module, DType.INT8)(**examples[0])
    finally:
        torch._dynamo.reset()
    # Exact int32 sums leave only float rounding (an activation a step off here and there: ~1e-3); saturated pair
    # sums leave 0.13 (an AVX2-only EPYC).
    return ((got - want).norm() / want.norm()).item() < 0.02


@pytest.mark.torchao
def test_the_int8_weights_this_cpu_gets_keep_its_matmuls_exact_where_full_range_ones_need_int8_dot_products():
    """Without VNNI or AMX, oneDNN multiplies u8 x s8 with AVX2's vpmaddubsw, which sums each pair of products into
    a saturating int16: full-range weights come out wrong (the linear layer below 13 % off the PT2E reference on an
    AVX2-only EPYC; MiniLM below the gate there). 7-bit weights cannot saturate it, so the CPUs that get them are
    exactly those where full-range ones would be wrong. (``torch._int_mm``, s8 x s8, is exact on that EPYC: the
    rung's own kernel is what is judged.) On an AVX-512 machine PT2_TEST_ISA=avx2 runs this as an AVX2-only CPU
    does."""
    features = cpu.cpu_features()
    assert int8_matmul_is_exact(precisions.int8_weights()), features
    full_is_exact = int8_matmul_is_exact(quantize.Int8Weights.FULL)
    assert full_is_exact == (precisions.int8_weights() is quantize.Int8Weights.FULL), features


@pytest.mark.torchao
def test_7_bit_weights_are_rounded_per_output_channel_into_64_steps_each_side():
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16).eval()
    examples = [{"input": torch.randn(4, 32)} for _ in range(2)]
    ranges = {}
    for weights in quantize.Int8Weights:
        module = quantize.static_int8(torch.nn.Sequential(copy.deepcopy(linear)), examples,
                                      keep_float=lambda name, layer: False, weights=weights)
        [stored] = [tensor for tensor in module.graph.state_dict().values() if tensor.dtype == torch.int8]
        # lowest, highest, and the smallest of the rows' largest magnitudes
        ranges[weights] = (stored.min().item(), stored.max().item(), stored.int().abs().amax(dim=1).min().item())
        with torch.no_grad():
            got = module(**examples[0])
        relative = ((got - linear(examples[0]["input"])).norm() / got.norm()).item()
        assert relative < 0.02, (weights, relative)
    # Symmetric per channel: each row's largest weight takes an end of the range.
    low, high, smallest_peak = ranges[quantize.Int8Weights.FULL]
    assert low >= -128 and high <= 127 and smallest_peak >= 127, ranges
    low, high, smallest_peak = ranges[quantize.Int8Weights.SEVEN_BITS]
    assert low >= -64 and high <= 63 and smallest_peak >= 63, ranges


@pytest.mark.torchao
def test_static_int8_keeps_narrowing_linears_in_float_and_serves_shapes_it_was_not_calibrated_on():
    """The ladder's int8 (PT2E, calibrated on the warmup batches): the widening and square linears get int8
    weights (one per-channel dequantize each), the narrowing one stays float; batch and length stay dynamic in the
    exported graph, even the length, which the examples never vary."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.up, self.down, self.same = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 16)

        def forward(self, x, mask):
            return self.same(self.down(torch.nn.functional.gelu(self.up(x)))) * mask.unsqueeze(-1)

    generator = torch.Generator().manual_seed(1)
    examples = [{"x": torch.randn(rows, length, 16, generator=generator), "mask": torch.ones(rows, length)}
                for rows, length in ((2, 5), (4, 5), (1, 5))]
    quantized = quantize.static_int8(Net().eval(), examples)
    targets = [str(node.target) for node in quantized.graph.graph.nodes if node.op == "call_function"]
    assert targets.count("quantized_decomposed.dequantize_per_channel.default") == 2, targets
    assert targets.count("aten.linear.default") == 3
    x = torch.randn(3, 9, 16, generator=generator)
    with torch.inference_mode():
        got, want = quantized(x=x, mask=torch.ones(3, 9)), Net().eval()(x, torch.ones(3, 9))
    assert got.shape == (3, 9, 16)
    assert torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min().item() > 0.99
    with pytest.raises(TypeError, match="warmup batches of named tensors"):
        quantize.static_int8(Net(), [torch.ones(2, 16)])


@pytest.mark.torchao
def test_static_int8_quantizes_convolutions_so_an_image_classifier_runs_int8_too():
    """torchao's x86 inductor quantizer takes convolutions (with their batch norms folded) as well as linear layers:
    an image classifier's int8 is the whole network, not only its head. Only the batch is dynamic in an image's
    graph after preprocessing, and it serves a batch size it was not calibrated on."""

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                   torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, pixel_values):
            return self.net(pixel_values)

    generator = torch.Generator().manual_seed(2)
    examples = [{"pixel_values": torch.rand(rows, 3, 32, 32, generator=generator)} for rows in (4, 2, 1)]
    quantized = quantize.static_int8(Classifier().eval(), examples)
    targets = [str(node.target) for node in quantized.graph.graph.nodes if node.op == "call_function"]
    # int8 weights for both convolutions; the head narrows (32 to 10 classes) and stays float by the linears' rule
    assert targets.count("quantized_decomposed.dequantize_per_channel.default") == 2, targets
    assert targets.count("aten.conv2d.default") == 2 and "aten.batch_norm.default" not in targets, targets
    pixels = torch.rand(3, 3, 32, 32, generator=generator)
    with torch.inference_mode():
        got, want = quantized(pixel_values=pixels).softmax(-1), net()(pixels).softmax(-1)
    assert (got - want).abs().max().item() < 0.05 and torch.equal(got.argmax(-1), want.argmax(-1)), (got, want)


@pytest.mark.torchao
def test_static_int8_leaves_attention_value_projections_in_float():
    """A value projection's error reaches every token's attention output unsoftened: it stays float, by its name in
    BERT, DistilBERT, BART/OPT/Llama or DeBERTa; the query beside it, as wide, gets int8 weights."""

    class Attention(torch.nn.Module):
        def __init__(self, value_name):
            super().__init__()
            torch.manual_seed(0)
            self.query = torch.nn.Linear(16, 16)
            setattr(self, value_name, torch.nn.Linear(16, 16))
            self.value_name = value_name

        def forward(self, x):
            return self.query(x) * getattr(self, self.value_name)(x)

    generator = torch.Generator().manual_seed(1)
    examples = [{"x": torch.randn(rows, 5, 16, generator=generator)} for rows in (2, 4)]
    for value_name in quantize.VALUE_PROJECTIONS:
        quantized = quantize.static_int8(Attention(value_name).eval(), examples)
        targets = [str(node.target) for node in quantized.graph.graph.nodes if node.op == "call_function"]
        assert targets.count("quantized_decomposed.dequantize_per_channel.default") == 1, (value_name, targets)
    assert not quantize.stays_float("encoder.layer.0.attention.self.query", torch.nn.Linear(16, 16))
    assert quantize.stays_float("encoder.layer.0.output.dense", torch.nn.Linear(64, 16))
