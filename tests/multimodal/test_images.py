"""User images: every bad one is a one-line ImageError naming it and why (the server's 400), never
a traceback; the limits are the flags'; EXIF orientation is applied; remote URLs are not fetched."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from ktransformers.multimodal.images import (ImageError, ImageLimits, decode_base64, decode_image, image_from_path,
                                             image_from_url)

from .conftest import photo_like


def _encoded(img, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` and whose pixels never follow."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))


def _one_line_error(fn, *args, match: str, **kw) -> str:
    with pytest.raises(ImageError, match=match) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300
    return msg


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "BMP"])
def test_still_images_decode_to_rgb(fmt):
    img = decode_image(_encoded(photo_like(), fmt))
    assert img.mode == "RGB" and img.size == (90, 60)


def test_rgba_and_grey_become_rgb():
    assert decode_image(_encoded(photo_like().convert("RGBA"))).mode == "RGB"
    assert decode_image(_encoded(photo_like().convert("L"))).mode == "RGB"


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise: stored landscape, seen portrait
    img = decode_image(_encoded(photo_like(), "JPEG", exif=exif.tobytes()))
    assert img.size == (60, 90)


def test_not_an_image():
    _one_line_error(decode_image, b"%PDF-1.4 not a picture", match="not an image in a supported format")
    _one_line_error(decode_image, b"", match="empty")
    _one_line_error(decode_image, "text", match="expected image bytes")


def test_other_formats_are_refused_by_name():
    data = _encoded(photo_like().resize((32, 32)), "ICO")
    _one_line_error(decode_image, data, match="not an image in a supported format .*PNG")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt):
    data = _encoded(photo_like(), fmt)
    _one_line_error(decode_image, data[: len(data) // 2], what="image 1", match="^image 1: corrupt or truncated")


def test_animated_image_refused():
    frames = [photo_like(seed=i) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    _one_line_error(decode_image, buf.getvalue(), match="animated GIF .3 frames")


def test_pixel_limit_refuses_before_decoding():
    # a header claiming 5000 x 5000 with no pixels behind it: refused from the header alone
    _one_line_error(decode_image, _png_header_only(5000, 5000), ImageLimits(max_pixels=1000 * 1000),
                    match="5000x5000 pixels, over the limit of 1000000 .--max_image_pixels")


def test_decompression_bomb_is_refused_whatever_the_limit():
    # over PIL's own bomb threshold (2 x MAX_IMAGE_PIXELS): refused even with our limit lifted
    _one_line_error(decode_image, _png_header_only(40000, 40000), ImageLimits(max_pixels=10**12),
                    match="decompression bomb")


def test_byte_limit():
    data = _encoded(photo_like())
    _one_line_error(decode_image, data, ImageLimits(max_bytes=100), match=r"over the limit of 100 bytes .--max_image_mb")
    _one_line_error(decode_base64, base64.b64encode(data).decode(), ImageLimits(max_bytes=100),
                    match="over the limit of 100 bytes")


def test_data_urls():
    data = _encoded(photo_like())
    assert image_from_url(_data_url(data)).size == (90, 60)
    _one_line_error(image_from_url, "data:image/png;base64,!!!!", match="not valid base64")
    _one_line_error(image_from_url, "data:image/png,rawtext", match="must be 'data:image/<type>;base64")
    _one_line_error(image_from_url, _data_url(data, "text/plain"), match="type 'text/plain', not an image")


def test_remote_urls_are_not_fetched():
    _one_line_error(image_from_url, "https://example.com/cat.png", match="remote URLs are not fetched")
    _one_line_error(image_from_url, "ftp://example.com/cat.png", match="unsupported URL scheme 'ftp'")


def test_local_file_urls_only_when_allowed(tmp_path):
    p = tmp_path / "pic.png"
    p.write_bytes(_encoded(photo_like()))
    _one_line_error(image_from_url, p.as_uri(), match="file:// URLs are off .*--allow_local_images")
    assert image_from_url(p.as_uri(), ImageLimits(allow_local_files=True)).size == (90, 60)
    assert image_from_path(p).size == (90, 60)
    _one_line_error(image_from_path, tmp_path / "missing.png", match="missing.png: cannot read")


# ---- property-based: whatever bytes arrive, an image or an ImageError -------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

_SEEDS = {fmt: _encoded(photo_like(40, 30), fmt) for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP")}


def _decoded_or_refused(data: bytes) -> None:
    try:
        img = decode_image(data, ImageLimits(max_pixels=4096 * 4096))
    except ImageError as e:
        assert "\n" not in str(e)
    else:
        assert img.mode == "RGB" and img.size[0] * img.size[1] <= 4096 * 4096


@fuzz_settings(150, deadline=None, derandomize=True)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data):
    _decoded_or_refused(data)


@fuzz_settings(200, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(sorted(_SEEDS)), cut=st.floats(0.0, 1.0),
       edits=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 255)), max_size=8))
def test_fuzz_truncated_and_mutated_images(fmt, cut, edits):
    data = bytearray(_SEEDS[fmt])
    for where, byte in edits:
        data[int(where * (len(data) - 1))] = byte
    _decoded_or_refused(bytes(data[: max(1, int(cut * len(data)))]))
