"""Pictures in (handlers.tasks.images): every format and mode a client sends decoded to the RGB a viewer shows, EXIF
rotation applied, every unreadable image a clear InvalidInput (empty, not an image, truncated, a decompression bomb,
bad base64); and the preprocessing TorchServe's image_classifier does (resize the shorter side, centre crop, scale,
normalize), channel order and zero padding included. No model, no TorchServe."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from PIL import Image

from benchmarks.hostile_images import encoded, png_header_only
from handlers.config.image import ImageSpec
from handlers.errors import InvalidInput
from handlers.tasks import images


PHOTO = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP"])
def test_every_common_format_decodes_to_rgb_at_its_size(fmt):
    data = encoded(PHOTO, fmt)
    assert images.looks_like_image(data)
    image = images.open_image(data, 10_000_000)
    assert image.mode == "RGB" and image.size == (64, 48)
    if fmt in ("PNG", "BMP", "TIFF"):  # lossless: the very pixels
        assert np.array_equal(np.asarray(image), np.asarray(PHOTO))


def test_base64_a_data_url_and_wrapped_lines_are_the_same_bytes():
    data = encoded(PHOTO, "PNG")
    text = base64.b64encode(data).decode()
    assert images.image_bytes(text) == data
    assert images.image_bytes(f"data:image/png;base64,{text}") == data
    assert images.image_bytes("\n".join(text[i:i + 76] for i in range(0, len(text), 76))) == data
    assert images.image_bytes(bytearray(data)) == data


@pytest.mark.parametrize("value, message", [
    ("not base64 at all!", "is text but not base64"),
    (12, "must be image bytes or a base64 string, got int"),
    ("A" * (images.MAX_BASE64_CHARS + 4), "base64 characters; at most"),
])
def test_what_is_not_an_image_string_is_named(value, message):
    with pytest.raises(InvalidInput, match=message):
        images.image_bytes(value)


def test_empty_not_an_image_and_truncated_are_each_named():
    with pytest.raises(InvalidInput, match=r"the image is empty \(0 bytes\)"):
        images.open_image(b"", 10_000_000)
    with pytest.raises(InvalidInput, match="is not an image PIL can read .* starting b'hello wo'"):
        images.open_image(b"hello world", 10_000_000)
    jpeg = encoded(PHOTO, "JPEG")
    with pytest.raises(InvalidInput, match="is truncated or corrupt \\(JPEG 64x48"):
        images.open_image(jpeg[: len(jpeg) // 2], 10_000_000)


def test_a_decompression_bomb_is_refused_from_its_header_before_it_is_decoded():
    with pytest.raises(InvalidInput, match=r"is 10000x10000 = 100,000,000 pixels; at most 40,000,000"):
        images.open_image(png_header_only(10_000, 10_000), 40_000_000)
    with pytest.raises(InvalidInput, match="too large to decode"):  # past PIL's own limit too
        images.open_image(png_header_only(60_000, 60_000), 10**10)


def test_odd_modes_become_the_rgb_a_viewer_shows():
    # 16-bit grayscale: scaled to 8 bits, not clipped at 255
    sixteen = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
    assert sixteen.mode.startswith("I;16")
    assert np.asarray(images.open_image(encoded(sixteen, "PNG"), 10**6)).min() == 255
    half = Image.fromarray(np.full((8, 8), 32896, dtype=np.uint16))
    assert np.asarray(images.open_image(encoded(half, "PNG"), 10**6))[0, 0].tolist() == [128, 128, 128]
    # transparency over white
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    assert np.asarray(images.open_image(encoded(rgba, "PNG"), 10**6))[0, 0].tolist() == [255, 255, 255]
    la = Image.new("LA", (8, 8), (0, 128))
    assert np.asarray(images.open_image(encoded(la, "PNG"), 10**6))[0, 0].tolist() == [127, 127, 127]
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([10, 20, 30] * 256)
    assert np.asarray(images.open_image(encoded(palette, "PNG"), 10**6))[0, 0].tolist() == [10, 20, 30]
    palette.info["transparency"] = 0
    assert np.asarray(images.open_image(encoded(palette, "PNG", transparency=0), 10**6))[0, 0].tolist() == [255] * 3
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # red in ink
    red = np.asarray(images.open_image(encoded(cmyk, "JPEG"), 10**6))[4, 4]
    assert red[0] > 200 and red[1] < 60 and red[2] < 60, red
    gray = images.open_image(encoded(Image.new("L", (8, 8), 77), "PNG"), 10**6)
    assert np.asarray(gray)[0, 0].tolist() == [77, 77, 77]


def test_exif_rotation_is_applied():
    wide = Image.new("RGB", (60, 20), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    upright = images.open_image(encoded(wide, "JPEG", exif=exif.tobytes()), 10**6)
    assert upright.size == (20, 60)


def test_preprocessing_is_torchvisions_resize_crop_scale_normalize():
    spec = ImageSpec()
    pixels = images.to_pixels(Image.new("RGB", (500, 375), (255, 128, 0)), spec)
    assert pixels.shape == (3, 224, 224) and pixels.dtype == torch.float32
    want = [(value / 255 - mean) / std for value, mean, std in zip((255, 128, 0), spec.mean, spec.std, strict=True)]
    assert torch.allclose(pixels.mean(dim=(1, 2)), torch.tensor(want), atol=1e-5)
    # the shorter side to 256, the longer truncated as torchvision computes it (500 * 256 / 375 = 341.33 -> 341)
    assert images._resized(Image.new("RGB", (500, 375)), 256, Image.Resampling.BILINEAR).size == (341, 256)
    assert images._resized(Image.new("RGB", (375, 500)), 256, Image.Resampling.BILINEAR).size == (256, 341)
    # an image smaller than the crop is padded with zeros, evenly, as torchvision's CenterCrop does
    small = images.to_pixels(Image.new("RGB", (100, 100), (255, 255, 255)), ImageSpec(resize=None))
    zero = (0 - spec.mean[0]) / spec.std[0]
    assert small[0, 0, 0].item() == pytest.approx(zero) and small[0, 112, 112].item() == pytest.approx(
        (1 - spec.mean[0]) / spec.std[0])
    # BGR models see blue first
    bgr = images.to_pixels(Image.new("RGB", (224, 224), (255, 0, 0)), ImageSpec(channel_order="BGR",
                                                                                 mean=(0, 0, 0), std=(1, 1, 1)))
    assert bgr[:, 0, 0].tolist() == [0.0, 0.0, 1.0]


def test_synthetic_images_are_the_same_on_every_call():
    first, again = images.synthetic_images(3, 0), images.synthetic_images(3, 0)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again, strict=True))
    assert not np.array_equal(np.asarray(first[0]), np.asarray(images.synthetic_images(1, 1)[0]))


def test_jpeg_draft_decodes_a_large_photo_at_a_reduced_scale_that_still_covers_the_resize():
    large = encoded(PHOTO.resize((2048, 1536)), "JPEG")
    full = images.open_image(large, 10**8)
    reduced = images.open_image(large, 10**8, draft=256)
    assert full.size == (2048, 1536) and reduced.size == (512, 384)  # 1/4: the smallest scale whose sides stay >= 256
    spec = ImageSpec()
    assert (images.to_pixels(full, spec) - images.to_pixels(reduced, spec)).abs().mean() < 0.1
    png = encoded(PHOTO, "PNG")  # other formats decode in full
    assert images.open_image(png, 10**8, draft=16).size == (64, 48)
