"""GGUF files checked before anything is built from them.

A GGUF header is a list of numbers someone else wrote; the model is sized from it.  So before a
config, a tokenizer or a single tensor is allocated, :func:`check_gguf` holds the header against
the file and against itself, the way llama.cpp's loader does:

* layout: ``general.alignment`` a power of two; every tensor's data offset aligned and exactly
  where the previous tensor's data ends (so a tensor retyped to another ggml type, or a wrong
  offset, is caught); rows a whole number of blocks; the data inside the file;
* metadata against the tensors present: ``block_count`` equals the layers that have tensors,
  head counts positive and dividing each other, ``embedding_length`` equals the embedding's
  width, expert counts matching the stacked expert tensors;
* numbers in range: positive finite epsilons, rope bases and factors; sizes below limits no
  real model comes near (an absurd value is an error, not an allocation); a sliding window of at
  least one token (0 reaches transformers' cache as a shape mismatch on the first step);
* special token ids (``tokenizer.ggml.bos_token_id`` and the rest of gguf-py's ``*_ID`` keys)
  inside the vocabulary: an id past it would index the embedding out of range or stop nothing.

:func:`scan_tensors` (``--check_tensors``, llama.cpp's flag) reads every tensor once and names
the first one holding NaN or Inf.  :func:`compile_chat_template` compiles a chat template as
transformers renders it, so a broken one stops start-up instead of failing every request.

Each error is one :class:`WeightError` line naming the file and the key or tensor.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from ..errors import ConfigError, WeightError
from .ggml_types import ggml_type_info

MAX_LAYERS = 4096
MAX_HEADS = 16384
MAX_WIDTH = 1 << 20  # embedding / feed-forward / head sizes
MAX_CONTEXT = 1 << 26
MAX_EXPERTS = 65536
MAX_ALIGNMENT = 1 << 20
_LAYER = re.compile(r"^blk\.(\d+)\.")


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def check_layout(path, reader) -> None:
    """Alignment, offsets, sizes of one file's tensors (gguf-py ``GGUFReader``)."""
    align = int(reader.alignment)
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise WeightError(f"{path}: general.alignment {align} is not a power of two up to {MAX_ALIGNMENT}")
    size = len(reader.data)
    if reader.data_offset % align:
        raise WeightError(f"{path}: tensor data starts at byte {reader.data_offset}, not a multiple of the "
                          f"alignment {align}")
    expected = 0
    for t in reader.tensors:
        try:
            info = ggml_type_info(int(t.tensor_type))
        except KeyError:
            raise WeightError(f"{path}: tensor '{t.name}' has unknown ggml type id {int(t.tensor_type)}") from None
        dims = [int(d) for d in t.shape.tolist()]  # ggml order: row length first
        if not dims or len(dims) > 4 or any(d <= 0 for d in dims):
            raise WeightError(f"{path}: tensor '{t.name}' has dimensions {dims} (1 to 4 positive sizes expected)")
        if dims[0] % info.block_elems:
            raise WeightError(f"{path}: tensor '{t.name}' has rows of {dims[0]} elements, not a whole number of "
                              f"{info.name} blocks ({info.block_elems})")
        nbytes = info.nbytes(tuple(reversed(dims)))
        rel = int(t.data_offset) - int(reader.data_offset)
        if rel % align:
            raise WeightError(f"{path}: tensor '{t.name}' data offset {rel} is not a multiple of the alignment "
                              f"{align}")
        if rel != expected:
            raise WeightError(f"{path}: tensor '{t.name}' data starts at offset {rel} but the tensors before it "
                              f"end at {expected} (a wrong offset, type or shape in the header)")
        end = int(reader.data_offset) + rel + nbytes
        if end > size:
            raise WeightError(f"{path}: tensor '{t.name}' ({info.name} {list(reversed(dims))}) runs past the end of "
                              f"the file ({end} > {size} bytes: truncated?)")
        expected = _align_up(rel + nbytes, align)


class _Keys:
    """Typed access to ``<arch>.*`` metadata, each failure naming the key."""

    def __init__(self, meta, arch: str, where: str):
        self.meta, self.arch, self.where = meta, arch, where

    def fail(self, key: str, msg: str) -> WeightError:
        return WeightError(f"{self.where}: metadata '{self.arch}.{key}' {msg}")

    def raw(self, key: str):
        return self.meta.get(f"{self.arch}.{key}")

    def ints(self, key: str, lo: int, hi: int, required: bool = False) -> list[int] | None:
        """The value (or per-layer list) as ints within [lo, hi]."""
        v = self.raw(key)
        if v is None:
            if required:
                raise self.fail(key, "is missing")
            return None
        vals = v if isinstance(v, list) else [v]
        if not vals:
            raise self.fail(key, "is an empty list")
        for x in vals:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise self.fail(key, f"must be an integer, not {x!r}")
            if not (lo <= int(x) <= hi):
                raise self.fail(key, f"is {int(x)}; expected {lo}..{hi}")
        return [int(x) for x in vals]

    def positive_float(self, key: str, hi: float) -> float | None:
        v = self.raw(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise self.fail(key, f"must be a number, not {v!r}")
        if not (math.isfinite(float(v)) and 0 < float(v) <= hi):
            raise self.fail(key, f"is {float(v)}; expected a finite number in (0, {hi:g}]")
        return float(v)


def check_metadata(where: str, meta, arch: str, tensors: dict[str, tuple[int, ...]]) -> None:
    """The ``<arch>.*`` keys against themselves and the tensors (name -> torch-order shape).

    An architecture this project has no name table for is refused later, by name; here it only
    gets the checks that need no model keys."""
    from .gguf_names import LINEAR_ATTN_ARCHS, name_map

    _check_special_tokens(where, meta, arch, tensors)
    try:
        name_map(arch)
    except KeyError:
        _check_finite(where, meta)
        return
    k = _Keys(meta, arch, where)
    layers = {int(m.group(1)) for n in tensors if (m := _LAYER.match(n))}
    (n_layers,) = k.ints("block_count", 1, MAX_LAYERS, required=True)
    extra = (k.ints("nextn_predict_layers", 0, MAX_LAYERS) or [0])[0]  # MTP layers may be stripped
    if extra >= n_layers:
        raise k.fail("nextn_predict_layers", f"is {extra} of {n_layers} blocks: no decoder layer is left")
    if layers:
        top = max(layers)
        missing = sorted(set(range(top + 1)) - layers)
        if missing:
            raise WeightError(f"{where}: layer {missing[0]} has no tensors (blk.{missing[0]}.*) but layer {top} has")
        if not (n_layers - extra <= top + 1 <= n_layers):
            raise k.fail("block_count", f"is {n_layers}, but the file holds tensors of {top + 1} layers")
    heads = k.ints("attention.head_count", 0, MAX_HEADS, required=True)
    kv_heads = k.ints("attention.head_count_kv", 0, MAX_HEADS) or heads
    if max(heads) == 0:
        raise k.fail("attention.head_count", "is 0: the model has no attention heads")
    for key, vals in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if len(vals) > 1 and len(vals) != n_layers:
            raise k.fail(key, f"has {len(vals)} per-layer values for {n_layers} layers")
    per_layer = max(len(heads), len(kv_heads)) > 1
    hs = heads * n_layers if len(heads) == 1 else heads
    ks = kv_heads * n_layers if len(kv_heads) == 1 else kv_heads
    for i, (h, kv) in enumerate(zip(hs, ks)):
        if h and (kv == 0 or h % kv):
            raise k.fail("attention.head_count_kv", f"is {kv}" + (f" at layer {i}" if per_layer else "")
                         + f"; it must divide head_count {h}")
    (width,) = k.ints("embedding_length", 1, MAX_WIDTH, required=True)
    emb = tensors.get("token_embd.weight")
    if emb is not None and emb[-1] != width:
        raise k.fail("embedding_length", f"is {width}, but token_embd.weight is {list(emb)}")
    for key in ("feed_forward_length", "expert_feed_forward_length", "expert_shared_feed_forward_length",
                "attention.key_length", "attention.value_length", "rope.dimension_count",
                "attention.kv_lora_rank", "attention.q_lora_rank",
                "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
                "rope.dimension_sections"):
        k.ints(key, 0, MAX_WIDTH)
    k.ints("attention.sliding_window", 1, MAX_WIDTH)  # a window holds at least the token itself
    key_len = (k.ints("attention.key_length", 1, MAX_WIDTH) or [None])[0]
    val_len = (k.ints("attention.value_length", 1, MAX_WIDTH) or [None])[0]
    if key_len is None and width % max(heads):
        raise k.fail("attention.head_count", f"is {max(heads)}, which does not divide embedding_length {width} "
                                             "(and there is no attention.key_length)")
    head_dim = key_len or width // max(heads)
    rope_dim = (k.ints("rope.dimension_count", 0, MAX_WIDTH) or [None])[0]
    if rope_dim is not None and (rope_dim % 2 or rope_dim > head_dim):
        raise k.fail("rope.dimension_count", f"is {rope_dim}; rotary dimensions are even and at most the head "
                                             f"size {head_dim}")
    if rope_dim is None and head_dim % 2:
        raise k.fail("attention.key_length" if key_len else "embedding_length",
                     f"gives heads of {head_dim}; rotary embeddings need an even head size")
    # the projections' widths follow from the head counts and sizes (plain attention; MLA differs)
    if len(heads) == 1 and len(kv_heads) == 1 and not k.raw("attention.kv_lora_rank"):
        # gated attention: attn_q holds each head's query and its output gate
        q_rows = 2 * head_dim if arch in LINEAR_ATTN_ARCHS else head_dim
        for proj, n, size in (("attn_q", heads[0], q_rows), ("attn_k", kv_heads[0], head_dim),
                              ("attn_v", kv_heads[0], val_len or head_dim)):
            for name, shape in tensors.items():
                if name.endswith(f".{proj}.weight") and shape[0] != n * size:
                    raise WeightError(f"{where}: tensor '{name}' has {shape[0]} rows, but the metadata says "
                                      f"{n} heads of {size} ({arch}.attention.head_count"
                                      f"{'' if proj == 'attn_q' else '_kv'} / key_length / value_length)")
    _check_mla_and_shared(k, tensors, rope_dim or 0)
    k.ints("context_length", 1, MAX_CONTEXT)
    n_exp = (k.ints("expert_count", 0, MAX_EXPERTS) or [0])[0]
    used = (k.ints("expert_used_count", 0, MAX_EXPERTS) or [0])[0]
    if used > n_exp:
        raise k.fail("expert_used_count", f"is {used}, more than expert_count {n_exp}")
    for name, shape in tensors.items():
        if re.match(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$", name) and shape[0] != n_exp:
            raise k.fail("expert_count", f"is {n_exp}, but {name} stacks {shape[0]} experts")
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        k.positive_float(key, 1.0)
    for key in ("rope.freq_base", "rope.freq_base_swa"):
        k.positive_float(key, 1e12)
    for key in ("rope.scaling.factor", "rope.scaling.yarn_log_multiplier", "expert_weights_scale",
                "attention.scale", "final_logit_softcapping", "attn_logit_softcapping"):
        v = k.raw(key)
        if v is not None and not isinstance(v, (str, list)) and not math.isfinite(float(v)):
            raise k.fail(key, f"is {v}; expected a finite number")
    _check_finite(where, meta)


def _special_token_keys() -> list[str]:
    """gguf-py's special token id keys (``tokenizer.ggml.bos_token_id``, ``eot``, ``fim_*``, ...)."""
    from gguf.constants import Keys

    return [v for k, v in vars(Keys.Tokenizer).items() if k.endswith("_ID") and isinstance(v, str)]


def _vocab_sizes(meta, arch: str, tensors: dict[str, tuple[int, ...]]) -> list[tuple[int, str]]:
    """(size, what says so) of every table a token id indexes: the tokenizer's tokens, the embedding
    rows, ``<arch>.vocab_size``."""
    sizes = []
    if "tokenizer.ggml.tokens" in meta:
        n = meta.array_len("tokenizer.ggml.tokens") if hasattr(meta, "array_len") else len(meta["tokenizer.ggml.tokens"])
        sizes.append((n, "tokenizer.ggml.tokens"))
    emb = tensors.get("token_embd.weight")
    if emb is not None and len(emb) == 2:
        sizes.append((int(emb[0]), "token_embd.weight rows"))
    v = meta.get(f"{arch}.vocab_size")
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        sizes.append((int(v), f"{arch}.vocab_size"))
    return sizes


def _check_special_tokens(where: str, meta, arch: str, tensors: dict[str, tuple[int, ...]]) -> None:
    """Every special token id an integer inside every vocabulary table the file has."""
    sizes = _vocab_sizes(meta, arch, tensors)
    for key in _special_token_keys():
        v = meta.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise WeightError(f"{where}: metadata '{key}' must be a token id (an integer), not {v!r}")
        for n, what in sizes:
            if not 0 <= int(v) < n:
                raise WeightError(f"{where}: metadata '{key}' is {int(v)}, outside the vocabulary of {n} tokens "
                                  f"({what}); expected 0..{n - 1}")


def _check_finite(where: str, meta) -> None:
    items = meta.scalar_items() if hasattr(meta, "scalar_items") else meta.items()  # arrays stay undecoded
    for key, v in items:  # a NaN / Inf float is never meant
        if isinstance(v, float) and not math.isfinite(v):
            raise WeightError(f"{where}: metadata '{key}' is {v}; expected a finite number")


def _check_mla_and_shared(k: _Keys, tensors: dict[str, tuple[int, ...]], rope_dim: int) -> None:
    """DeepSeek's split MLA projections and shared experts against their metadata sizes."""
    key_mla = (k.ints("attention.key_length_mla", 1, MAX_WIDTH) or [None])[0]
    val_mla = (k.ints("attention.value_length_mla", 1, MAX_WIDTH) or [None])[0]
    shared = (k.ints("expert_shared_count", 0, MAX_EXPERTS) or [None])[0]
    ff = (k.ints("expert_shared_feed_forward_length", 1, MAX_WIDTH) or k.ints("expert_feed_forward_length", 1,
                                                                               MAX_WIDTH) or [None])[0]
    for name, shape in tensors.items():
        if key_mla is not None and name.endswith(".attn_k_b.weight") and len(shape) == 3 \
                and shape[2] + rope_dim != key_mla:
            raise k.fail("attention.key_length_mla", f"is {key_mla}, but {name} {list(shape)} with "
                                                     f"rope.dimension_count {rope_dim} gives {shape[2] + rope_dim}")
        if val_mla is not None and name.endswith(".attn_v_b.weight") and len(shape) == 3 and shape[1] != val_mla:
            raise k.fail("attention.value_length_mla", f"is {val_mla}, but {name} is {list(shape)}")
        if shared is not None and ff is not None and re.search(r"\.ffn_(gate|up)_shexp\.weight$", name) \
                and shape[0] != shared * ff:
            raise k.fail("expert_shared_count", f"is {shared} (of {ff} each), but {name} is {list(shape)}")


def check_gguf(source) -> None:
    """All header checks for a :class:`~.gguf_source.GGUFSource` (its readers are mapped, nothing
    else is built yet)."""
    for path, reader in zip(source.files, source._readers):
        check_layout(path, reader)
    shapes = {n: t.shape for n, t in source._tensors.items()}
    check_metadata(str(source.files[0]), source.metadata, source.arch, shapes)


# ---- data -------------------------------------------------------------------------------------

def preflight(source, tokenizer, where: str, check_tensors: bool = False, log=None) -> None:
    """What local_chat and the server check once the weights and tokenizer are open, before the
    model is built: the chat template compiles; with ``check_tensors`` no tensor holds NaN/Inf."""
    compile_chat_template(getattr(tokenizer, "chat_template", None), where)
    if check_tensors:
        n = scan_tensors(source)
        if log is not None:
            log(f"--check_tensors: {n} tensors, no NaN or Inf")


def scan_tensors(source, chunk_rows: int = 4096, progress=None) -> int:
    """Read every tensor of ``source`` once; WeightError naming the first NaN/Inf.  Returns the
    number of tensors scanned.  Float types are checked as stored; quantized ones dequantized in
    chunks of rows (the scales and values a kernel would see); other sources tensor by tensor."""
    import torch

    from .dequant import block_dequantizer

    if not hasattr(source, "_tensors"):  # safetensors and other sources: as the model will see them
        for i, name in enumerate(source.names()):
            t = source.tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise WeightError(f"{getattr(source, 'path', '?')}: tensor '{name}' holds NaN or Inf; "
                                  "the file is corrupt")
            if hasattr(source, "release"):
                source.release(name)
        return len(source.names())
    n = 0
    for name, t in source._tensors.items():
        info = t.type
        where = f"{t.file}: tensor '{name}' ({info.name} {list(t.shape)})"
        if info.name in ("I8", "I16", "I32", "I64"):
            n += 1
            continue
        if info.name in ("F32", "F16", "F64"):
            vals = t.data.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[info.name])
            bad = ~np.isfinite(vals)
            idx = int(np.argmax(bad)) if bad.any() else -1
        elif info.name == "BF16":
            bits = t.data.view(np.uint16)
            bad = (bits & 0x7F80) == 0x7F80  # exponent all ones: Inf or NaN
            idx = int(np.argmax(bad)) if bad.any() else -1
        else:
            try:
                dq = block_dequantizer(info)
            except ValueError:  # UnsupportedTypeError: a type this project cannot expand is refused when loaded
                n += 1
                continue
            blocks = torch.from_numpy(t.data).view(-1, info.block_bytes)
            idx, step = -1, max(1, chunk_rows * max(1, t.shape[-1] // info.block_elems))
            for start in range(0, blocks.shape[0], step):
                vals = dq(blocks[start:start + step])
                bad = ~torch.isfinite(vals)
                if bool(bad.any()):
                    idx = start * info.block_elems + int(torch.nonzero(bad.reshape(-1))[0])
                    break
        if idx >= 0:
            row, col = divmod(idx, t.shape[-1])
            raise WeightError(f"{where} holds NaN or Inf (first at row {row}, column {col}); the file is corrupt")
        n += 1
        if progress is not None:
            progress(name)
    return n


# ---- chat templates ---------------------------------------------------------------------------

def compile_chat_template(template: Any, where: str) -> None:
    """ConfigError (one line, with the template's line) when ``template`` does not compile the
    way transformers compiles chat templates."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    templates = template.values() if isinstance(template, dict) else [template]
    for t in templates:
        if t is None:
            continue
        if not isinstance(t, str):
            raise ConfigError(f"{where}: the chat template is {type(t).__name__}, not text")
        try:
            _compile_jinja_template(t)
        except TemplateError as e:
            line = getattr(e, "lineno", None)
            msg = str(getattr(e, "message", None) or e).splitlines()[0]
            raise ConfigError(f"{where}: the chat template does not compile"
                              + (f" (template line {line})" if line else "") + f": {msg}") from None
