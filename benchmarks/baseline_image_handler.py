"""TorchServe's stock ``image_classifier`` handler, as a user serves an image classifier without pt2-handlers: a
comparison baseline, not product code.

Why it exists: benchmarks/e2e_vision.py measures pt2-handlers against TorchServe's own image classifier. That
handler imports torchvision for its transforms, and torchvision does not load beside the CPU torch wheel here, so
this file keeps everything of it (``BaseHandler``'s loading of model.py + state_dict, its ``pt2`` compile when the
model YAML asks, ``VisionHandler.preprocess``, ``ImageClassifier.postprocess``: softmax, top 5,
``index_to_name.json``) and does the four transforms (Resize 256, CenterCrop 224, ToTensor, Normalize) with PIL and
numpy as torchvision does them on a PIL image, so it runs in the product's venv beside pt2-handlers' archives.
``e2e_vision --stock torchvision`` serves TorchServe's own handler instead, from a venv where torchvision loads
(``scripts/setup.sh --profile stock-vision``); the two measured alike (docs/performance.md).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import map_class_to_label

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def image_processing(image: Image.Image) -> torch.Tensor:
    """torchvision's Resize(256), CenterCrop(224), ToTensor(), Normalize(ImageNet) on a PIL image."""
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    if short != 256:
        new_long = int(256 * long / short)
        image = image.resize((256, new_long) if width <= height else (new_long, 256), Image.Resampling.BILINEAR)
    width, height = image.size
    top, left = int(round((height - 224) / 2.0)), int(round((width - 224) / 2.0))
    image = image.crop((left, top, left + 224, top + 224))
    pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
    return (pixels.float() / 255.0 - MEAN) / STD


class BaselineImageClassifier(BaseHandler):
    topk = 5

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, str):
                image = base64.b64decode(image)
            if isinstance(image, (bytearray, bytes)):
                image = image_processing(Image.open(io.BytesIO(image)))
            else:
                image = torch.FloatTensor(image)
            images.append(image)
        return torch.stack(images).to(self.device)

    def postprocess(self, data: torch.Tensor) -> list[dict[str, float]]:
        ps = F.softmax(data, dim=1)
        probs, classes = torch.topk(ps, self.topk, dim=1)
        return map_class_to_label(probs.tolist(), self.mapping, classes.tolist())
