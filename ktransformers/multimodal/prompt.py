"""A prompt with images: its token ids (a list, as every prompt the Generator takes) and the
processor's image inputs, which only the prefill forward reads.

The vision tower runs once, inside the model's own forward over the whole prompt (its image
features replace the image placeholder tokens there); the decode steps after it are text only.
Positions are M-RoPE's, from the model's own ``get_rope_index``: each image token at its
(t, h, w) place, text after the images shifted by the images' ``rope_delta``.
"""

from __future__ import annotations

import torch

#: the processor's outputs the model's forward takes besides the token ids
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
#: those only some families' processors give: ERNIE-4.5-VL's token kinds for its modality-isolated
#: experts (the image markers count as image tokens there)
OPTIONAL_IMAGE_INPUTS = ("moe_mm_token_type_ids",)


def vision_device(base) -> torch.device:
    """The device of the model's vision tower (``visual``: Qwen-VL, GLM-V; ``vision_tower``: ERNIE-VL)."""
    tower = getattr(base, "visual", None)
    tower = base.vision_tower if tower is None else tower
    return next(tower.parameters()).device


class VisionInputs:
    """The image inputs of one prompt and, once prefilled, its M-RoPE shift."""

    def __init__(self, inputs: dict):
        missing = [k for k in IMAGE_INPUTS if k not in inputs]
        if missing:
            raise ValueError(f"image inputs lack {', '.join(missing)} (the processor's outputs)")
        self.inputs = {k: inputs[k] for k in IMAGE_INPUTS + OPTIONAL_IMAGE_INPUTS if k in inputs}
        self.image_tokens = int(self.inputs["mm_token_type_ids"].eq(1).sum())
        self.rope_delta: int | None = None

    def prefill_kwargs(self, model, ids: torch.Tensor) -> dict:
        """The forward's keyword arguments beside ``input_ids`` for the whole prompt ``ids`` [1, n]:
        the images (on the vision tower's device) and the positions [4, 1, n] (cache row, t, h, w)."""
        base = model.model
        rope, delta = base.get_rope_index(ids, mm_token_type_ids=self.inputs["mm_token_type_ids"].to(ids.device),
                                          image_grid_thw=self.inputs["image_grid_thw"].to(ids.device))
        self.rope_delta = int(delta.reshape(-1)[0])
        n = ids.shape[1]
        text = torch.arange(n, device=ids.device).view(1, 1, n)
        vis_dev = vision_device(base)
        return dict(pixel_values=self.inputs["pixel_values"].to(vis_dev),
                    image_grid_thw=self.inputs["image_grid_thw"].to(vis_dev),
                    mm_token_type_ids=self.inputs["mm_token_type_ids"].to(ids.device),
                    position_ids=torch.cat([text, rope.to(ids.device)], dim=0),
                    **{k: self.inputs[k].to(ids.device) for k in OPTIONAL_IMAGE_INPUTS if k in self.inputs})

    def batch_kwargs(self, model, ids: torch.Tensor) -> tuple[dict, int]:
        """For the batching runner (generation/paged.py), which reads a prompt with images in one
        step of its own: the forward's keyword arguments beside ``input_ids`` for ``ids`` [1, n]
        (the prompt and, when it is read again after a preemption, the text generated since), and
        the M-RoPE shift of the tokens after it.  The pictures go through the vision tower here
        (``mm_encoder_outputs``), before the runner hands the text model's attention to its paged
        function: set on the model's config, that choice would reach the vision tower's config too."""
        base = model.model
        n = ids.shape[1]

        def whole(kinds):  # with the generated text after the prompt (text: 0)
            kinds = kinds.to(ids.device)
            return torch.cat([kinds, kinds.new_zeros(1, n - kinds.shape[1])], dim=1) if kinds.shape[1] < n else kinds

        kinds = whole(self.inputs["mm_token_type_ids"])
        grid = self.inputs["image_grid_thw"]
        rope, delta = base.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid.to(ids.device))
        vis_dev = vision_device(base)
        feats = model.get_image_features(self.inputs["pixel_values"].to(vis_dev), grid.to(vis_dev), return_dict=True)
        text = torch.arange(n, device=ids.device).view(1, 1, n)
        return dict(mm_encoder_outputs={"image": feats}, mm_token_type_ids=kinds,
                    position_ids=torch.cat([text, rope.to(ids.device)], dim=0),
                    **{k: whole(self.inputs[k]) for k in OPTIONAL_IMAGE_INPUTS if k in self.inputs}
                    ), int(delta.reshape(-1)[0])

    def positions(self, start: int, n: int, device) -> torch.Tensor:
        """Positions [4, 1, n] of ``n`` text tokens after the prompt, from cache row ``start``."""
        if self.rope_delta is None:
            raise RuntimeError("positions after a prompt with images are known once it is prefilled")
        row = torch.arange(start, start + n, device=device).view(1, 1, n)
        return torch.cat([row, (row + self.rope_delta).expand(3, 1, n)], dim=0)


class ImagePrompt(list):
    """Prompt token ids carrying their :class:`VisionInputs` (``.vision``) to the Generator."""

    def __init__(self, ids, inputs: dict):
        super().__init__(int(i) for i in ids)
        self.vision = VisionInputs(inputs)

    @classmethod
    def from_processor(cls, processed: dict) -> "ImagePrompt":
        """From the processor's output for one prompt (``multimodal.processor.image_prompt``)."""
        return cls(processed["input_ids"][0].tolist(), processed)
