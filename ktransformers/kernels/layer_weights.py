"""One MoE layer's routed experts read from a weight file, as ``MoEKernel.from_gguf`` /
``from_safetensors`` take them.

The file is opened with the project's weight sources (``ktransformers.weights.open_weights``) and
the layer is asked for by the stacked names every source serves
(``model.layers.N.mlp.experts.{gate,up,down}_proj``, see ``weights/source.py``): the GGUF source's
name table finds ``blk.N.ffn_{gate,up,down}_exps.weight`` (read in place, zero copy); the
safetensors source stacks per-expert keys (``experts.E.gate_proj.weight``, Mixtral's ``w1/w3/w2``)
or splits the fused ``experts.gate_up_proj``.  A GGUF of an architecture without a name table is
read by its GGUF tensor names directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import WeightError
from ..weights import EXPERT_PROJS, open_weights
from ..weights.ggml_types import KERNEL_TYPES
from ..weights.gguf_names import EXPERT_GGUF

#: torch dtype name -> the float ggml type of the kernels that holds it (F32, F16, BF16: the type table's)
_FLOAT_TYPES = {t.torch_dtype: t.name for t in KERNEL_TYPES.values() if t.block_elems == 1 and t.torch_dtype}


@dataclass
class LayerExperts:
    """The three stacked projections of one layer: ``gate``/``up [E, I, H]``, ``down [E, H, I]``,
    each the stored ggml bytes (a type the kernels take) or a float tensor, with its type name."""

    path: str
    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    weights: dict[str, Any]
    types: dict[str, str]
    biases: dict[str, Any] = field(default_factory=dict)


def check_layer(layer: Any) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer: expected a non-negative int, got {layer!r}")
    return layer


def _names(layer: int, proj: str) -> tuple[str, str]:
    """(stacked HF name, GGUF name) of one projection of ``layer``."""
    return f"model.layers.{layer}.mlp.experts.{proj}", f"blk.{layer}.{EXPERT_GGUF[proj]}.weight"


def _kernel_array(src, name: str) -> tuple[Any, str]:
    """The stored bytes when the source keeps a type the kernels compute on, else the dequantized
    tensor in its own float precision (a kernel type too), float32 for anything else."""
    raw = src.raw(name)
    if raw is not None and raw.type is not None and raw.type.kernel:
        return raw.data, raw.type.name
    import torch

    t = src.tensor(name)
    if str(t.dtype).removeprefix("torch.") not in _FLOAT_TYPES:
        t = t.to(torch.float32)
    return t.contiguous(), _FLOAT_TYPES[str(t.dtype).removeprefix("torch.")]


def _layers_with_experts(src) -> list[int]:
    import re

    pat = re.compile(r"^(?:model\.layers\.(\d+)\.mlp\.experts\.(?:gate_proj|gate_up_proj)|"
                     r"blk\.(\d+)\.ffn_gate_exps\.weight)$")
    names = list(src.names()) + list(getattr(src, "gguf_names", list)())
    return sorted({int(m.group(1) or m.group(2)) for n in names if (m := pat.match(n))})


def read_layer_experts(src, layer: int) -> LayerExperts:
    """The routed experts of ``layer`` from an open weight source; ``WeightError`` naming the file,
    the layer and the tensors when the layer has none or their shapes disagree."""
    found: dict[str, str] = {}
    for proj in EXPERT_PROJS:
        name = next((n for n in _names(layer, proj) if src.has(n)), None)
        if name is None:
            have = _layers_with_experts(src)
            where = f"layers with experts: {', '.join(map(str, have))}" if have else "the file holds no routed experts"
            raise WeightError(f"{src.path}: layer {layer} has no routed experts ({' / '.join(_names(layer, proj))} "
                              f"not found; {where})")
        found[proj] = name
    shapes = {proj: tuple(src.shape(n)) for proj, n in found.items()}
    g = shapes["gate_proj"]
    if len(g) != 3 or shapes["up_proj"] != g or shapes["down_proj"] != (g[0], g[2], g[1]):
        listed = ", ".join(f"{found[p]} {list(s)}" for p, s in shapes.items())
        raise WeightError(f"{src.path}: layer {layer}: expected gate/up [E, I, H] and down [E, H, I], got {listed} "
                          "(a checkpoint storing its experts transposed, as gpt-oss's bf16 one, is not read here)")
    E, I, H = g
    weights, types = {}, {}
    for proj, name in found.items():
        weights[proj], types[proj] = _kernel_array(src, name)
    biases = {}
    for proj in EXPERT_PROJS:
        name = f"model.layers.{layer}.mlp.experts.{proj}_bias"
        if src.has(name):
            import torch

            biases[proj] = src.tensor(name, dtype=torch.float32).contiguous()
    return LayerExperts(src.path, layer, E, H, I, weights, types, biases)


def open_layer_experts(path: str | os.PathLike, layer: int, kind: str) -> LayerExperts:
    """Open ``path`` (``kind`` ``"gguf"`` or ``"safetensors"``: a file, or a folder of them) and read
    ``layer``'s experts; a file of the other kind is refused by name."""
    check_layer(layer)
    from ..weights.gguf_source import GGUFSource

    src = open_weights(path)
    try:
        if isinstance(src, GGUFSource) != (kind == "gguf"):
            other = "gguf" if isinstance(src, GGUFSource) else "safetensors"
            raise WeightError(f"{path}: holds {'GGUF' if other == 'gguf' else other} weights; "
                              f"use MoEKernel.from_{other}")
        return read_layer_experts(src, layer)
    finally:
        src.close()  # GGUF bytes stay mapped while the arrays referencing them live
