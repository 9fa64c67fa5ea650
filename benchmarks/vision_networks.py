"""The image classifiers the vision benchmarks serve, each as TorchServe's image classifier takes it: a ``model.py``,
its state_dict and the ImageNet ``index_to_name.json``.

* ``mobilenet_v2``: torchvision's MobileNetV2 with its ImageNet weights (docs/examples/mobilenet_v2, the weights from
  ``scripts/setup.sh --mobilenet-weights``): small and memory-bound, 0.3 GFLOPs an image;
* ``resnet50``: ResNet-50 (benchmarks/resnet50/model.py) with random weights from a fixed seed: compute-bound,
  4.1 GFLOPs an image.

Both are served with model_configs/mobilenet-image-classification.yaml's settings.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import REPO

EXAMPLE = REPO / "docs" / "examples" / "mobilenet_v2"
LABELS = EXAMPLE / "index_to_name.json"
SHIPPED = REPO / "model_configs" / "mobilenet-image-classification.yaml"


@dataclass(frozen=True)
class Network:
    name: str
    title: str
    model_file: Path
    needs_transformers: bool = False  # its model.py imports transformers (the stock-vision venv has none)

    def weights(self, work: Path, given: Path | None = None) -> Path:
        """The state_dict's path: ``given``, the MobileNetV2 ImageNet weights, or seeded random weights saved in
        ``work``."""
        if given:
            return given
        if self.name == "mobilenet_v2":
            return Path(subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--mobilenet-weights"], cwd=REPO,
                                       check=True, capture_output=True, text=True).stdout.strip())
        import torch

        from handlers.models.state_dict import module_class

        path = work / f"{self.name}-seed0.pth"
        if not path.exists():
            torch.manual_seed(0)
            torch.save(module_class(self.model_file)().state_dict(), path)
        return path


NETWORKS = {network.name: network for network in (
    Network("mobilenet_v2", "MobileNetV2 (ImageNet weights)", EXAMPLE / "model.py"),
    Network("resnet50", "ResNet-50 (random weights)", REPO / "benchmarks" / "resnet50" / "model.py",
            needs_transformers=True),
)}
