"""Streaming the planned tensors into a GGUF file.

Each tensor is read, transformed and quantized (stacked experts one expert at a time) on a worker
thread, :data:`_AHEAD` tensors ahead of the one being written, so memory stays near the size of
those and the one being written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..weights.ggml_types import ggml_type_info
from .tensor_plan import PlannedTensor


#: tensors produced ahead of the one being written
_AHEAD = 2


def write_gguf(output: Path, metadata: dict, outs: list[PlannedTensor], log: Callable[[str], None] | None = None,
               progress: bool = False) -> None:
    """Stream ``outs`` into a GGUF file with gguf-py's writer (header, metadata, tensor infos, data)."""
    import gguf

    arch = metadata["general.architecture"][1]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch=arch)
    for k, (kind, v) in metadata.items():
        if k == "general.architecture":
            continue
        if kind == "arr":
            w.add_array(k, v)
            continue
        if kind in ("i32arr", "f32arr"):
            sub = gguf.GGUFValueType.INT32 if kind == "i32arr" else gguf.GGUFValueType.FLOAT32
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=sub)
            continue
        {"str": w.add_string, "u32": w.add_uint32, "f32": w.add_float32, "bool": w.add_bool}[kind](k, v)
    for o in outs:  # every type as its bytes: gguf-py derives the element shape from the row's sizes
        info = ggml_type_info(o.ggml_type)
        byte_shape = (*o.shape[:-1], info.row_bytes(o.shape[-1]))
        w.add_tensor_info(o.name, byte_shape, np.dtype(np.uint8), o.nbytes, raw_dtype=info.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(int(np.prod(o.shape)) for o in outs)
        bar = tqdm(total=total, unit="param", unit_scale=True, desc=f"quantizing {output.name}", file=sys.stderr)
    # tensors are read and quantized ahead on worker threads (the C++ quantizer releases the GIL)
    # while the main thread writes the previous one
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="convert")
    ahead = [pool.submit(o.produce) for o in outs[:_AHEAD]]
    for i, o in enumerate(outs):
        try:
            data = ahead[i].result()
        except BaseException:
            for f in ahead[i:]:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        ahead[i] = None  # drop the reference: memory stays near _AHEAD tensors
        if i + _AHEAD < len(outs):
            ahead.append(pool.submit(outs[i + _AHEAD].produce))
        if data.nbytes != o.nbytes:
            raise AssertionError(f"{o.name}: produced {data.nbytes} bytes, expected {o.nbytes}")
        w.write_tensor_data(data)
        if bar is not None:
            bar.update(int(np.prod(o.shape)))
            bar.set_postfix_str(f"{o.name} {o.ggml_type}", refresh=False)
        elif log:
            log(f"[{i + 1}/{len(outs)}] {o.name} {o.ggml_type} {list(o.shape)} ({time.time() - t0:.1f}s)")
    pool.shutdown()
    if bar is not None:
        bar.close()
    w.close()
    tmp.replace(output)
