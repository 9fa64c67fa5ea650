"""The bad (and odd but good) images ``benchmarks.hostile_inputs`` sends to an image classifier.

Each unreadable image must get a 400 naming the problem: an empty body, bytes that are not an image, a truncated file,
text that is not base64, a decompression bomb (a few dozen bytes whose header claims 100 megapixels), a body over the
server's limit (TorchServe's own 413). Odd modes (CMYK, 16-bit, palette, grayscale, alpha) and an EXIF-rotated photo
must be answered (200), as a viewer shows them.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from typing import Any

import numpy as np
from PIL import Image

from handlers.tasks.images import synthetic_images


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels in a few dozen bytes: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(
        b"IEND", b"")


def good_photos(count: int = 3) -> list[bytes]:
    """Seeded photographs' stand-ins as JPEG files, the good requests sent beside the bad ones."""
    return [encoded(image, "JPEG", quality=90) for image in synthetic_images(count, 7)]


def odd_but_good() -> list[tuple[str, bytes, str]]:
    """(kind, body, Content-Type): images in modes a viewer shows, each to be answered."""
    photo = synthetic_images(1, 11)[0].resize((320, 240))
    sixteen = Image.fromarray(np.asarray(photo.convert("L"), np.uint16) * 257)
    palette = photo.convert("P", palette=Image.Palette.ADAPTIVE)
    rgba = photo.convert("RGBA")
    rgba.putalpha(128)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    return [("CMYK JPEG", encoded(photo.convert("CMYK"), "JPEG"), "image/jpeg"),
            ("16-bit grayscale PNG", encoded(sixteen, "PNG"), "image/png"),
            ("palette PNG", encoded(palette, "PNG"), "image/png"),
            ("grayscale JPEG", encoded(photo.convert("L"), "JPEG"), "image/jpeg"),
            ("PNG with alpha", encoded(rgba, "PNG"), "image/png"),
            ("EXIF-rotated JPEG", encoded(photo, "JPEG", exif=exif.tobytes()), "image/jpeg")]


def bad(max_request_size: int, max_images: int) -> list[tuple[str, bytes, str, int, str | None]]:
    """(kind, body, Content-Type, status, what the JSON error says; None: TorchServe's bare 413)."""
    photo = good_photos(1)[0]
    png = encoded(synthetic_images(1, 3)[0], "PNG")

    def as_json(body: Any) -> bytes:
        return json.dumps(body).encode()

    text = base64.b64encode(photo).decode()
    tiny = base64.b64encode(encoded(Image.new("RGB", (1, 1)), "PNG")).decode()
    return [
        ("empty image body", b"", "image/jpeg", 400, "is empty (0 bytes)"),
        ("image magic then zeros", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "image/png", 400,
         "is not an image PIL can read"),
        ("truncated PNG", png[: len(png) // 2], "image/png", 400, "truncated or corrupt"),
        ("truncated JPEG", photo[: len(photo) // 3], "image/jpeg", 400, "truncated or corrupt"),
        ("text that is not base64", b"plain words, not an image", "text/plain", 400, "is text but not base64"),
        ("base64 of something else", as_json({"data": base64.b64encode(b"hello world").decode()}),
         "application/json", 400, "is not an image PIL can read"),
        ("decompression bomb (header of 10000x10000)", png_header_only(10_000, 10_000), "image/png", 400,
         "100,000,000 pixels; at most"),
        ("a number for the image", as_json({"data": 42}), "application/json", 400,
         "must be image bytes or a base64 string, got int"),
        ("JSON without data", as_json({"image": text}), "application/json", 400, "unknown key(s): image"),
        ("more images than allowed", as_json({"data": [tiny] * (max_images + 1)}), "application/json", 400,
         f"send 1 to {max_images} images per request"),
        ("top_k out of range", as_json({"data": text, "top_k": 0}), "application/json", 400,
         '"top_k" must be a positive integer'),
        ("preprocessed tensor of the wrong shape", as_json([[0.0, 1.0], [2.0, 3.0]]), "application/json", 400,
         "a preprocessed image has shape"),
        ("huge base64 image over max_request_size", as_json({"data": "A" * (max_request_size + 4)}),
         "application/json", 413, None),
        ("Open Inference (v2): a tensor of the wrong type",
         as_json({"inputs": [{"name": "images", "shape": [1], "datatype": "INT64", "data": [1]}]}),
         "application/json", 400, "send BYTES (base64 images)"),
    ]
