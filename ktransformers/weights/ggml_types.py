"""The one table of ggml tensor types: a row a type (llama.cpp's ``type_traits``), holding its id,
name, block elements and bytes, kernel support, torch dequantizer, reference quantizer, whether the
converter writes it and llama-quantize's fallback for rows off its block.

Sizes come from gguf-py's constants (``GGMLQuantizationType`` / ``GGML_QUANT_SIZES``, llama.cpp's own
numbers) and are checked at import against the C++ extension's ``type_traits()``, so the Python side
and the kernels cannot disagree on a block size; the rest of a row is :data:`_CODECS`.  Everything
else (the GGUF reader, the dequantizer, the quantizer, the converter, the CPU kernels' argument
checks) asks this table, so a new type is one row here plus its block functions
(:mod:`.block_dequant`, :mod:`.block_quant`).

A weight's type travels as a :class:`GGMLType` (``RawTensor.type``) from the file to the kernel;
ids and names are only read at the edges (the file, the rule, the C++ call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from . import block_dequant as bd
from . import block_quant as bq


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int
    #: the C++ CPU kernels compute on weights stored in this type
    kernel: bool = False
    #: torch block dequantizer ``uint8 [n, block_bytes] -> float32 [n, block_elems]``; None: gguf-py's
    #: numpy one, where gguf-py has one
    dequant: Callable | None = field(default=None, repr=False, compare=False)
    #: our reference quantizer ``(float32 flat numpy of whole rows, values per step) -> ggml bytes``;
    #: None: the C++ quantizer's or gguf-py's
    quantize_ref: Callable | None = field(default=None, repr=False, compare=False)
    #: the converter writes this type (with the reference, the C++ or gguf-py's quantizer)
    writable: bool = False
    #: llama-quantize's type for rows that are not a multiple of this block
    fallback: str | None = None
    #: the torch dtype (by name) a plain element type's values are stored as
    torch_dtype: str | None = None

    @property
    def qtype(self) -> GGMLQuantizationType:
        """gguf-py's enum member (an ``IntEnum``: compares equal to the id)."""
        return GGMLQuantizationType(self.id)

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
        shape = tuple(shape)
        rows = 1
        for s in shape[:-1]:
            rows *= int(s)
        return rows * self.row_bytes(int(shape[-1]) if shape else 1)


def _kernel_traits() -> dict[int, tuple[str, int, int, bool]]:
    """id -> (name, block elems, block bytes, kernels take it) as the C++ extension has them."""
    try:
        from .. import cpuinfer_ext
    except ImportError:  # a build without the extension: no kernel types
        return {}
    traits = getattr(cpuinfer_ext, "type_traits", None)
    if traits is None:
        raise ImportError("the C++ extension predates type_traits(); rebuild it "
                          "(python setup.py build_ext --inplace)")
    return {int(i): (str(n), int(be), int(bb), bool(ok)) for i, n, be, bb, ok in traits()}


#: each row's facts besides its sizes and kernel support (the fields of :class:`GGMLType`; a plain
#: element type's dequantizer is its ``torch_dtype`` read as floats); a type missing here is
#: dequantized by gguf-py alone and never written
_CODECS: dict[str, dict] = {
    "F32": dict(quantize_ref=bq.quantize_f32, writable=True, torch_dtype="float32"),
    "F16": dict(quantize_ref=bq.quantize_f16, writable=True, torch_dtype="float16"),
    "BF16": dict(dequant=bd.dequant_bf16, quantize_ref=bq.quantize_bf16, writable=True, torch_dtype="bfloat16"),
    "Q4_0": dict(dequant=bd.dequant_q4_0, writable=True),
    "Q4_1": dict(dequant=bd.dequant_q4_1, writable=True),
    "Q5_0": dict(dequant=bd.dequant_q5_0, writable=True),
    "Q5_1": dict(dequant=bd.dequant_q5_1, writable=True),
    "Q8_0": dict(dequant=bd.dequant_q8_0, writable=True),
    "Q2_K": dict(dequant=bd.dequant_q2_k, quantize_ref=bq.quantize_q2_k, writable=True, fallback="Q4_0"),
    "Q3_K": dict(dequant=bd.dequant_q3_k, quantize_ref=bq.quantize_q3_k, writable=True, fallback="Q4_0"),
    "Q4_K": dict(dequant=bd.dequant_q4_k, quantize_ref=bq.quantize_q4_k, writable=True, fallback="Q5_0"),
    "Q5_K": dict(dequant=bd.dequant_q5_k, quantize_ref=bq.quantize_q5_k, writable=True, fallback="Q5_1"),
    "Q6_K": dict(dequant=bd.dequant_q6_k, quantize_ref=bq.quantize_q6_k, writable=True, fallback="Q8_0"),
    "IQ4_NL": dict(dequant=bd.dequant_iq4_nl, writable=True),
    "IQ4_XS": dict(dequant=bd.dequant_iq4_xs, writable=True, fallback="IQ4_NL"),
    "MXFP4": dict(dequant=bd.dequant_mxfp4, writable=True),
    "IQ1_S": dict(dequant=bd.dequant_iq1_s),
    "IQ1_M": dict(dequant=bd.dequant_iq1_m),
    "IQ2_XXS": dict(dequant=bd.dequant_iq2_xxs),
    "IQ2_XS": dict(dequant=bd.dequant_iq2_xs),
    "IQ2_S": dict(dequant=bd.dequant_iq2_s),
    "IQ3_XXS": dict(dequant=bd.dequant_iq3_xxs),
    "IQ3_S": dict(dequant=bd.dequant_iq3_s),
    "I8": dict(torch_dtype="int8"),
    "I16": dict(torch_dtype="int16"),
    "I32": dict(torch_dtype="int32"),
    "I64": dict(torch_dtype="int64"),
    "F64": dict(torch_dtype="float64"),
}


def _build() -> dict[int, GGMLType]:
    kernel = _kernel_traits()
    unknown = sorted(set(_CODECS) - {qt.name for qt in GGML_QUANT_SIZES})
    if unknown:
        raise ImportError(f"ggml type table: rows {unknown} name no type gguf-py knows")
    table = {}
    for qt, (be, bb) in GGML_QUANT_SIZES.items():
        k = kernel.get(int(qt))
        if k is not None and k[:3] != (qt.name, be, bb):
            raise ImportError(f"ggml type {qt.name} ({int(qt)}): the C++ kernels say {k[1]} elements / {k[2]} bytes "
                              f"per block, gguf-py says {be} / {bb}; fix csrc/ggml_types.cpp and rebuild")
        facts = dict(_CODECS.get(qt.name, {}))
        if facts.get("torch_dtype") and "dequant" not in facts:  # a plain element type: its values as floats
            facts["dequant"] = bd.dequant_plain(facts["torch_dtype"])
        table[int(qt)] = GGMLType(int(qt), qt.name, be, bb, kernel=bool(k and k[3]), **facts)
    unknown = sorted(set(kernel) - set(table))
    if unknown:
        raise ImportError(f"the C++ kernels know ggml type id(s) {unknown} that gguf-py does not")
    by_name = {t.name: t for t in table.values()}
    for t in table.values():
        if t.fallback is not None and not (t.fallback in by_name and by_name[t.fallback].writable):
            raise ImportError(f"ggml type table: {t.name}'s fallback {t.fallback!r} is not a type the converter writes")
    return table


TYPES: dict[int, GGMLType] = _build()
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}
#: the types the CPU kernels compute on, by name
KERNEL_TYPES: dict[str, GGMLType] = {t.name: t for t in TYPES.values() if t.kernel}


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


#: llama.cpp's ``general.file_type`` (LLAMA_FTYPE_*, gguf-py's ``LlamaFileType``) by preset name
#: (``"Q4_K_M"`` -> 15); the converter writes it, the server reads it back
FILE_TYPES: dict[str, int] = {ft.name.removeprefix("MOSTLY_").removeprefix("ALL_"): int(ft)
                              for ft in LlamaFileType if ft.name != "GUESSED"}
#: the preset name of each ``general.file_type`` value
FILE_TYPE_NAMES: dict[int, str] = {v: k for k, v in FILE_TYPES.items()}
