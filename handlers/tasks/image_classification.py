"""Image classification with the request and answer contract of TorchServe's ``image_classifier`` handler, so clients
keep working when the handler changes:

* the body as the image's bytes (``curl -T cat.jpg`` or ``--data-binary @cat.jpg``), a multipart field named
  ``data`` (``curl -F data=@cat.jpg``), base64 text, or ``{"data": <base64>}`` -> ``{label: probability, ...}``,
  the ``top_k`` most likely, best first;
* ``{"data": [<base64>, ...]}`` -> one such object per image; ``"top_k": k`` in the object overrides the YAML's;
* a tensor already preprocessed, as nested lists ``[3, crop, crop]`` (or ``[n, 3, crop, crop]``), as TorchServe's
  handler reads a JSON list;
* Open Inference (KServe v2): a BYTES input of base64 images, or a UINT8 ``[h, w, 3]`` / ``[n, h, w, 3]`` tensor of
  pixels (resized and cropped as an image), or an FP32 ``[n, 3, crop, crop]`` tensor already preprocessed; the answer
  is ``label`` and ``score`` tensors ``[n, k]``.

The model is a ``--model-file`` + state_dict (or an exported program) whose forward takes the ``[n, 3, crop, crop]``
pixels and returns logits, preprocessed as ``pt2_handlers.image`` says (TorchServe's resize 256, crop 224, ImageNet
mean and std by default), labelled from ``index_to_name.json`` packed with ``--extra-files``; or a Hugging Face
``save_pretrained`` image classifier, preprocessed by its own image processor and labelled from its ``id2label``.
The ladder optimizes the model with its softmax, so the gate judges the probabilities clients get.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from handlers.config import DType
from handlers.config.image import ImageSpec
from handlers.config.task_facts import IMAGE_GATE, IMAGE_TASK
from handlers.errors import InvalidInput, ModelLoadError
from handlers.ladder import QualityError, QualityGate
from handlers.models.files import Form
from handlers.models.state_dict import load_module
from handlers.tasks import images, open_inference
from handlers.tasks.base import Encoded, ScoreGate, Task, TaskSettings, decode_body, float_pairs, gate_threshold

logger = logging.getLogger(__name__)

INPUT = "pixel_values"
LABELS_FILE = "index_to_name.json"
WARMUP_SEED, HELD_OUT_SEED = 0, 1


@dataclass(frozen=True)
class ImageRequest:
    pixels: torch.Tensor  # [n, 3, crop, crop], preprocessed
    top_k: int
    many: bool  # a list of images: a list of answers


class Classifier(torch.nn.Module):
    """The model's logits as float32 probabilities: what clients get, and the gate judges."""

    def __init__(self, model: torch.nn.Module, keyword: bool):
        super().__init__()
        self.model = model
        self.keyword = keyword  # Hugging Face models take pixel_values=; a model.py forward, the tensor alone

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        pixels = pixel_values.to(dtype)
        output = self.model(pixel_values=pixels) if self.keyword else self.model(pixels)
        logits = getattr(output, "logits", None)
        if logits is None:
            logits = output[0] if isinstance(output, (tuple, list)) else output
        return logits.float().softmax(dim=-1)


class ImageGate(ScoreGate):
    """Probabilities within ``max_error`` of fp32 eager's (``score_agreement``), every image's most likely label the
    same, and at most one of its ``top_k`` labels different (the last two may swap places with a near tie)."""

    def __init__(self, max_error: float, top_k: int):
        super().__init__(max_error, same_labels=True)
        self.top_k = top_k

    def measure(self, actual: Any, expected: Any) -> float:
        value = super().measure(actual, expected)
        for ours, theirs in float_pairs(actual, expected):
            k = min(self.top_k, theirs.shape[-1])
            for row, (mine, want) in enumerate(zip(ours.topk(k).indices.tolist(), theirs.topk(k).indices.tolist(),
                                                   strict=True)):
                if len(set(mine) & set(want)) < k - 1:
                    raise QualityError(f"image {row}'s top {k} labels {mine} differ from fp32 eager's {want} in more "
                                       f"than one place ({self.metric} {value:.6f})")
        return value


class ImageClassificationTask(Task):
    """Top-k labels per image, TorchServe's image_classifier contract."""

    name = IMAGE_TASK
    open_inference_output = "labels"
    reads_images: ClassVar[bool] = True

    def __init__(self, setup: TaskSettings, labels: Sequence[str] | None, processor: Any = None):
        super().__init__(setup)
        self.spec: ImageSpec = setup.settings.image
        self.labels = list(labels) if labels else None
        self.processor = processor  # a Hugging Face image processor, or None: the YAML's preprocessing

    @classmethod
    def load(cls, setup: TaskSettings, device: torch.device) -> tuple[Task, torch.nn.Module]:
        if setup.files.form is not Form.PRETRAINED:
            labels = read_labels(setup.model_root / LABELS_FILE)
            task = cls(setup, labels)
            return task, load_module(setup.model_root, setup.files, device)
        return cls._load_pretrained(setup, device)

    @classmethod
    def _load_pretrained(cls, setup: TaskSettings, device: torch.device) -> tuple[Task, torch.nn.Module]:
        import transformers

        root = setup.model_root.resolve()
        model_dir = (root / setup.settings.model_dir).resolve()
        if not model_dir.is_relative_to(root) or not (model_dir / "config.json").is_file():
            raise ModelLoadError(f"pt2_handlers.model_dir {setup.settings.model_dir!r} is not a save_pretrained "
                                 f"directory inside the archive ({root}); or pack --model-file + --serialized-file")
        started = time.perf_counter()
        try:
            model = transformers.AutoModelForImageClassification.from_pretrained(
                model_dir, local_files_only=True, use_safetensors=True, dtype=torch.float32)
            processor = transformers.AutoImageProcessor.from_pretrained(model_dir, local_files_only=True,
                                                                        backend="pil") \
                if setup.settings.image.processor else None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load {model_dir}: {exc}") from exc
        logger.info("loaded %s from %s in %.1fs (preprocessing: %s)", type(model).__name__, model_dir,
                    time.perf_counter() - started, type(processor).__name__ if processor else "pt2_handlers.image")
        labels = [model.config.id2label[index] for index in range(model.config.num_labels)]
        return cls(setup, labels, processor), model.to(device).eval()

    @classmethod
    def quality_gate(cls, dtype: DType, overrides: Mapping[str, float]) -> QualityGate:
        return ImageGate(gate_threshold(dtype, overrides, IMAGE_GATE), top_k=5)

    def build_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.labels is None:
            self.labels = [str(index) for index in range(self._classes(model))]
        return Classifier(model, keyword=self.processor is not None or _is_hugging_face(model)).eval()

    def _classes(self, model: torch.nn.Module) -> int:
        with torch.no_grad():
            return int(Classifier(model, _is_hugging_face(model))(self._pixels(images.synthetic_images(1, 0))
                                                                  ).shape[-1])

    def parse_threads(self) -> int:
        """PIL decodes and resizes without the GIL: a batch's images are read on the worker's threads, while its
        forward has not started yet (a JPEG cost more than MobileNetV2's forward of it)."""
        return max(torch.get_num_threads(), 1)

    def decode(self, body: Any) -> Any:
        """Image bytes stay bytes; anything else is text or JSON, as for every task."""
        if isinstance(body, (bytes, bytearray)) and images.looks_like_image(bytes(body)):
            return bytes(body)
        return decode_body(body)

    def parse(self, body: Any) -> ImageRequest:
        """Decoded and preprocessed here, request by request (Server-Timing's ``parse`` stage shows the cost)."""
        top_k, many = self.spec.top_k, False
        if isinstance(body, Mapping):
            unknown = sorted(str(key) for key in body if key not in ("data", "top_k"))
            if unknown or "data" not in body:
                raise InvalidInput('send {"data": <base64 image>} (or a list of them), optionally with "top_k"'
                                   + (f"; unknown key(s): {', '.join(unknown)}" if unknown else ""))
            top_k = _top_k(body.get("top_k", top_k))
            body = body["data"]
            many = isinstance(body, list) and all(isinstance(item, str) for item in body)
        if isinstance(body, (list, torch.Tensor)) and not many:
            pixels = self._tensor(body)
        else:
            pictures = body if many else [body]
            if not pictures or len(pictures) > self.max_inputs:
                raise InvalidInput(f"send 1 to {self.max_inputs} images per request, got {len(pictures)}")
            pixels = self._pixels([self._open(picture, f"image {index}" if many else "the image")
                                   for index, picture in enumerate(pictures)])
        return ImageRequest(pixels, top_k, many or pixels.shape[0] > 1)

    def _open(self, picture: Any, where: str) -> Any:
        spec = self.spec
        draft = spec.resize if spec.jpeg_draft and spec.resize and self.processor is None else None
        return images.open_image(images.image_bytes(picture, where), spec.max_pixels, where, draft)

    def _pixels(self, pictures: Sequence[Any]) -> torch.Tensor:
        if self.processor is not None:
            return self.processor(images=list(pictures), return_tensors="pt")[INPUT].float()
        return torch.stack([images.to_pixels(picture, self.spec) for picture in pictures])

    def _tensor(self, values: Any) -> torch.Tensor:
        """A preprocessed image (or images) sent as nested lists: ``[3, crop, crop]`` or ``[n, 3, crop, crop]``."""
        want = list(self.input_shape())
        try:
            tensor = values.float() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InvalidInput(f"a preprocessed image must be nested lists of numbers {want}: "
                               f"{str(exc).splitlines()[0][:200]}") from None
        tensor = tensor.unsqueeze(0) if tensor.dim() == 3 else tensor
        if list(tensor.shape[1:]) != want or not 0 < tensor.shape[0] <= self.max_inputs:
            raise InvalidInput(f"a preprocessed image has shape {want} (or [n, {', '.join(map(str, want))}] with n "
                               f"up to {self.max_inputs}), got {list(tensor.shape)}")
        return tensor

    @functools.cached_property
    def _input_shape(self) -> tuple[int, ...]:
        if self.processor is not None:  # what the image processor makes of a picture, asked once
            return tuple(self._pixels(images.synthetic_images(1, 0)).shape[1:])
        return 3, self.spec.crop, self.spec.crop

    def input_shape(self) -> tuple[int, ...]:
        return self._input_shape

    def preprocess(self, requests: Sequence[ImageRequest]) -> Encoded:
        return Encoded({INPUT: torch.cat([request.pixels for request in requests])})

    def postprocess(self, outputs: torch.Tensor, encoded: Encoded, requests: Sequence[ImageRequest]) -> list[Any]:
        probabilities = outputs.float().cpu()
        answers, start = [], 0
        for request in requests:
            rows = [self._top(probabilities[start + offset], request.top_k)
                    for offset in range(request.pixels.shape[0])]
            answers.append(rows if request.many else rows[0])
            start += request.pixels.shape[0]
        return answers

    def _top(self, row: torch.Tensor, top_k: int) -> dict[str, float]:
        values, indices = row.topk(min(top_k, row.shape[-1]))
        assert self.labels is not None
        return {self.labels[index]: value for value, index in zip(values.tolist(), indices.tolist(), strict=True)}

    def warmup_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        return self._synthetic_batches(shapes, WARMUP_SEED)

    def held_out_batches(self, shapes: Sequence[tuple[int, int]]) -> list[dict[str, torch.Tensor]]:
        return self._synthetic_batches(shapes, HELD_OUT_SEED)

    def _synthetic_batches(self, shapes: Sequence[tuple[int, int]], seed: int) -> list[dict[str, torch.Tensor]]:
        sizes = list(dict.fromkeys(batch for batch, _ in shapes))
        pixels = self._pixels(images.synthetic_images(max(sizes), seed))
        return [{INPUT: pixels[:batch].clone()} for batch in sizes]

    def from_open_inference(self, request: open_inference.InferRequest) -> Any:
        if len(request.values) != 1:
            raise InvalidInput(f"send one input (the images), got {len(request.values)}")
        unknown = sorted(key for key in request.parameters if key != "top_k")
        if unknown:
            raise InvalidInput(f"unknown parameter(s) {', '.join(unknown)}; this model reads top_k")
        (name, values), = request.values.items()
        datatype, shape = request.datatypes[name], request.shapes[name]
        body: dict[str, Any] = {"top_k": request.parameters.get("top_k", self.spec.top_k)}
        if datatype == "BYTES":
            return {**body, "data": list(values)}
        if datatype == "UINT8" and len(shape) in (3, 4) and shape[-1] == 3:
            rows = torch.tensor(values, dtype=torch.uint8).reshape(shape if len(shape) == 4 else [1, *shape])
            from PIL import Image

            pixels = self._pixels([Image.fromarray(row.numpy(), "RGB") for row in rows])
            return {**body, "data": pixels}
        if datatype in ("FP32", "FP16", "FP64"):
            return {**body, "data": torch.tensor(values, dtype=torch.float32).reshape(shape)}
        raise InvalidInput(f'input "{name}" is {datatype} {shape}: send BYTES (base64 images), UINT8 [h, w, 3] '
                           f"pixels, or FP32 [n, {', '.join(map(str, self.input_shape()))}] preprocessed")

    def to_open_inference(self, answer: Any, body: Any) -> list[dict[str, Any]]:
        rows = answer if isinstance(answer, list) else [answer]
        records = [[{"label": label, "score": score} for label, score in row.items()] for row in rows]
        return open_inference.to_tensors(self.open_inference_output, records, record_lists=True)

    def describe_inputs(self) -> dict[str, Any]:
        spec = self.spec
        preprocessing = ({"image_processor": type(self.processor).__name__} if self.processor is not None else
                         {"resize": spec.resize, "crop": spec.crop, "mean": list(spec.mean), "std": list(spec.std),
                          "interpolation": spec.interpolation, "channel_order": spec.channel_order})
        return {"images": {**preprocessing, "input": [3, *self.input_shape()[1:]], "max_pixels": spec.max_pixels},
                "max_per_request": self.max_inputs}

    def describe_outputs(self) -> dict[str, Any]:
        return {"top_k": self.spec.top_k, "labels": len(self.labels or ())}


def read_labels(path: Path) -> list[str] | None:
    """TorchServe's ``index_to_name.json``: ``{"0": "label"}`` or ``{"0": ["n01440764", "tench"]}`` (the last
    name), or ``{"object_type_names": [...]}``; None where the archive has none (labels are then the indexes)."""
    if not path.is_file():
        logger.warning("%s is not in the archive: answers name classes by their index", LABELS_FILE)
        return None
    try:
        mapping = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{LABELS_FILE} cannot be read: {exc}") from exc
    if isinstance(mapping, Mapping) and isinstance(mapping.get("object_type_names"), list):
        return [str(name) for name in mapping["object_type_names"]]
    if not isinstance(mapping, Mapping) or not all(str(key).isdigit() for key in mapping):
        raise ModelLoadError(f'{LABELS_FILE} must map class indexes to names: {{"0": "tench", ...}}')
    names = {int(key): value[-1] if isinstance(value, list) and value else value for key, value in mapping.items()}
    if sorted(names) != list(range(len(names))) or not all(isinstance(name, str) for name in names.values()):
        raise ModelLoadError(f"{LABELS_FILE} must name every class from 0 to {len(names) - 1} with a string")
    return [names[index] for index in range(len(names))]


def _is_hugging_face(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "can_generate")


def _top_k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f'"top_k" must be a positive integer, got {value!r}')
    return value
