"""CPU kernels for routed MoE experts and dense linear layers (the C++ extension
``ktransformers.cpuinfer_ext``, wrapped with argument checking).

This is the library face another engine calls (no rule engine, no transformers): the names in
``__all__`` are versioned by ``API_VERSION``; docs/kernels.md holds the compatibility promise and
an engine's walk-through.

The C++ core only sees raw pointers, shapes and ggml type ids; this module turns numpy arrays
and torch CPU tensors into those, keeps them alive while asynchronous work is in flight, and
raises ``ValueError`` / ``TypeError`` naming the offending argument.

Quick use::

    from ktransformers import kernels as K
    pool = K.cpu_infer(2)                                   # process-wide pool, 2 threads
    moe = K.MoEKernel(pool, "llamafile", num_experts=128, hidden=2048, intermediate=768,
                      gate=gate_raw, up=up_raw, down=down_raw,   # uint8 GGUF bytes (zero copy)
                      gate_type="Q4_K", up_type="Q4_K", down_type="Q6_K")
    y = moe.forward(x, topk_ids, topk_weights)              # blocking
    moe.submit(x, topk_ids, topk_weights, out); ...; pool.sync()   # asynchronous

API
---
``isa_tier() -> str``
    ISA tier in force: ``scalar | avx2 | avxvnni | avx512 | avx512vnni | avx512bf16 | amx`` (best the CPU
    supports, AVX-512 before AVX-VNNI; the environment variable ``KT_ISA`` picks another supported
    one, ``cpuinfer_ext.supported_isa_tiers()`` lists them; an invalid value raises ``ValueError``).
    Logged once (logger ``ktransformers.kernels``) when the first pool is created.

``cpu_infer(threads=None, numa_node=None) -> CPUInfer``
    Shared pool per thread count (default: ``os.cpu_count()``) and NUMA node.  ``CPUInfer(threads,
    numa_node=None, cpus=None)`` makes a private one; ``numa_node`` (or an explicit ``cpus`` set)
    pins its threads to that node's CPUs (``numa_nodes()`` lists them from sysfs, ``node_cpus(n)``
    the ones this process may use) and the thread count defaults to theirs; ``pool.cpus`` is the
    set, None when unpinned.  The thread that computes takes part, so ``threads=n`` starts ``n-1``
    workers (+1 queue thread that only runs while a submitted task is in flight).  Idle workers block
    after a short spin (``KT_SPIN_US``, default 50).
    ``pool.sync()`` waits for submitted work (GIL released) and re-raises the first task error.

``MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type,
up_type, down_type, activation="silu", alpha=1.702, limit=7.0, gate_bias=None, up_bias=None, down_bias=None,
prepacked=None)``
    ``backend``: ``"llamafile"`` (weights used in place in their ggml type), ``"AMXInt8"``
    (requantised at load to int8, per-row scales, VNNI/AMX tile layout), ``"AMXBF16"``
    (repacked to bf16), ``"AMXInt4"`` / ``"AMXInt4_1"`` (requantised to int4 per 32-k group,
    fp16 scale / scale + min, two weights per byte), ``"llamafile_panels"`` (Q4_K copied into
    16-row panels of its own integers on the VNNI-512 tiers, llamafile's bits; other weights in
    place); ``cpuinfer_ext.packed_rows()`` names the kernel of each packed backend.  The int4 backends have no ``MoETrainKernel``.  ``gate``/``up`` hold ``[E, I, H]`` and ``down`` ``[E, H, I]`` in the
    stacked GGUF layout: either raw bytes (numpy/torch ``uint8``, any shape, exactly
    ``E*rows*row_bytes(type, cols)`` bytes, C-contiguous) or, for F32/F16/BF16, float tensors of
    that shape.  Types: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL
    IQ4_XS MXFP4 IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S (name, ``gguf.GGMLQuantizationType``
    or id).  Row lengths must be multiples of the type's block (32, or 256 for K-quants, IQ4_XS and
    the IQ1/IQ2/IQ3 types), else ``ValueError`` naming the projection and
    shape.  ``activation``: ``"silu"`` | ``"gelu_tanh"`` | ``"clamp_swiglu"`` (gpt-oss:
    ``(clamp(up,±limit)+1) * g*sigmoid(alpha*g)``, ``g = min(gate, limit)``) | ``"clamp_silu"``
    (DeepSeek-V4: ``silu(min(gate, limit)) * clamp(up,±limit)``).  Optional per-expert
    fp32 biases (gpt-oss) ``gate_bias``/``up_bias [E, I]`` (added before the activation) and
    ``down_bias [E, H]`` (added before the routing weight); kept alive like the weights.
    llamafile weights are referenced, not copied: the wrapper keeps the arrays alive.
    ``prepacked``: a packed backend's copy saved from ``.packed_view()`` (checked by size).

``MoEKernel.from_gguf(path, layer, backend="llamafile", pool=None, activation="silu", ...)``
    One layer's experts from a GGUF file or folder of shards: the stacked
    ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors through the project's GGUF reader
    (``weights/gguf_source.py``), read in place.  ``MoEKernel.from_safetensors(path, layer, ...)``:
    the same from a Hugging Face checkpoint (per-expert ``model.layers.N.mlp.experts.E.{gate,up,
    down}_proj.weight``, Mixtral's ``w1/w3/w2``, the fused ``experts.gate_up_proj``), floats as
    stored.  Per-expert biases found beside them are loaded.  A file or layer without experts, or
    experts of inconsistent shapes, raise ``WeightError`` naming the file, layer and tensors
    (``kernels/layer_weights.py``).

    ``.forward(x, ids, weights, out=None, out_dtype=None) -> out`` (blocking)
    ``.submit(x, ids, weights, out)`` (returns at once; call ``pool.sync()`` before reading out)
        ``x [T, H]`` float32 or bfloat16 (torch) / float32 (numpy); ``ids [T, k]`` int64 (int32
        is converted), ``-1`` skips a slot; ``weights [T, k]`` float32; ``out [T, H]`` float32 or
        bfloat16, default dtype of x.  Expert ids >= num_experts raise ``IndexError``.

``MoETrainKernel(moe)``
    Training path on a ``MoEKernel``'s weights: forward with per-expert LoRA, backward to x,
    routing weights and the LoRA factors (``kernels/moe_train.py``).

``LinearKernel(pool, backend, in_features, out_features, weight, weight_type)``
    ``y[T, out] = x[T, in] @ W^T``, ``W [out, in]`` as for MoEKernel.  ``.forward(x, out=None,
    out_dtype=None)``, ``.submit(x, out)``.  Contiguous torch CPU tensors take a decode fast path
    (no validation beyond dtype/shape/contiguity checks; anything else falls back to the checked
    path, which raises the errors).

``LinearGroupKernel(members, glu=None)``
    Linears sharing one input in one call (q/k/v; gate/up with ``glu="silu"|"gelu_tanh"`` gives
    act(gate) * up): the input is quantised once per activation format.  ``.forward(x, out)``,
    fp32 contiguous CPU tensors.

``flash_attention(pool, q, k, v, start, scale, window=0, out=None, bf16_pv=False)``
    Causal prompt attention (fp32 scores, softmax and sums, no score matrix; ``bf16_pv`` rounds the
    probability x value product to bf16 pairs on AVX512-BF16 tiers) where
    ``flash_attention_supported()`` (AVX2 + FMA and up): ``q [1, H, T, D]``, ``k``/``v [1, Hkv, S,
    D]`` fp32 -> ``[1, T, H, D]`` (``kernels/attention.py``).  ``flash_attention_paged(pool, q, keys,
    values, table, page_size, start, scale, ...)``: the same over a page pool ``[slots, Hkv, D]``
    and a sequence's block table, the same bits.

``mla_attention(pool, q_nope, q_pe, latent, rope_key, w_uk, w_uv_t, start, scale, ...)``
    Multi-head latent attention (DeepSeek-V2/V3, Kimi) in latent space where
    ``mla_attention_supported(kv_lora_rank, rope)``: ``q_nope [T, H, nope]``, ``q_pe [T, H, R]``,
    the latent ``[S, C]`` and rope keys ``[S, R]`` (or a page pool and a block table), ``W_UK [H,
    nope, C]``, ``W_UV^T [H, C, v]`` -> ``[T, H, v]``; a row's bits are the same read as a prompt
    row, in any chunk, or as a decode row.

``row_bytes(type, cols)``, ``type_info(type)``, ``dequantize(raw, type, n)`` (ggml reference
values, used by tests), ``activation_format(type)`` (what the tier's kernel rounds activations to).
"""

from __future__ import annotations

from ..weights.ggml_types import KERNEL_TYPES

#: version of the public API below (the names in ``__all__``): MAJOR.MINOR.PATCH, with the
#: compatibility promise of docs/kernels.md
API_VERSION = "1.2.0"

from .args import ggml_type
from .attention import (flash_attention, flash_attention_paged, flash_attention_supported, mla_attention,
                        mla_attention_supported)
from .linear import LinearGroupKernel, LinearKernel
from .moe import ACTIVATIONS, BACKENDS, MoEKernel
from .moe_train import LoraFactors, MoETrainKernel
from .numa import node_cpus, numa_nodes, parse_cpulist
from .pool import CPUInfer, cpu_infer, isa_tier
from .types import activation_format, dequantize, row_bytes, type_info

#: the weight types the kernels compute on: name -> id
TYPES = {name: t.id for name, t in KERNEL_TYPES.items()}

__all__ = ["API_VERSION", "isa_tier", "cpu_infer", "CPUInfer", "MoEKernel", "LinearKernel", "LinearGroupKernel",
           "row_bytes", "type_info", "dequantize", "ggml_type", "BACKENDS", "ACTIVATIONS", "TYPES", "MoETrainKernel", "LoraFactors",
           "activation_format", "flash_attention", "flash_attention_paged", "flash_attention_supported",
           "mla_attention", "mla_attention_supported",
           "numa_nodes", "node_cpus", "parse_cpulist"]
