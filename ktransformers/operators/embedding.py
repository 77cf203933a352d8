"""Token embeddings: ``KTransformersEmbedding`` and its ops.

``KEmbeddingQuant`` keeps the table in its stored GGUF type and dequantizes only the rows a
call asks for: Gemma-3's 262144 x 640 table is 178 MB as Q8_0 and 671 MB expanded to fp32, and a
decode step needs one row.  ``KEmbeddingTorch`` is the plain dequantized table.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule, Op
from .formats import FLOAT, float_format, raw_format, stored_blocks, stored_type
from .kinds import EMBEDDING
from .registry import register

EMBEDDING_OPS: dict[str, type[Op]] = {}


class EmbeddingOp(Op):
    """``forward(ids[...]) -> [..., dim]`` in the model dtype, ids on ``self.device``."""

    TABLE = EMBEDDING_OPS

    def __init__(self, key, config, orig_module, device, **kwargs):
        super().__init__(key, config, orig_module, device, **kwargs)
        self.num_embeddings = int(orig_module.num_embeddings)
        self.embedding_dim = int(orig_module.embedding_dim)
        self.padding_idx = orig_module.padding_idx
        self.weight_shape = (self.num_embeddings, self.embedding_dim)

    @classmethod
    def weight_names(cls, key: str) -> tuple[str, ...]:
        return (f"{key}.weight",)


@register("KEmbeddingTorch")
class KEmbeddingTorch(EmbeddingOp):
    """The whole table dequantized once into the model dtype (any device)."""

    def load(self, weights, dtype):
        self.weight = self.float_weight(weights, f"{self.key}.weight", dtype)

    def forward(self, ids):
        return F.embedding(ids, self.weight, self.padding_idx)


@register("KEmbeddingQuant")
class KEmbeddingQuant(EmbeddingOp):
    """Rows gathered from the stored blocks (zero-copy view of the file) and dequantized per call.
    Float sources (safetensors) have nothing to keep quantized: the table is held as loaded."""

    device_kinds = ("cpu",)

    @classmethod
    def decide_format(cls, weights, name, dtype, kwargs):
        """Any stored ggml type stays as stored; a float source (or FP8 blocks) is the table as loaded."""
        stored = stored_type(weights, name)
        return raw_format(stored) if stored is not None else float_format(dtype)

    def load(self, weights, dtype):
        from ..weights.dequant import block_dequantizer

        name = f"{self.key}.weight"
        self.check_shape(weights, name)
        self.dtype = dtype
        fmt = self.weight_format(weights, name, dtype)
        self.weight = None
        self._rows = None
        if fmt.kind == FLOAT:
            self.weight = weights.tensor(name, dtype=fmt.torch_dtype, device=self.device)
            return
        raw = stored_blocks(weights, name, fmt)
        info = raw.type
        self.ggml_type = info  # the lean decode step dequantizes single rows of kernel types in C++
        self._block = (info.block_bytes, info.block_elems)
        self._dequant = block_dequantizer(info)
        with warnings.catch_warnings():  # the mapped file is read-only; the view is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw.data)
        self._rows = flat.view(self.num_embeddings, -1)
        self._raw = raw.data  # keeps the mapping alive

    def forward(self, ids):
        if self._rows is None:
            return F.embedding(ids, self.weight, self.padding_idx)
        bb, be = self._block
        picked = self._rows.index_select(0, ids.reshape(-1))
        vals = self._dequant(picked.reshape(-1, bb)).reshape(*ids.shape, self.embedding_dim)
        return vals.to(self.dtype)

    def nbytes(self) -> int:
        if self._rows is not None:
            return int(self._rows.numel())
        return super().nbytes()

    def unload(self):
        self._rows = None
        self._raw = None
        self.weight = None
        self.loaded = False


@register("KTransformersEmbedding")
class KTransformersEmbedding(BaseInjectedModule):
    """Drop-in for ``nn.Embedding`` (incl. scaled variants such as Gemma-3's, whose
    ``embed_scale`` multiplies the rows).  kwargs: ``generate_op`` (``KEmbeddingQuant``,
    ``KEmbeddingTorch``), devices."""

    OPS = EMBEDDING_OPS
    OP_TABLE_NAME = "embedding"
    DEFAULT_OP = "KEmbeddingTorch"
    REPLACES = (EMBEDDING,)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        op = self.generate_op
        y = op.forward(input_ids.to(op.device))
        scale = getattr(self.orig_module, "embed_scale", None)
        if scale is not None:
            if scale.is_meta:  # model built under torch.device("meta"): every such class uses sqrt(hidden)
                scale = torch.tensor(float(self.config.hidden_size) ** 0.5)
            y = y * scale.to(device=y.device, dtype=y.dtype)
        return y

    @property
    def weight(self) -> torch.Tensor:
        """The table where one is held; a quantized table has no float copy, so code that
        inspects ``.weight`` (dtype, shape) sees the original's meta placeholder."""
        w = getattr(self.generate_op, "weight", None)
        return w if w is not None else self.orig_module.weight
