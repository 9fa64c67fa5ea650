"""Image classification, model only: an image classifier (``--network``: MobileNetV2 with its ImageNet weights, or
ResNet-50 with random ones, benchmarks/vision_networks.py) in each form the ladder can serve and beside other
runtimes, side by side in one run, and what decoding and preprocessing cost per image.

Forms, each timed at batch 1 and 8 (224 x 224 inputs):

* ``eager-fp32`` and ``eager-fp32-channels_last``: the model as loaded, and with its weights and inputs in
  channels_last (the memory format oneDNN's convolutions prefer on CPU);
* ``compile-fp32`` and ``compile-fp32-channels_last``: ``torch.compile`` (inductor, default mode), static shapes;
* ``compile-bf16-channels_last``: the same in bf16 (where the CPU has bf16 dot products);
* ``compile-int8``: static int8 as the compile rung builds it with ``dtype: [int8, auto]``
  (``handlers.precision.quantize.static_int8``: torchao's x86 inductor quantizer, convolutions and linear layers,
  calibrated on 32 synthetic images; the rest in bf16 where the CPU has it), compiled frozen;
* ``openvino-f32`` and ``openvino-bf16``: the module exported and compiled by OpenVINO as the openvino rung does
  (``handlers.rungs.openvino``), at ``INFERENCE_PRECISION_HINT`` f32 and bf16 (bf16 only where the CPU has bf16 dot
  products);
* ``openvino-int8``: that IR quantized by NNCF (``nncf.quantize``: static int8, calibrated on 32 synthetic images),
  the rest at the bf16 hint where the CPU has bf16 dot products (needs nncf: the bench extra, not the product);
* ``onnxruntime-fp32``: the module exported by ``torch.onnx.export(dynamo=True)`` with a dynamic batch, run by ONNX
  Runtime's CPU provider (needs onnxruntime);
* ``served``: what the Engine serves from ``model_configs/mobilenet-image-classification.yaml`` (its ladder, gate and
  shape policy), softmax included.

Variants alternate within each round so that drift on a shared machine hits all alike; the table gives the median of
the rounds' medians, and the largest probability difference from eager fp32 on the same inputs. Decoding is timed on
scikit-learn's sample photographs (640 x 427 JPEGs) and on one scaled to 4000 x 2667: PIL's decode, the resize to 256,
the crop and the normalization (``handlers.tasks.images``), per image, in full and with ``jpeg_draft`` (decoded at a
reduced DCT scale).

    .venv/bin/python -m benchmarks.vision [--network mobilenet_v2|resnet50] [--rounds 5] [--iters 20] [--variants ...]
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import DEFAULT_OUT, log, markdown_table, run_header, write_csv, write_json, write_plot
from benchmarks.vision_networks import LABELS, NETWORKS, SHIPPED, Network

VARIANTS = ("eager-fp32", "eager-fp32-channels_last", "compile-fp32", "compile-fp32-channels_last",
            "compile-bf16-channels_last", "compile-int8", "openvino-f32", "openvino-bf16", "openvino-int8",
            "onnxruntime-fp32", "served")
BATCHES = (1, 8)


def load_model(network: Network, weights: Path) -> Any:
    import torch

    from handlers.models.state_dict import module_class, read_state_dict

    model = module_class(network.model_file)()
    model.load_state_dict(read_state_dict(weights))
    return model.eval().requires_grad_(False), torch


def has_bf16() -> bool:
    import torch

    from handlers.config import DType
    from handlers.precision import choice

    return DType.BFLOAT16 in choice.resolve_precisions((DType.AUTO,), torch.device("cpu")).value


def inputs(batch: int, seed: int = 3) -> Any:
    import torch

    from handlers.config.image import ImageSpec
    from handlers.tasks import images

    pictures = images.synthetic_images(batch, seed=seed)
    return torch.stack([images.to_pixels(picture, ImageSpec()) for picture in pictures])


def build(variant: str, model: Any, batch: int, root: Path) -> Callable[[Any], Any] | None:
    """A callable for ``variant`` on ``batch`` images (logits, or probabilities for ``served``), or None where this
    machine cannot run it."""
    import torch

    if "bf16" in variant and not has_bf16():
        log(f"{variant}: no bf16 dot products on this CPU, left out")
        return None
    if variant == "compile-int8":
        return _compile_int8(model)
    if variant.startswith("eager") or variant.startswith("compile"):
        channels_last = variant.endswith("channels_last")
        module = copy.deepcopy(model)
        if channels_last:
            module = module.to(memory_format=torch.channels_last)
        if variant.startswith("compile"):
            module = torch.compile(module, dynamic=False)
        layout = torch.channels_last if channels_last else torch.contiguous_format
        half = torch.autocast("cpu", torch.bfloat16, enabled="bf16" in variant)

        def forward(pixels: Any) -> Any:
            with half:
                return module(pixels.contiguous(memory_format=layout))
        return forward
    if variant == "openvino-int8":
        return _openvino_int8(model)
    if variant.startswith("openvino"):
        return _openvino(variant, model, batch)
    if variant == "onnxruntime-fp32":
        return _onnxruntime(model)
    return _served(root)


def _openvino(variant: str, model: Any, batch: int) -> Callable[[Any], Any] | None:
    import torch

    from handlers.config import DType
    from handlers.rungs.openvino import OpenVinoRung

    dtype = DType.BFLOAT16 if variant.endswith("bf16") else DType.FLOAT32
    rung = OpenVinoRung(torch.device("cpu"))
    rung.prepare([{"x": inputs(size)} for size in (1, max(BATCHES))])
    forward = rung.apply(_Keyword(model), dtype)
    return lambda pixels: forward(x=pixels)


def _optional(module: str, variant: str, install: str) -> Any:
    """A runtime only the benchmark uses, imported; None (logged: the variant is left out) where it is missing."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        log(f"{variant}: {module} does not import ({exc}); {install}. Left out")
        return None


def _openvino_int8(model: Any) -> Callable[[Any], Any] | None:
    """NNCF's post-training static int8 of the IR the openvino rung converts (calibrated on seeded images), compiled
    with the rung's own settings at bf16 where the CPU has it."""
    import openvino
    import torch

    from handlers.config import DType
    from handlers.rungs.openvino import OpenVinoRung, export

    nncf = _optional("nncf", "openvino-int8", "pip install nncf")
    if nncf is None:
        return None
    started = time.perf_counter()
    ir = openvino.convert_model(export(_Keyword(model), {"x": inputs(8)}, {"x": (2, 3)}))
    calibration = inputs(32, seed=21)
    quantized = nncf.quantize(ir, nncf.Dataset([calibration[i:i + 1].numpy() for i in range(len(calibration))]),
                              subset_size=len(calibration))
    log(f"openvino-int8: NNCF quantized the IR in {time.perf_counter() - started:.1f}s")
    settings = OpenVinoRung(torch.device("cpu")).config(DType.BFLOAT16 if has_bf16() else DType.FLOAT32)
    compiled = openvino.Core().compile_model(quantized, "CPU", settings)
    return lambda pixels: torch.from_numpy(compiled(pixels.numpy())[0].copy())


def _compile_int8(model: Any) -> Callable[[Any], Any]:
    """The model quantized as the compile rung's int8 is (calibrated on seeded images), compiled with freezing."""
    import torch
    import torch._inductor.config as inductor_config

    from handlers.precision.quantize import static_int8

    class Pixels(torch.nn.Module):  # called by keyword, as the ladder calls a task's module
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: Any) -> Any:
            return self.model(x)

    started = time.perf_counter()
    calibration = inputs(32, seed=21)
    quantized = static_int8(Pixels(), [{"x": calibration[i:i + 8]} for i in range(0, 32, 8)],
                            torch.bfloat16 if has_bf16() else torch.float32)
    log(f"compile-int8: quantized in {time.perf_counter() - started:.1f}s")
    compiled = torch.compile(quantized, dynamic=False)

    def forward(pixels: Any) -> Any:
        # frozen, as the rung compiles int8: oneDNN's int8 convolutions take constant weights (read while traced)
        with inductor_config.patch(freezing=True):
            return compiled(x=pixels)
    return forward


def _onnxruntime(model: Any) -> Callable[[Any], Any] | None:
    import tempfile

    import torch

    onnxruntime = _optional("onnxruntime", "onnxruntime-fp32", "install the bench extra")
    if onnxruntime is None:
        return None
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-onnx-") as tmp:
        path = Path(tmp) / "classifier.onnx"
        torch.onnx.export(model, (inputs(2),), str(path), dynamo=True, input_names=["pixels"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},), verbose=False)
        session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda pixels: torch.from_numpy(session.run(["logits"], {"pixels": pixels.numpy()})[0])


class _Keyword:
    """The model called with its input by name, as the ladder calls a task's module."""

    def __init__(self, model: Any):
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, x: Any) -> Any:
        return self.model(x)


def _served(root: Path) -> Callable[[Any], Any]:
    import torch
    import yaml

    from handlers.config import load_config
    from handlers.models.files import ModelFiles
    from handlers.serving.engine import Engine

    engine = Engine(load_config(yaml.safe_load(SHIPPED.read_text())), root, torch.device("cpu"), "classifier",
                    files=ModelFiles("model.py", "model.pth"))
    engine.load()
    optimization = engine.describe()["optimization"]
    log(f"served: rung {optimization['active']} in {optimization['dtype']}")
    assert engine.loaded is not None
    forward = engine.loaded.result.forward
    return lambda pixels: forward(pixel_values=pixels)


def decode_costs(rounds: int) -> dict[str, float]:
    """Median ms per image to decode and preprocess, per photograph size."""
    import sklearn.datasets
    from PIL import Image

    from handlers.config.image import ImageSpec
    from handlers.tasks import images

    photos = sorted((Path(sklearn.datasets.__file__).parent / "images").glob("*.jpg"))
    large = io.BytesIO()
    Image.open(photos[0]).resize((4000, 2667)).save(large, "JPEG", quality=90)
    costs = {}
    for name, data in (("640x427 JPEG", photos[0].read_bytes()), ("4000x2667 JPEG", large.getvalue())):
        for draft in (None, 256):
            timings = []
            for _ in range(rounds * 4):
                started = time.perf_counter()
                images.to_pixels(images.open_image(data, 10**8, draft=draft), ImageSpec())
                timings.append((time.perf_counter() - started) * 1000)
            label = f"{name}{', jpeg_draft' if draft else ''}"
            costs[label] = statistics.median(timings)
            log(f"decode + preprocess {label}: {costs[label]:.2f} ms per image")
    return costs


def time_round(forward: Callable[[Any], Any], pixels: Any, iters: int) -> float:
    import torch

    with torch.inference_mode():
        forward(pixels)
        timings = []
        for _ in range(iters):
            started = time.perf_counter()
            forward(pixels)
            timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--network", choices=NETWORKS, default="mobilenet_v2")
    parser.add_argument("--weights", type=Path, help="the network's state_dict (default: vision_networks' own)")
    parser.add_argument("--out", type=Path, default=None, help="default: .bench/vision-<network>")
    args = parser.parse_args(argv)
    import tempfile

    header = run_header(args)
    network = NETWORKS[args.network]
    args.out = args.out or DEFAULT_OUT / f"vision-{network.name}"
    root = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    weights = network.weights(root, args.weights)
    model, torch = load_model(network, weights)
    (root / "model.py").write_bytes(network.model_file.read_bytes())
    (root / "index_to_name.json").write_bytes(LABELS.read_bytes())
    (root / "model.pth").write_bytes(weights.read_bytes())
    costs = decode_costs(args.rounds)
    batches = {batch: inputs(batch) for batch in BATCHES}
    with torch.inference_mode():
        reference = {batch: model(pixels).softmax(-1) for batch, pixels in batches.items()}
    runners: dict[tuple[str, int], Callable[[Any], Any]] = {}
    for variant in args.variants:
        for batch in BATCHES:
            started = time.perf_counter()
            runner = build(variant, model, batch, root) if variant != "served" or (variant, 1) not in runners \
                else runners[(variant, 1)]
            if runner is None:
                break
            with torch.inference_mode():
                runner(batches[batch])  # compiles, converts or loads here
            log(f"{variant} at batch {batch}: ready in {time.perf_counter() - started:.1f}s")
            runners[(variant, batch)] = runner
    medians: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
    for round_index in range(args.rounds):
        for key, runner in runners.items():
            medians[key].append(time_round(runner, batches[key[1]], args.iters))
        log(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{variant}@{batch} {values[-1]:.2f}" for (variant, batch), values in medians.items()))
    rows = []
    for (variant, batch), values in medians.items():
        with torch.inference_mode():
            out = runners[(variant, batch)](batches[batch]).float()
        probabilities = out if variant == "served" else out.softmax(-1)
        error = (probabilities - reference[batch]).abs().max().item()
        same_top1 = bool((probabilities.argmax(-1) == reference[batch].argmax(-1)).all())
        eager = statistics.median(medians[("eager-fp32", batch)]) if ("eager-fp32", batch) in medians else None
        ms = statistics.median(values)
        rows.append({"variant": variant, "batch": batch, "ms": round(ms, 3),
                     "x_eager_fp32": round(eager / ms, 2) if eager else None, "max_prob_error": round(error, 4),
                     "top1_same": same_top1})
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "vision.csv", rows)
    write_json(args.out / "vision.json", {**header, "rows": rows, "decode_ms_per_image": costs})
    table = markdown_table(["form", *(f"batch {b} ms" for b in BATCHES), *(f"x eager @{b}" for b in BATCHES),
                            "max prob error", "top-1 same"],
                           [[variant, *(next((r["ms"] for r in rows if r["variant"] == variant and r["batch"] == b),
                                             "") for b in BATCHES),
                             *(next((r["x_eager_fp32"] for r in rows if r["variant"] == variant and r["batch"] == b),
                                    "") for b in BATCHES),
                             max(r["max_prob_error"] for r in rows if r["variant"] == variant),
                             all(r["top1_same"] for r in rows if r["variant"] == variant)]
                            for variant in dict.fromkeys(r["variant"] for r in rows)])
    print(table)
    print("decode + preprocess per image: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in costs.items()))
    (args.out / "vision.md").write_text(table + "\n")
    write_plot(args.out / "vision.png", f"{network.title}, model only (ms, lower is better)", [str(b) for b in BATCHES],
               [("ms", {variant: [next((r["ms"] for r in rows if r["variant"] == variant and r["batch"] == b), 0.0)
                                  for b in BATCHES] for variant in dict.fromkeys(r["variant"] for r in rows)})])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
