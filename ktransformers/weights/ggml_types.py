"""The one table of ggml tensor types: id, name, block elements, block bytes, kernel support.

Built from gguf-py's constants (``GGMLQuantizationType`` / ``GGML_QUANT_SIZES``, llama.cpp's own
numbers) and checked at import against the C++ extension's ``type_traits()``, so the Python side
and the kernels cannot disagree on a block size.  Everything else (the GGUF reader, the
dequantizers, the quantizers, the converter, the CPU kernels' argument checks) asks this table.

A weight's type travels as a :class:`GGMLType` (``RawTensor.type``) from the file to the kernel;
ids and names are only read at the edges (the file, the rule, the C++ call).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int
    #: the C++ CPU kernels compute on weights stored in this type
    kernel: bool = False

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


def _build() -> dict[int, GGMLType]:
    kernel = _kernel_traits()
    table = {}
    for qt, (be, bb) in GGML_QUANT_SIZES.items():
        k = kernel.get(int(qt))
        if k is not None and k[:3] != (qt.name, be, bb):
            raise ImportError(f"ggml type {qt.name} ({int(qt)}): the C++ kernels say {k[1]} elements / {k[2]} bytes "
                              f"per block, gguf-py says {be} / {bb}; fix csrc/ggml_types.cpp and rebuild")
        table[int(qt)] = GGMLType(int(qt), qt.name, be, bb, kernel=bool(k and k[3]))
    unknown = sorted(set(kernel) - set(table))
    if unknown:
        raise ImportError(f"the C++ kernels know ggml type id(s) {unknown} that gguf-py does not")
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
