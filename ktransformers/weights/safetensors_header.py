"""The safetensors file header (an 8-byte length, then JSON: dtype, shape and byte range per tensor),
parsed and checked without torch: the light converter maps tensors with numpy from it, and the
weight source reads stacked experts straight into their destination from it (no file mapping
left resident, no per-expert temporaries)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import WeightError

# bytes per element of the safetensors dtype names this project reads
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str            # safetensors dtype name ("BF16", ...)
    shape: tuple[int, ...]
    start: int            # absolute byte offsets in the file
    end: int


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """key -> entry for every tensor of one file; a malformed header or a byte range that does not
    match its shape and dtype is a :class:`WeightError` naming the file and the tensor."""
    f = Path(path)
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= min(size - 8, 1 << 27):
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise WeightError(f"{f}: unreadable safetensors file ({e})") from e
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            dtype, shape, (b0, b1) = v["dtype"], tuple(int(x) for x in v["shape"]), v["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise WeightError(f"{f}: tensor '{k}' has a malformed header entry ({e})") from e
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is not None and (not (0 <= b0 <= b1 <= size - 8 - n) or b1 - b0 != itemsize * math.prod(shape)):
            raise WeightError(f"{f}: tensor '{k}' has data offsets {b0}..{b1} that do not match its "
                              f"shape {list(shape)} {dtype} inside the file")
        out[k] = TensorEntry(dtype, shape, 8 + n + b0, 8 + n + b1)
    return out
