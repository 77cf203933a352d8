"""The one table of ggml tensor types: id, name, block elements, block bytes, torch dequantizer.

Everything else in the project (the GGUF reader, the dequantizers, the quantizers, the converter,
kernels choosing a code path) asks this table; nothing else hard-codes block sizes.  The ids and
sizes are llama.cpp's (``ggml.h`` / ``GGML_QUANT_SIZES`` in gguf-py; a test checks they agree).

``dequant`` is the vectorized torch block function from :mod:`.dequant` (``uint8 [n, block_bytes]
-> float32 [n, block_elems]``), or ``None`` when only gguf-py's numpy fallback can expand the type
(see :func:`.dequant.block_dequantizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import dequant as _dq


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int
    dequant: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def quantized(self) -> bool:
        """True for block formats (anything but plain float/int element types)."""
        return self.block_elems > 1

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_elems

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of ``n`` elements (``n`` must be a multiple of ``block_elems``)."""
        if n % self.block_elems:
            raise ValueError(f"row of {n} elements is not a multiple of the {self.name} block ({self.block_elems})")
        return n // self.block_elems * self.block_bytes

    def nbytes(self, shape) -> int:
        """Bytes of a tensor of torch ``shape`` (last dim = row)."""
        rows = 1
        for s in tuple(shape)[:-1]:
            rows *= int(s)
        return rows * self.row_bytes(int(tuple(shape)[-1]) if len(tuple(shape)) else 1)


def _plain(torch_dtype):
    def fn(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch_dtype).to(torch.float32)

    return fn


# id, name, block elements, block bytes, torch dequantizer (None: gguf-py fallback or unsupported)
_ROWS = [
    (0, "F32", 1, 4, _dq._deq_f32),
    (1, "F16", 1, 2, _dq._deq_f16),
    (2, "Q4_0", 32, 18, _dq._deq_q4_0),
    (3, "Q4_1", 32, 20, _dq._deq_q4_1),
    (6, "Q5_0", 32, 22, _dq._deq_q5_0),
    (7, "Q5_1", 32, 24, _dq._deq_q5_1),
    (8, "Q8_0", 32, 34, _dq._deq_q8_0),
    (9, "Q8_1", 32, 40, None),
    (10, "Q2_K", 256, 84, _dq._deq_q2_k),
    (11, "Q3_K", 256, 110, _dq._deq_q3_k),
    (12, "Q4_K", 256, 144, _dq._deq_q4_k),
    (13, "Q5_K", 256, 176, _dq._deq_q5_k),
    (14, "Q6_K", 256, 210, _dq._deq_q6_k),
    (15, "Q8_K", 256, 292, None),
    (16, "IQ2_XXS", 256, 66, None),
    (17, "IQ2_XS", 256, 74, None),
    (18, "IQ3_XXS", 256, 98, None),
    (19, "IQ1_S", 256, 50, None),
    (20, "IQ4_NL", 32, 18, _dq._deq_iq4_nl),
    (21, "IQ3_S", 256, 110, None),
    (22, "IQ2_S", 256, 82, None),
    (23, "IQ4_XS", 256, 136, _dq._deq_iq4_xs),
    (24, "I8", 1, 1, _plain(torch.int8)),
    (25, "I16", 1, 2, _plain(torch.int16)),
    (26, "I32", 1, 4, _plain(torch.int32)),
    (27, "I64", 1, 8, _plain(torch.int64)),
    (28, "F64", 1, 8, _plain(torch.float64)),
    (29, "IQ1_M", 256, 56, None),
    (30, "BF16", 1, 2, _dq._deq_bf16),
    (34, "TQ1_0", 256, 54, None),
    (35, "TQ2_0", 256, 66, None),
    (39, "MXFP4", 32, 17, None),
    (40, "NVFP4", 64, 36, None),
    (41, "Q1_0", 128, 18, None),
]

TYPES: dict[int, GGMLType] = {r[0]: GGMLType(*r) for r in _ROWS}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

#: the types :mod:`.dequant` expands in torch (bit-exact with gguf-py)
TORCH_DEQUANT_TYPES = tuple(t.name for t in TYPES.values() if t.dequant is not None)


def ggml_type_info(t) -> GGMLType:
    """Look a type up by id (int / IntEnum), name ("Q4_K", case-insensitive) or GGMLType."""
    if isinstance(t, GGMLType):
        return t
    if isinstance(t, str):
        info = BY_NAME.get(t.upper())
        if info is None:
            raise KeyError(f"unknown ggml type {t!r} (known: {', '.join(BY_NAME)})")
        return info
    info = TYPES.get(int(t))
    if info is None:
        raise KeyError(f"unknown ggml type id {int(t)}")
    return info


def type_id(t) -> int:
    return ggml_type_info(t).id


def type_name(t) -> str:
    try:
        return ggml_type_info(t).name
    except KeyError:
        return f"type{int(t)}"
