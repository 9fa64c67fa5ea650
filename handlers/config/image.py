"""``pt2_handlers.image``: how the image-classification task turns a picture into the model's input, and how many
labels it answers with. The defaults are TorchServe's ``image_classifier`` handler's (resize the shorter side to 256,
crop the centre 224, ImageNet's mean and std), so swapping handlers changes no answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, StrictFloat, StrictInt, field_validator

from handlers.config.fields import PositiveInt, Section, problem

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")
Triple = Annotated[list[StrictFloat | StrictInt], Field(min_length=3, max_length=3)]


@dataclass(frozen=True)
class ImageSpec:
    """The preprocessing of one image, and the answer's length."""

    resize: int | None = 256  # the shorter side, before the crop; None: no resize
    crop: int = 224  # the centre square the model sees (its input is crop x crop)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    channel_order: str = "RGB"
    top_k: int = 5
    max_pixels: int = 40_000_000  # larger images are refused before they are decoded (decompression bombs)
    processor: bool = True  # a Hugging Face model: its image processor's settings, not these
    jpeg_draft: bool = False  # JPEGs decoded at the smallest DCT scale that still covers the resize


class ImageSection(Section):
    """Image preprocessing (TorchServe's `image_classifier` by default) and the answer's top-k."""

    resize: PositiveInt | Literal["none"] = 256
    """The shorter side is resized to this (the longer keeps the aspect ratio), before the crop; `none`: no
    resize."""
    crop: PositiveInt = 224
    """The centre square cropped after the resize: the model's input is `crop` x `crop` pixels."""
    mean: Triple = list(IMAGENET_MEAN)
    """Per-channel mean subtracted from pixel values in [0, 1] (in `channel_order`)."""
    std: Triple = list(IMAGENET_STD)
    """Per-channel standard deviation the pixel values are divided by, after the mean."""
    interpolation: Literal[INTERPOLATIONS] = "bilinear"
    """PIL's resampling filter for the resize (torchvision's `Resize` on a PIL image uses the same)."""
    channel_order: Literal["RGB", "BGR"] = "RGB"
    """The channel order the model was trained on (`BGR` for some Caffe-era models)."""
    top_k: PositiveInt = 5
    """How many `{label: probability}` pairs each answer holds, most likely first."""
    max_pixels: PositiveInt = 40_000_000
    """Images with more pixels are refused (a 413-style 400 naming the size) before they are decoded: a small
    compressed file can hold a huge image."""
    jpeg_draft: bool = False
    """JPEGs are decoded at the smallest scale (1/2, 1/4 or 1/8, libjpeg's DCT scaling: PIL's draft mode) whose
    shorter side still covers `resize`, before the resize: a large photo decodes several times faster (a 4000 x 2667
    JPEG: `benchmarks.vision`), and the answers move slightly from a full-size decode's (TorchServe's)."""
    processor: bool = True
    """A Hugging Face model directory: preprocess with its image processor (`preprocessor_config.json`, PIL
    backend), as transformers' pipeline does; `false`: with the keys above. A `model.py` archive always uses the
    keys above."""

    @field_validator("std")
    @classmethod
    def _std_positive(cls, std: list[float]) -> list[float]:
        if any(value <= 0 for value in std):
            raise problem(f"every std must be above 0, got {std}")
        return std

    def spec(self) -> ImageSpec:
        return ImageSpec(None if self.resize == "none" else self.resize, self.crop,
                         tuple(float(v) for v in self.mean), tuple(float(v) for v in self.std), self.interpolation,
                         self.channel_order, self.top_k, self.max_pixels, self.processor, self.jpeg_draft)
