"""Pictures in: a request's bytes or base64 text decoded by PIL into an RGB image, then resized, cropped and normalized
into the tensor a classifier takes, as TorchServe's ``image_classifier`` (torchvision's ``Resize``, ``CenterCrop``,
``ToTensor``, ``Normalize`` on a PIL image) does, with PIL, numpy and torch only: no torchvision on the serving path.

Every way an image can be unreadable is an ``InvalidInput`` naming it: not an image, truncated, empty, too many pixels
(checked from the header, before anything is decoded: a small file can hold a huge image). Odd modes are made RGB as a
viewer shows them: 16-bit scaled to 8, transparency laid over white, CMYK and palettes converted. EXIF rotation is
applied, as a phone's photo is meant to be seen.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from handlers.config.image import ImageSpec
from handlers.errors import InvalidInput

RESAMPLING = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
              "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS,
              "box": Image.Resampling.BOX, "hamming": Image.Resampling.HAMMING}
# The first bytes of the formats PIL reads that a client is likely to send (raw bodies are told from base64 text by
# these: a JPEG is not valid UTF-8, but a BMP or a small GIF may be)
MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
         b"\x00\x00\x01\x00")
DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)
MAX_BASE64_CHARS = 64 * 1024 * 1024  # 48 MB of image: past any photo, short of what would exhaust the worker
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def looks_like_image(data: bytes) -> bool:
    return data.startswith(MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def image_bytes(value: object, where: str = "the image") -> bytes:
    """The image's bytes: raw bytes as sent, or base64 text (a ``data:image/...;base64,`` URL too) decoded."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str):
        raise InvalidInput(f"{where} must be image bytes or a base64 string, got {type(value).__name__}")
    if len(value) > MAX_BASE64_CHARS:
        raise InvalidInput(f"{where} is {len(value):,} base64 characters; at most {MAX_BASE64_CHARS:,}")
    text = DATA_URL.sub("", value.strip(), count=1)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where} is text but not base64 ({text[:40]!r}...): send the image's bytes, or them "
                           "base64-encoded") from None


def open_image(data: bytes, max_pixels: int, where: str = "the image", draft: int | None = None) -> Image.Image:
    """The decoded image in RGB, EXIF-rotated; InvalidInput naming what is wrong with it. ``draft``: a JPEG is decoded
    at the smallest DCT scale whose sides are still at least this."""
    if not data:
        raise InvalidInput(f"{where} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit is checked below
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InvalidInput(f"{where} is not an image PIL can read ({len(data):,} bytes starting {data[:8]!r}); send "
                           "JPEG, PNG, GIF, BMP, TIFF or WebP") from None
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"{where} is too large to decode: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidInput(f"{where} is {width}x{height} = {width * height:,} pixels; at most {max_pixels:,} "
                           "(pt2_handlers.image.max_pixels)")
    if draft is not None and image.format == "JPEG":
        image.draft("RGB", (draft, draft))
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput(f"{where} is truncated or corrupt ({image.format} {width}x{height}: {exc})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as a viewer shows the image: 16-bit values scaled to 8, transparent pixels over white."""
    if image.mode in SIXTEEN_BIT_MODES or image.mode == "F":
        values = np.asarray(image, dtype=np.float32)
        scale = 1.0 if image.mode == "F" else 65535.0
        image = Image.fromarray(np.clip(values / scale * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image if image.mode == "RGB" else image.convert("RGB")


def to_pixels(image: Image.Image, spec: ImageSpec) -> torch.Tensor:
    """The model's input for one image, ``[3, crop, crop]`` float32: shorter side resized to ``spec.resize`` (the
    longer one truncated as torchvision does), centre crop (zero-padded where the image is smaller), scaled to
    [0, 1], channels in ``spec.channel_order``, normalized."""
    if spec.resize is not None:
        image = _resized(image, spec.resize, RESAMPLING[spec.interpolation])
    array = _center_crop(np.asarray(image, dtype=np.uint8), spec.crop)
    if spec.channel_order == "BGR":
        array = array[..., ::-1]
    pixels = torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).float().div_(255.0)
    mean = torch.tensor(spec.mean).view(3, 1, 1)
    std = torch.tensor(spec.std).view(3, 1, 1)
    return pixels.sub_(mean).div_(std)


def _resized(image: Image.Image, size: int, resample: Image.Resampling) -> Image.Image:
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    if short == size:
        return image
    new_short, new_long = size, int(size * long / short)
    new_size = (new_short, new_long) if width <= height else (new_long, new_short)
    return image.resize(new_size, resample)


def _center_crop(array: np.ndarray, crop: int) -> np.ndarray:
    height, width = array.shape[:2]
    if height < crop or width < crop:  # torchvision pads with zeros, evenly, before it crops
        top, left = max(crop - height, 0), max(crop - width, 0)
        array = np.pad(array, ((top // 2, (top + 1) // 2), (left // 2, (left + 1) // 2), (0, 0)))
        height, width = array.shape[:2]
    top = int(round((height - crop) / 2.0))
    left = int(round((width - crop) / 2.0))
    return array[top:top + crop, left:left + crop]


def synthetic_images(count: int, seed: int) -> list[Image.Image]:
    """Seeded photographs' stand-ins for warmup and the gate: smooth colour fields with shapes and noise, at sizes and
    aspect ratios a camera or a browser sends, so that the resize and crop run as they will on live requests."""
    generator = np.random.default_rng(seed)
    images = []
    for index in range(count):
        width, height = [(640, 480), (480, 640), (500, 375), (1024, 768), (300, 300), (800, 533)][index % 6]
        coarse = generator.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
        field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.float32)
        ys, xs = np.mgrid[0:height, 0:width]
        cy, cx, radius = generator.uniform(0.3, 0.7) * height, generator.uniform(0.3, 0.7) * width, height / 4
        disc = ((ys - cy) ** 2 + (xs - cx) ** 2) < radius ** 2
        field[disc] = generator.integers(0, 256, size=3)
        field += generator.normal(0, 8, size=field.shape)
        images.append(Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB"))
    return images
