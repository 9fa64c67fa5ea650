"""Small Hugging Face image classifiers, built offline with fixed seeds and saved by ``save_pretrained`` beside their
image processors: a zoo of architectures (convolutional, transformer, hybrid) that needs no download and no
torchvision. Their answers mean nothing (random weights), but they are the same on every machine, which is all a
parity proof needs.

    .venv/bin/python -m tests.vision_models [--out .cache/test-models]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / ".cache" / "test-models"
SEED = 0
LABELS = 10
SIZE = 64  # pixels a side: small enough to compile in seconds


def _save(out: Path, config, model_class: str, processor) -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    config.num_labels = LABELS
    config.id2label = {index: f"class_{index}" for index in range(LABELS)}
    config.label2id = {name: index for index, name in config.id2label.items()}
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # non-trivial normalization statistics, as a trained model has
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    processor.save_pretrained(out)


def _builders() -> dict[str, Callable[[Path], None]]:
    import transformers as t

    crop = {"height": SIZE, "width": SIZE}
    return {
        "resnet": lambda out: _save(out, t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]),
                                    "ResNetForImageClassification",
                                    t.ConvNextImageProcessor(size={"shortest_edge": SIZE}, crop_pct=0.875)),
        "convnext": lambda out: _save(out, t.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1]),
                                      "ConvNextForImageClassification",
                                      t.ConvNextImageProcessor(size={"shortest_edge": SIZE}, crop_pct=0.875)),
        "vit": lambda out: _save(out, t.ViTConfig(image_size=SIZE, patch_size=16, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64),
                                 "ViTForImageClassification", t.ViTImageProcessor(size=crop)),
        "mobilenet_v2": lambda out: _save(out, t.MobileNetV2Config(image_size=SIZE, depth_multiplier=0.35),
                                          "MobileNetV2ForImageClassification",
                                          t.MobileNetV2ImageProcessor(size={"shortest_edge": SIZE + 8},
                                                                      crop_size=crop)),
        "regnet": lambda out: _save(out, t.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                        groups_width=8),
                                    "RegNetForImageClassification",
                                    t.ConvNextImageProcessor(size={"shortest_edge": SIZE}, crop_pct=0.875)),
        "swin": lambda out: _save(out, t.SwinConfig(image_size=SIZE, patch_size=4, embed_dim=16, depths=[1, 1],
                                                    num_heads=[2, 2], window_size=4),
                                  "SwinForImageClassification", t.ViTImageProcessor(size=crop)),
        "deit": lambda out: _save(out, t.DeiTConfig(image_size=SIZE, patch_size=16, hidden_size=32,
                                                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
                                  "DeiTForImageClassificationWithTeacher",
                                  t.DeiTImageProcessor(size={"height": SIZE + 8, "width": SIZE + 8}, crop_size=crop)),
        "efficientnet": lambda out: _save(out, t.EfficientNetConfig(image_size=SIZE, width_coefficient=0.25,
                                                                    depth_coefficient=0.25, hidden_dim=320),
                                          "EfficientNetForImageClassification",
                                          t.EfficientNetImageProcessor(size=crop)),
    }


NAMES = ("resnet", "convnext", "vit", "mobilenet_v2", "regnet", "swin", "deit", "efficientnet")


def build(name: str, out: Path = DEFAULT_OUT) -> Path:
    """The model's directory under ``out`` (built once; a finished build holds config.json)."""
    target = out / f"vision-{name}"
    if not (target / "config.json").is_file():
        partial = out / f"vision-{name}.partial"
        partial.mkdir(parents=True, exist_ok=True)
        _builders()[name](partial)
        partial.replace(target) if not target.exists() else None
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for name in NAMES:
        print(name, build(name, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
