"""GGUF files written in the tests with gguf-py (not the project's writer): the header keys of a
text model, closing a file, a copy of a file with its metadata or tensors changed, and random IQ
blocks with a chosen fp16 scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def add_text_model_keys(w, cfg) -> None:
    """The size keys llama.cpp's converter writes first for a text model, from a transformers config."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def finish(w, path=None):
    """Header, metadata and tensors written and the file closed; returns ``path``."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_gguf(src, dst, *, keys=None, tensor=None, add=None, **writer_kw) -> Path:
    """``src`` written again to ``dst``: every metadata key in its stored type (``keys``: new values
    by name, ``general.architecture``'s included; a name the file lacks is appended as u32), every tensor as stored (``tensor(name, data,
    ggml type)`` -> (data, type), or None to leave it out), then ``add`` (name -> array);
    ``writer_kw`` go to the writer (e.g. ``split_max_tensors``)."""
    import gguf

    r = gguf.GGUFReader(src)
    keys = dict(keys or {})
    arch = keys.pop("general.architecture", r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch=arch, **writer_kw)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, keys.pop(k, f.contents()), f.types[0], sub_type=sub)
    for k, v in keys.items():
        w.add_uint32(k, v)
    for t in r.tensors:
        item = (np.array(t.data), t.tensor_type)
        if tensor is not None:
            item = tensor(t.name, *item)
        if item is not None:
            w.add_tensor(t.name, item[0], raw_dtype=item[1])
    for name, data in (add or {}).items():
        w.add_tensor(name, data)
    return finish(w, Path(dst))


def iq_blocks_with_scales(name: str, n_blocks: int, rng: np.random.Generator, scales) -> np.ndarray:
    """``n_blocks`` blocks of ggml type ``name`` (an IQ type): random index / sign / scale bits drawn
    from ``rng``, then the blocks' fp16 scales ``scales(rng, n_blocks)`` put where the type keeps
    them (IQ1_M: the top nibbles of its four uint16 scale words; the others: the first two bytes)."""
    from ktransformers.weights.ggml_types import ggml_type_info

    b = rng.integers(0, 256, size=(n_blocks, ggml_type_info(name).block_bytes), dtype=np.uint8)
    d = np.asarray(scales(rng, n_blocks)).astype(np.float16)
    if name == "IQ1_M":
        bits = d.view(np.uint16).astype(np.uint32)
        sc = b[:, 48:56].copy().view(np.uint16).astype(np.uint32) & 0x0FFF
        for j in range(4):
            sc[:, j] |= ((bits >> (4 * j)) & 0xF) << 12
        b[:, 48:56] = sc.astype(np.uint16).view(np.uint8).reshape(n_blocks, 8)
    else:
        b[:, 0:2] = d.view(np.uint8).reshape(n_blocks, 2)
    return b
