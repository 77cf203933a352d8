"""How an op holds each weight tensor it reads: the weight format, decided once by the plan.

vLLM's quant-method pattern: the plan (``optimize/plan.py``) asks each op class of a placement
(``Op.decide_format``) how it will hold each of its weights, from the tensor's stored type and the
op's kwargs (the experts' ``backend``), and hands the answers to the op, whose ``load`` follows them
instead of asking the source again; ``explain`` prints them.  The kinds:

* ``raw``: the stored ggml blocks, read in place (the CPU kernels' llamafile backend on a type they
  compute on, the quantized embedding's rows, the GPU linear's per-call dequantization); gpt-oss's
  MXFP4 experts are raw MXFP4 blocks;
* ``float``: a float copy in ``type`` (F32 / F16 / BF16): the torch ops in the model's dtype, and the
  CPU kernels' fallback where the stored type is not one they compute on;
* ``packed``: a copy the experts' backend requantizes at load into its tile layout
  (``kernels.moe.PACKED_BACKENDS``), from ``source`` (the raw blocks, or the float fallback);
* ``fp8``: float8 e4m3 with fp32 block scales (``KLinearFP8``), as stored or quantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import WeightError
from ..kernels.moe import IN_PLACE_BACKEND, PACKED_BACKENDS, packs
from ..weights.ggml_types import BY_NAME, TYPES, GGMLType

RAW, FLOAT, PACKED, FP8 = "raw", "float", "packed", "fp8"


@dataclass(frozen=True)
class WeightFormat:
    """One weight tensor as its op holds it (see the module docstring)."""

    kind: str
    #: raw: the stored type; float: the copy's type; packed / fp8: None
    type: GGMLType | None = None
    #: packed: the backend that packs it
    backend: str | None = None
    #: packed: what the backend packs from (a raw or float format)
    source: WeightFormat | None = None
    #: fp8: the block edge of the scales
    block: int | None = None

    @property
    def read(self) -> WeightFormat:
        """What the op reads from the weight source: this format, or what a packed one packs from."""
        return self.source if self.kind == PACKED else self

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of a float copy."""
        if self.kind != FLOAT:
            raise ValueError(f"a {self.label} weight has no float dtype")
        return getattr(torch, self.type.torch_dtype)

    @property
    def label(self) -> str:
        """How ``explain`` names it: ``raw Q4_K``, ``float BF16``, ``AMXInt8 packed from raw Q4_K``, ``FP8 128x128``."""
        if self.kind == PACKED:
            return f"{self.backend} packed from {self.source.label}"
        if self.kind == FP8:
            return f"FP8 {self.block}x{self.block}"
        return f"{self.kind} {self.type.name}"


def raw_format(t: GGMLType) -> WeightFormat:
    return WeightFormat(RAW, t)


def float_format(dtype: torch.dtype) -> WeightFormat:
    """A float copy in ``dtype`` (a float dtype a ggml type row stores: float32, float16, bfloat16)."""
    name = str(dtype).removeprefix("torch.")
    row = next((t for t in BY_NAME.values() if t.torch_dtype == name and t.block_elems == 1), None)
    if row is None or not dtype.is_floating_point:
        raise ValueError(f"no float weight format for {dtype}")
    return WeightFormat(FLOAT, row)


def stored_type(weights, name: str) -> GGMLType | None:
    """The ggml type ``name`` is stored in (None: plain floats, FP8, or a tensor computed from stored
    values), read from the file's header where the source can (GGUF's ``ggml_type``): deciding a
    format reads no tensor data."""
    probe = getattr(weights, "ggml_type", None)
    if callable(probe):
        tid = probe(name)
        return TYPES.get(tid) if tid is not None else None
    raw = weights.raw(name)
    return raw.type if raw is not None else None


def kernel_format(stored: GGMLType | None, dtype: torch.dtype, backend: str = IN_PLACE_BACKEND) -> WeightFormat:
    """The CPU kernels' format of a weight stored as ``stored`` (:func:`stored_type`): its raw
    blocks where the kernels compute on the type, else a float copy (F32 for an fp32 model, else
    BF16); packed from either by a packing ``backend`` (``llamafile_panels``: Q4_K blocks where the
    tier has the panel kernel; it reads any other weight as llamafile does)."""
    if stored is not None and stored.kernel:
        fmt = raw_format(stored)
    else:
        fmt = float_format(torch.float32 if dtype == torch.float32 else torch.bfloat16)
    packed = backend in PACKED_BACKENDS and packs(backend, fmt.type.name)
    return WeightFormat(PACKED, backend=backend, source=fmt) if packed else fmt


def kernel_backend(fmt: WeightFormat) -> str:
    """The MoE kernel backend that computes on a weight held as ``fmt`` (a :func:`kernel_format`):
    the packing backend of a packed format, else the one that reads the blocks or copy in place."""
    return fmt.backend if fmt.kind == PACKED else IN_PLACE_BACKEND


def read_for_kernel(weights, name: str, fmt: WeightFormat):
    """The array a CPU kernel takes for ``name`` under ``fmt`` (a packed format: what it packs from):
    the stored bytes of a raw format, read in place, or a contiguous float copy."""
    fmt = fmt.read
    if fmt.kind == FLOAT:
        return weights.tensor(name, dtype=fmt.torch_dtype).contiguous()
    return stored_blocks(weights, name, fmt).data


def stored_blocks(weights, name: str, fmt: WeightFormat):
    """The ``RawTensor`` of a weight whose plan format is raw; a source that stores it otherwise than
    the plan saw (a plan made on another file) is a one-line error."""
    raw = weights.raw(name)
    got = raw.type if raw is not None else None
    if got != fmt.type:
        raise WeightError(f"{weights.path}: tensor '{name}' is stored as {got.name if got else 'floats'}, "
                          f"but the plan holds it as {fmt.label} (a plan made for another weight file)")
    return raw
