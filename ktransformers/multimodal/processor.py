"""The model's own transformers processor, used as it is: image resize and patching, the image
placeholder expanded to the image's token count, ``mm_token_type_ids`` for M-RoPE.

One adaptation: the processor is built without its video processor.  transformers' video
processors need torchvision, which this project does not install, and videos are not served;
everything the processor does for images is transformers' own code.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import ConfigError
from .images import ImageError, ImageLimits


def is_vision_language(config) -> bool:
    """Whether ``config`` is a vision-language model's (it has a vision tower to feed)."""
    return getattr(config, "vision_config", None) is not None


def _save_without_video(self, save_directory, push_to_hub: bool = False, **kwargs):
    """ProcessorMixin's save: the family's own may save its video processor's files (ERNIE-4.5-VL: a font)."""
    from transformers.processing_utils import ProcessorMixin

    return ProcessorMixin.save_pretrained(self, save_directory, push_to_hub, **kwargs)


@functools.cache
def _images_only(base: type) -> type:
    return type(f"ImagesOnly{base.__name__}", (base,), {
        "__doc__": f"{base.__name__} with its image processor and tokenizer only (no video processor).",
        "__module__": __name__,
        "get_attributes": classmethod(lambda cls: ["image_processor", "tokenizer"]),
        "save_pretrained": _save_without_video,
    })


def images_only_processor_class(config) -> type:
    """The processor class transformers pairs with ``config``'s model type, without its video part."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if name is None or not hasattr(transformers, name):
        raise ConfigError(f"model type '{config.model_type}' has no processor in transformers")
    return _images_only(getattr(transformers, name))


def load_processor(folder, config, tokenizer, source=None):
    """The processor for ``config`` with the image processor saved in ``folder``
    (``preprocessor_config.json`` or ``processor_config.json``) and the already loaded ``tokenizer``
    (its chat template is the one in use).  Without such a folder, a GGUF language model read with
    its ``mmproj`` (``source``) gives the image processor its metadata describes."""
    from transformers import AutoImageProcessor

    folder = Path(folder) if folder else None
    if folder is None or not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        make = getattr(source, "image_processor", None)
        if callable(make):
            return images_only_processor_class(config)(image_processor=make(), tokenizer=tokenizer,
                                                        chat_template=getattr(tokenizer, "chat_template", None))
        raise ConfigError(f"{folder}: a vision-language model needs its image processor's config "
                          f"(preprocessor_config.json or processor_config.json) beside the config")
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder}: cannot load its image processor: {str(e).splitlines()[0]}") from None
    return images_only_processor_class(config)(image_processor=image_processor, tokenizer=tokenizer,
                                                chat_template=getattr(tokenizer, "chat_template", None))


def image_prompt(processor, text: str, images: list, limits: ImageLimits = ImageLimits()) -> dict:
    """Model inputs for a prompt ``text`` (the chat template's output, one image placeholder per
    image) and its decoded ``images``: ``input_ids``, ``attention_mask``, ``mm_token_type_ids``,
    ``pixel_values``, ``image_grid_thw`` as tensors."""
    if len(images) > limits.max_images:
        raise ImageError(f"{len(images)} images, over the limit of {limits.max_images} a request (--max_images)")
    placeholder = processor.image_token
    marks = text.count(placeholder)
    if marks != len(images):
        raise ImageError(f"the prompt holds {marks} image placeholders ({placeholder}) for {len(images)} images")
    try:
        return dict(processor(text=[text], images=images or None, return_tensors="pt"))
    except ValueError as e:  # what the image processor cannot take (an aspect ratio past its limit ...)
        sizes = ", ".join(f"{w}x{h}" for w, h in (im.size for im in images))
        raise ImageError(f"images ({sizes}): the model's processor refused them: {str(e).splitlines()[0]}") from None
