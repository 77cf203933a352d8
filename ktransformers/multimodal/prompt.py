"""A prompt with images: its token ids (a list, as every prompt the Generator takes) and the
processor's image inputs, which only the prefill forward reads.

The vision tower runs once, inside the model's own forward over the whole prompt (its image
features replace the image placeholder tokens there); the decode steps after it are text only.
Positions are M-RoPE's, from the model's own ``get_rope_index``: each image token at its
(t, h, w) place, text after the images shifted by the images' ``rope_delta``.

For the batching server's prefix cache a picture is named by a hash of what the processor made of
it (:meth:`VisionInputs.spans`), and the batching runner can read a prompt with pictures from a
cached start on (:meth:`VisionInputs.batch_kwargs` with ``past``).
"""

from __future__ import annotations

import hashlib

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


def _digest(*tensors: torch.Tensor) -> bytes:
    """SHA-256 of tensors' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def _runs(kinds: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image tokens (kind 1) in ``kinds`` [1, n]."""
    mark = torch.cat([torch.zeros(1, dtype=torch.int8), kinds.reshape(-1).eq(1).to(torch.int8),
                      torch.zeros(1, dtype=torch.int8)])
    edges = torch.diff(mark).nonzero().reshape(-1).tolist()
    return list(zip(edges[0::2], edges[1::2]))


class VisionInputs:
    """The image inputs of one prompt and, once prefilled, its M-RoPE shift.  ``ids``: the prompt's
    token ids, which a read from a cached start on needs (the positions are the whole prompt's)."""

    def __init__(self, inputs: dict, ids=None):
        missing = [k for k in IMAGE_INPUTS if k not in inputs]
        if missing:
            raise ValueError(f"image inputs lack {', '.join(missing)} (the processor's outputs)")
        self.inputs = {k: inputs[k] for k in IMAGE_INPUTS + OPTIONAL_IMAGE_INPUTS if k in inputs}
        self.image_tokens = int(self.inputs["mm_token_type_ids"].eq(1).sum())
        self.rope_delta: int | None = None
        self.ids = None if ids is None else [int(i) for i in ids]
        if self.ids is not None and len(self.ids) != self.inputs["mm_token_type_ids"].shape[-1]:
            raise ValueError(f"image inputs: mm_token_type_ids covers {self.inputs['mm_token_type_ids'].shape[-1]} "
                             f"tokens, the prompt has {len(self.ids)}")
        self._spans: list[tuple[int, int, bytes]] | None = None

    def spans(self) -> list[tuple[int, int, bytes]]:
        """Per picture, ``(start, end, digest)``: its image tokens' span in the prompt and a SHA-256
        of what the processor made of it (its ``pixel_values`` rows and ``image_grid_thw`` row), the
        prefix cache's name for the picture (server/prefix_cache.py ``image_salts``).  The digest is
        of the decoded, resized pixels, so two encodings of one picture (PNG, lossless WebP) that
        decode to the same pixels share it, and a picture that differs in one pixel does not.  Each
        run of image tokens is one picture, as ``get_rope_index`` reads them; a processor whose
        pixel rows do not split by ``image_grid_thw`` (or whose runs do not count the pictures) gets
        one digest of all its pictures over the span from the first image token to the last."""
        if self._spans is None:
            grid = self.inputs["image_grid_thw"].reshape(-1, 3)
            pixels = self.inputs["pixel_values"]
            runs = _runs(self.inputs["mm_token_type_ids"])
            rows = grid.prod(-1).tolist()
            if not runs:
                self._spans = []
            elif len(runs) == len(rows) and pixels.shape[0] == sum(rows):
                offsets = [0]
                for r in rows:
                    offsets.append(offsets[-1] + r)
                self._spans = [(a, b, _digest(pixels[offsets[i]:offsets[i + 1]], grid[i]))
                               for i, (a, b) in enumerate(runs)]
            else:
                self._spans = [(runs[0][0], runs[-1][1], _digest(pixels, grid))]
        return self._spans

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

    def batch_kwargs(self, model, ids: torch.Tensor, past: int = 0) -> tuple[dict, int]:
        """For the batching runner (generation/paged.py), which reads a prompt with images in one
        step of its own: the forward's keyword arguments beside ``input_ids`` for ``ids`` [1, n],
        the tokens from cache row ``past`` on (the prompt's rest and, when it is read again after a
        preemption, the text generated since), and the M-RoPE shift of the tokens after it.  The
        first ``past`` tokens are in the cache already (a prefix-cache hit, at most the prompt:
        their ids are :attr:`ids`).

        The positions are the whole sequence's ``get_rope_index`` from row ``past`` on: after a
        picture they are not the token indices, so a read from a cached start takes them from the
        whole prompt, never from ``past``.  The pictures go through the vision tower here
        (``mm_encoder_outputs``), all of them as in a read from the first token, so an image
        token's features are the same bits whether its picture's start was cached or not; only the
        features of the image tokens being read are passed (none: the tower does not run).  This
        is before the runner hands the text model's attention to its paged function: set on the
        model's config, that choice would reach the vision tower's config too."""
        base = model.model
        past = int(past)
        if past:
            if self.ids is None or not 0 < past <= len(self.ids):
                raise ValueError(f"a prompt with images read from cache row {past}: the cached start must lie "
                                 f"within its prompt of {'unknown' if self.ids is None else len(self.ids)} tokens")
            ids = torch.cat([torch.tensor([self.ids[:past]], dtype=ids.dtype, device=ids.device), ids], dim=1)
        n = ids.shape[1]

        def whole(kinds):  # with the generated text after the prompt (text: 0)
            kinds = kinds.to(ids.device)
            return torch.cat([kinds, kinds.new_zeros(1, n - kinds.shape[1])], dim=1) if kinds.shape[1] < n else kinds

        kinds = whole(self.inputs["mm_token_type_ids"])
        grid = self.inputs["image_grid_thw"]
        rope, delta = base.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid.to(ids.device))
        text = torch.arange(n, device=ids.device).view(1, 1, n)
        out = dict(mm_token_type_ids=kinds[:, past:],
                   position_ids=torch.cat([text, rope.to(ids.device)], dim=0)[..., past:],
                   **{k: whole(self.inputs[k])[:, past:] for k in OPTIONAL_IMAGE_INPUTS if k in self.inputs})
        first = int(kinds[:, :past].eq(1).sum())  # image tokens in the cached start
        count = int(kinds[:, past:].eq(1).sum())
        if count:
            vis_dev = vision_device(base)
            feats = model.get_image_features(self.inputs["pixel_values"].to(vis_dev), grid.to(vis_dev),
                                             return_dict=True)
            out["mm_encoder_outputs"] = {"image": feats if count == self.image_tokens else
                                         _feature_rows(feats, first, first + count)}
        return out, int(delta.reshape(-1)[0])

    def positions(self, start: int, n: int, device) -> torch.Tensor:
        """Positions [4, 1, n] of ``n`` text tokens after the prompt, from cache row ``start``."""
        if self.rope_delta is None:
            raise RuntimeError("positions after a prompt with images are known once it is prefilled")
        row = torch.arange(start, start + n, device=device).view(1, 1, n)
        return torch.cat([row, (row + self.rope_delta).expand(3, 1, n)], dim=0)


def _feature_rows(feats, start: int, end: int):
    """``get_image_features``' output cut to the image tokens ``start .. end-1`` (counted over all
    the prompt's pictures): its per-picture ``pooler_output`` and, where the family has them
    (Qwen3-VL), its per-layer ``deepstack_features``, each as one piece."""
    fields = dict(feats)
    fields["pooler_output"] = (torch.cat(list(feats.pooler_output))[start:end],)
    deep = getattr(feats, "deepstack_features", None)
    if deep is not None:
        fields["deepstack_features"] = [(torch.cat(list(f))[start:end],) for f in deep]
    return type(feats)(**fields)


class ImagePrompt(list):
    """Prompt token ids carrying their :class:`VisionInputs` (``.vision``) to the Generator."""

    def __init__(self, ids, inputs: dict):
        super().__init__(int(i) for i in ids)
        self.vision = VisionInputs(inputs, ids=self)

    @classmethod
    def from_processor(cls, processed: dict) -> "ImagePrompt":
        """From the processor's output for one prompt (``multimodal.processor.image_prompt``)."""
        return cls(processed["input_ids"][0].tolist(), processed)
