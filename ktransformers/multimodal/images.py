"""User images: bytes -> an RGB ``PIL.Image`` within the limits, or one line saying why not.

Everything a client sends passes here before the processor sees it: the encoded size, the
format (still images only), the pixel count read from the header *before* decoding (a
decompression bomb never allocates), a full decode (a corrupt or truncated file fails here,
not in the model), and the EXIF orientation applied, as a camera meant the picture to be seen.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from ..errors import KTError

if TYPE_CHECKING:
    from PIL import Image

#: formats decoded; others (PDF, EPS, ICO, ...) are refused by name
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: what PIL's parsers and decoders raise on malformed data (found by fuzzing truncated and mutated files)
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, TypeError, ZeroDivisionError,
                  RuntimeError, MemoryError)


class ImageError(KTError):
    """An image that cannot be used: the message says which one and why (a 400 for a client)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry.  ``allow_local_files``: ``file://`` URLs and paths read from
    the server's disk (off for a server: a client would read the server's files)."""

    max_images: int = 4
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    allow_local_files: bool = False


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), what: str = "image") -> "Image.Image":
    """``data`` decoded to an upright RGB image; :class:`ImageError` naming ``what`` otherwise."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)):
        raise ImageError(f"{what}: expected image bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageError(f"{what}: empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what}: {len(data)} bytes, over the limit of {limits.max_bytes} bytes (--max_image_mb)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = img.size
            if w * h > limits.max_pixels:
                raise ImageError(f"{what}: {w}x{h} pixels, over the limit of {limits.max_pixels} (--max_image_pixels)")
            if getattr(img, "n_frames", 1) > 1:
                raise ImageError(f"{what}: animated {img.format} ({img.n_frames} frames); send one still frame")
            img.load()
            img = ImageOps.exif_transpose(img)
            return img.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{what}: not an image in a supported format ({', '.join(FORMATS)})") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{what}: too many pixels (a decompression bomb?), over the limit of "
                         f"{limits.max_pixels} (--max_image_pixels)") from None
    except _DECODE_ERRORS as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImageError(f"{what}: corrupt or truncated image data ({reason})") from None


def image_from_url(url: str, limits: ImageLimits = ImageLimits(), what: str = "image_url") -> "Image.Image":
    """A ``data:image/...;base64,`` URL (or, when ``limits.allow_local_files``, a ``file://`` URL)
    decoded; remote URLs are refused: the server fetches nothing from the network."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"{what}: expected a data: URL string")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(f"{what}: a data URL must be 'data:image/<type>;base64,<data>'")
        mime = head[len("data:"):-len(";base64")]
        if mime and not mime.startswith("image/"):
            raise ImageError(f"{what}: data URL of type '{mime[:40]}', not an image")
        return decode_image(decode_base64(payload, limits, what), limits, what)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        if not limits.allow_local_files:
            raise ImageError(f"{what}: file:// URLs are off on this server (--allow_local_images turns them on)")
        return image_from_path(unquote(urlparse(url).path), limits, what)
    if scheme in ("http", "https"):
        raise ImageError(f"{what}: remote URLs are not fetched (the server has no network access); "
                         f"send the image as a data: URL")
    raise ImageError(f"{what}: unsupported URL scheme '{scheme[:20]}'; send a data:image/...;base64 URL")


def decode_base64(payload: str, limits: ImageLimits = ImageLimits(), what: str = "image") -> bytes:
    """Base64 text (an Ollama ``images`` entry, a data URL's payload) -> bytes, size checked first."""
    if not isinstance(payload, str):
        raise ImageError(f"{what}: expected base64 text, got {type(payload).__name__}")
    if len(payload) * 3 // 4 > limits.max_bytes + 3:
        raise ImageError(f"{what}: over the limit of {limits.max_bytes} bytes (--max_image_mb)")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what}: not valid base64") from None


def image_from_path(path: str | Path, limits: ImageLimits = ImageLimits(), what: str | None = None) -> "Image.Image":
    """An image file from the local disk (local_chat's ``/image PATH``)."""
    p = Path(path).expanduser()
    what = what or str(p)
    try:
        size = p.stat().st_size
        if size > limits.max_bytes:
            raise ImageError(f"{what}: {size} bytes, over the limit of {limits.max_bytes} bytes (--max_image_mb)")
        data = p.read_bytes()
    except OSError as e:
        raise ImageError(f"{what}: cannot read: {e.strerror or e}") from None
    return decode_image(data, limits, what)
