"""Routed experts of one MoE layer on the CPU kernels (``MoEKernel``)."""

from __future__ import annotations

from typing import Any

from .. import cpuinfer_ext as _ext
from .args import _desc, _empty_like, _nbytes, _weight, ggml_type, moe_call_args, positive_ints, rows_of
from .pool import CPUInfer, cpu_infer

#: the MoE backends by name (their C++ ids): ``llamafile`` reads the weights in place in their stored
#: type, each of the others packs a copy at load (``PACKED_BACKENDS``).  ``llamafile_panels`` copies
#: Q4_K weights into 16-row panels of their own integers (llamafile's bits, no per-call unpack in
#: prefill; VNNI-512 tiers) and reads every other type, or every weight on other tiers, in place.
BACKENDS = {"llamafile": 0, "AMXInt8": 1, "AMXBF16": 2, "AMXInt4": 3, "AMXInt4_1": 4, "llamafile_panels": 5}
IN_PLACE_BACKEND = "llamafile"
PANELS_BACKEND = "llamafile_panels"
PACKED_BACKENDS = tuple(b for b in BACKENDS if b != IN_PLACE_BACKEND)
#: the packed backends of the AMX tile layouts (requantized copies)
AMX_LAYOUT_BACKENDS = ("AMXInt8", "AMXBF16", "AMXInt4", "AMXInt4_1")
#: the backends whose weights the LoRA forward / backward kernels (``moe_train.MoETrainKernel``) read;
#: the int4 ones have no such kernel
LORA_BACKENDS = (IN_PLACE_BACKEND, "AMXInt8", "AMXBF16")
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "clamp_swiglu": 2, "clamp_silu": 3}


def route_softmax_topk(logits, num_experts: int, top_k: int, norm: bool):
    """transformers' Qwen2/3-MoE router after its linear: softmax over the first ``num_experts``
    logits of each row of ``logits [T, >= num_experts]`` (fp32, contiguous rows), the ``top_k``
    largest in descending order, renormalised to sum 1 when ``norm`` -> (weights ``[T, top_k]`` fp32,
    ids ``[T, top_k]`` int64).  One C++ pass per row in a fixed order (``decode_ops.moe_route``): a
    token's routing has the same bits in a prompt of any length and in the decode step."""
    import torch

    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.stride(1) != 1 or logits.shape[1] < num_experts):
        raise ValueError(f"route_softmax_topk: need fp32 CPU logits [T, >= {num_experts}] with contiguous rows, "
                         f"got {logits.dtype} {tuple(logits.shape)}")
    T = int(logits.shape[0])
    ids = torch.empty(T, top_k, dtype=torch.int64)
    w = torch.empty(T, top_k, dtype=torch.float32)
    if T:
        _ext.decode_ops.moe_route(logits.data_ptr(), num_experts, top_k, bool(norm), ids.data_ptr(), w.data_ptr(),
                                  rows=T, stride=int(logits.stride(0)))
    return w, ids


def _backend(b: Any) -> int:
    if b not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {b!r}")
    return BACKENDS[b]


def _bias(b: Any, shape: tuple[int, int], name: str) -> int:
    """Pointer of an optional per-expert fp32 bias of ``shape`` (0: none)."""
    if b is None:
        return 0
    ptr, dt, shp = _desc(b, name)
    if dt != "float32" or tuple(shp) != shape:
        raise ValueError(f"{name}: expected float32 {list(shape)}, got {dt} {list(shp)}")
    return ptr


def packed_weight_bytes(backend: str, weight_type: Any, count: int, rows: int, cols: int) -> int:
    """Bytes of ``count`` stacked ``[rows, cols]`` matrices of ``weight_type`` once packed for
    ``backend`` (what ``MoEKernel.packed_bytes`` sums over gate / up / down); 0 for llamafile."""
    return int(_ext.packed_weight_bytes(_backend(backend), ggml_type(weight_type, "weight_type").id,
                                        int(count), int(rows), int(cols)))


def packs(backend: str, weight_type: Any) -> bool:
    """Whether ``backend`` holds a packed copy of a weight of ``weight_type`` on the tier in force,
    as the kernels decide it (``llamafile_panels``: Q4_K on the VNNI-512 tiers; every other weight,
    and ``llamafile``, read in place)."""
    if backend == IN_PLACE_BACKEND:
        return False
    try:
        return packed_weight_bytes(backend, weight_type, 1, 16, 256) > 0
    except ValueError:  # a type the backend cannot take: the load says so, with the tensor's name
        return False


class MoEKernel:
    """Routed experts of one MoE layer; see the module docstring."""

    def __init__(self, pool: CPUInfer, backend: str, num_experts: int, hidden: int, intermediate: int,
                 gate: Any, up: Any, down: Any, gate_type: Any, up_type: Any, down_type: Any,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                 gate_bias: Any = None, up_bias: Any = None, down_bias: Any = None, prepacked: Any = None):
        if not isinstance(pool, CPUInfer):
            raise TypeError(f"pool: expected ktransformers.kernels.CPUInfer, got {type(pool).__name__}")
        positive_ints(num_experts=num_experts, hidden=hidden, intermediate=intermediate)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        E, H, I = int(num_experts), int(hidden), int(intermediate)
        self.pool, self.backend = pool, backend
        self.num_experts, self.hidden, self.intermediate = E, H, I
        gt, ut, dt = ggml_type(gate_type, "gate_type"), ggml_type(up_type, "up_type"), ggml_type(down_type, "down_type")
        self.types = (gt.name, ut.name, dt.name)
        pg = _weight(gate, gt, (E, I, H), "gate")
        pu = _weight(up, ut, (E, I, H), "up")
        pd = _weight(down, dt, (E, H, I), "down")
        biases = (_bias(gate_bias, (E, I), "gate_bias"), _bias(up_bias, (E, I), "up_bias"),
                  _bias(down_bias, (E, H), "down_bias"))
        pre = 0
        if prepacked is not None:
            if backend == IN_PLACE_BACKEND:
                raise ValueError("prepacked: the llamafile backend reads the weights in place; nothing is packed")
            pre, pdt, _ = _desc(prepacked, "prepacked")
            if pdt != "uint8":
                raise ValueError(f"prepacked: expected a uint8 buffer, got {pdt}")
        self._m = _ext.MoE(pool._c, E, H, I, _backend(backend), pg, pu, pd, gt.id, ut.id, dt.id,
                           ACTIVATIONS[activation], float(alpha), float(limit), *biases, pre)
        if prepacked is not None and _nbytes(prepacked) != self._m.packed_bytes:
            n = _nbytes(prepacked)
            self._m = None
            raise ValueError(f"prepacked: {n} bytes, this layer's {backend} copy takes a different size")
        # zero-copy: the kernel reads these in place (llamafile weights; biases on every backend); the
        # packed backends hold their own requantized copy (or read `prepacked`), so the source weights can go
        keep = (gate, up, down) if backend in (IN_PLACE_BACKEND, PANELS_BACKEND) else ()
        self._weights = (*keep, gate_bias, up_bias, down_bias, prepacked)

    @classmethod
    def from_gguf(cls, path: Any, layer: int, backend: str = "llamafile", pool: CPUInfer | None = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> "MoEKernel":
        """Layer ``layer``'s routed experts from a GGUF file (or a folder of split shards): the stacked
        ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors, read in place by the llamafile backend.
        ``pool`` defaults to ``cpu_infer()``."""
        return cls._from_file(path, layer, "gguf", backend, pool, activation, alpha, limit)

    @classmethod
    def from_safetensors(cls, path: Any, layer: int, backend: str = "llamafile", pool: CPUInfer | None = None,
                         activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> "MoEKernel":
        """Layer ``layer``'s routed experts from a Hugging Face safetensors file or folder (per-expert
        ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, Mixtral's ``w1/w3/w2``, or the
        stacked / fused ``experts.gate_up_proj``), in their stored float type."""
        return cls._from_file(path, layer, "safetensors", backend, pool, activation, alpha, limit)

    @classmethod
    def _from_file(cls, path, layer, kind, backend, pool, activation, alpha, limit) -> "MoEKernel":
        from .layer_weights import open_layer_experts

        _backend(backend)  # the caller's arguments first, before reading a file
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        if pool is not None and not isinstance(pool, CPUInfer):
            raise TypeError(f"pool: expected ktransformers.kernels.CPUInfer, got {type(pool).__name__}")
        lx = open_layer_experts(path, layer, kind)
        w, t, b = lx.weights, lx.types, lx.biases
        try:
            return cls(pool or cpu_infer(), backend, lx.num_experts, lx.hidden, lx.intermediate,
                       w["gate_proj"], w["up_proj"], w["down_proj"], t["gate_proj"], t["up_proj"], t["down_proj"],
                       activation=activation, alpha=alpha, limit=limit, gate_bias=b.get("gate_proj"),
                       up_bias=b.get("up_proj"), down_bias=b.get("down_proj"))
        except (ValueError, TypeError) as e:
            from ..errors import WeightError

            raise WeightError(f"{lx.path}: layer {layer}: the {backend} CPU kernel cannot take these "
                              f"experts: {e}") from None

    def submit(self, x: Any, ids: Any, weights: Any, out: Any) -> None:
        """Queue the layer; returns at once.  Read ``out`` only after ``pool.sync()``."""
        args, keep = moe_call_args(x, ids, weights, out, self.hidden)
        self.pool._keep.append(keep)
        self._m.submit(self.pool._c, *args)

    def forward(self, x: Any, ids: Any, weights: Any, out: Any = None, out_dtype: str | None = None) -> Any:
        """Blocking forward; returns ``out`` (allocated like x unless given)."""
        if out is None:
            out = _empty_like(x, (rows_of(x), self.hidden), out_dtype)
        args, _ = moe_call_args(x, ids, weights, out, self.hidden)
        self._m.forward(self.pool._c, *args)
        return out

    @property
    def packed_bytes(self) -> int:
        return self._m.packed_bytes

    def packed_view(self):
        """The packed copy (what ``prepacked`` takes) as a read-only uint8 numpy view, valid while
        this kernel lives; None for llamafile."""
        import ctypes

        import numpy as np

        n, ptr = self._m.packed_bytes, self._m.packed_ptr
        if not n or not ptr:
            return None
        a = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))
        a.flags.writeable = False
        return a

