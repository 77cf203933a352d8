"""Images inside chat messages, for the server and local_chat.

A request's image parts are decoded (limits checked) as the messages are read, each replaced in
the message text by the model's image markup, as its chat template writes an image part (Qwen-VL:
``<|vision_start|><|image_pad|><|vision_end|>``, GLM-4.5V: ``<|begin_of_image|><|image|><|end_of_image|>``).  Once the chat template has rendered the prompt, the
model's processor expands each placeholder to the image's tokens: an :class:`~.prompt.ImagePrompt`,
whose length (the prompt tokens a client is billed) counts the image tokens.
"""

from __future__ import annotations

from pathlib import Path

from .images import ImageError, ImageLimits, decode_base64, decode_image, image_from_path, image_from_url
from .prompt import ImagePrompt


class ImageSupport:
    """What a loaded vision-language model needs to take images: its processor and the limits."""

    def __init__(self, processor, limits: ImageLimits = ImageLimits(), markup: str | None = None):
        self.processor = processor
        self.limits = limits
        self._markup = markup

    @property
    def markup(self) -> str:
        """The text an image part becomes in a message (one placeholder the processor expands)."""
        if self._markup is not None:
            return self._markup
        p = self.processor
        return f"{getattr(p, 'vision_start_token', '')}{p.image_token}{getattr(p, 'vision_end_token', '')}"

    def collector(self) -> "ImageCollector":
        return ImageCollector(self)

    def prompt(self, text: str, images: list) -> ImagePrompt:
        """The prompt ``text`` (with one placeholder per image) and its images as model inputs."""
        from .processor import image_prompt

        return ImagePrompt.from_processor(image_prompt(self.processor, text, images, self.limits))


class ImageCollector:
    """The images of one request, in the order their parts appear."""

    def __init__(self, support: ImageSupport):
        self.support = support
        self.images: list = []

    def _add(self, image) -> str:
        self.images.append(image)
        return self.support.markup

    def _room(self, where: str) -> None:
        limit = self.support.limits.max_images
        if len(self.images) >= limit:
            raise ImageError(f"{where}: more than {limit} images in one request (--max_images)")

    def add_part(self, part: dict, where: str) -> str:
        """An OpenAI ``image_url`` part (``{"url": ...}`` or the URL), a Responses ``input_image``
        (``image_url``), or ``{"type": "image", "data": <base64>}`` (Ollama's ``images``)."""
        self._room(where)
        limits = self.support.limits
        if part.get("type") == "image":
            return self._add(decode_image(decode_base64(part.get("data"), limits, where), limits, where))
        url = part.get("image_url")
        if url is None and part.get("file_id") is not None:
            raise ImageError(f"{where}.file_id: this server stores no files; send the image as image_url, "
                             f"a data:image/...;base64 URL")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str):
            raise ImageError(f"{where}.image_url: expected a URL string or {{\"url\": ...}}")
        return self._add(image_from_url(url, limits, f"{where}.image_url"))

    def add_path(self, path: str | Path) -> str:
        """An image file from the local disk (local_chat)."""
        self._room(str(path))
        return self._add(image_from_path(path, self.support.limits))


def image_support(config, tokenizer, folder, limits: ImageLimits = ImageLimits(), source=None) -> ImageSupport | None:
    """The :class:`ImageSupport` of a vision-language model (None for a text model); ``source``: the
    weights, whose mmproj describes the image processor where ``folder`` has none."""
    from .processor import is_vision_language, load_processor

    if not is_vision_language(config):
        return None
    processor = load_processor(folder, config, tokenizer, source)
    return ImageSupport(processor, limits, image_markup(config, processor))


#: the config's ids of the tokens around an image's placeholder, per family naming
_MARKER_IDS = (("vision_start_token_id", "vision_end_token_id"),  # Qwen-VL
               ("image_start_token_id", "image_end_token_id"))  # GLM-4.1V / 4.5V


def image_markup(config, processor) -> str:
    """An image part in a message: the processor's placeholder between the begin / end markers the
    config names (their text from the processor's tokenizer), as the family's chat template writes it."""
    tok = processor.tokenizer
    for start, end in _MARKER_IDS:
        ids = getattr(config, start, None), getattr(config, end, None)
        if None not in ids:
            begin, finish = tok.convert_ids_to_tokens(list(ids))
            return f"{begin}{processor.image_token}{finish}"
    return processor.image_token
