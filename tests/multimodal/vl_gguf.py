"""The tiny Qwen3-VL-MoE as llama.cpp writes it: a language-model GGUF (``qwen3vlmoe``) and an
``mmproj`` GGUF (``clip``, projector ``qwen3vl_merger``), with gguf-py, following llama.cpp's
converter (``conversion/qwen3vl.py``: ``Qwen3VLMoeTextModel``, ``Qwen3VLVisionModel``;
``conversion/base.py``: ``MmprojModel``) rather than this project's reader.

The language model is written from the save_pretrained layout (experts ``[E, 2I, H]``): llama.cpp's
text converter expects the release's transposed one, so its own output is not used for it here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gguf_files import add_text_model_keys, finish

_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


def _add(w, name: str, t: torch.Tensor, qtype: str = "f32") -> None:
    import gguf

    a = t.detach().float().numpy()
    if qtype == "f16" and a.ndim > 1:
        w.add_tensor(name, a.astype(np.float16))
    elif qtype == "q8_0" and a.ndim > 1 and a.shape[-1] % 32 == 0:
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(name, a.astype(np.float32))


def add_vocab_and_ends(w, folder, vocab_size: int, pre: str, sd: dict) -> str:
    """The folder's tokenizer as llama.cpp writes it (``pre``: its pre-tokenizer name; the vocabulary
    padded to ``vocab_size``) and the language model's embedding, final norm and head; returns the
    language model's prefix in ``sd``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_chat_template(tok.chat_template)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t in tokens])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    L = "model.language_model."
    _add(w, "token_embd.weight", sd[L + "embed_tokens.weight"])
    _add(w, "output_norm.weight", sd[L + "norm.weight"])
    _add(w, "output.weight", sd["lm_head.weight"])
    return L


def write_lm_gguf(folder: Path, out: Path, n_deepstack: int | None = None, arch: str = "qwen3vlmoe") -> Path:
    """The language model as llama.cpp's ``Qwen3VLMoeTextModel`` writes it (F32, with the vocabulary and
    chat template: every byte a token, no merges, as the tiny tokenizer has it);
    ``arch="qwen3moe"``: the same tensors as a text-only Qwen3-MoE file."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    tc = cfg.text_config
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update(load_file(f))
    A = arch
    w = gguf.GGUFWriter(str(out), arch=A)
    w.add_name("tiny-qwen3-vl-moe")
    add_text_model_keys(w, tc)
    w.add_key_length(tc.head_dim)
    w.add_value_length(tc.head_dim)
    w.add_rope_freq_base(tc.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(tc.rms_norm_eps)
    w.add_expert_count(tc.num_experts)
    w.add_expert_used_count(tc.num_experts_per_tok)
    w.add_expert_feed_forward_length(tc.moe_intermediate_size)
    if A == "qwen3vlmoe":
        w.add_rope_dimension_sections((list(tc.rope_parameters["mrope_section"]) + [0] * 4)[:4])
        n_ds = len(cfg.vision_config.deepstack_visual_indexes) if n_deepstack is None else n_deepstack
        w.add_uint32(f"{A}.n_deepstack_layers", n_ds)
    L = add_vocab_and_ends(w, folder, tc.vocab_size, "qwen2", sd)
    for i in range(tc.num_hidden_layers):
        p = f"{L}layers.{i}."
        for hf, g in _BLOCK.items():
            _add(w, f"blk.{i}.{g}.weight", sd[f"{p}{hf}.weight"])
        gu = sd[f"{p}mlp.experts.gate_up_proj"]  # [E, 2I, H]
        inter = gu.shape[1] // 2
        _add(w, f"blk.{i}.ffn_gate_exps.weight", gu[:, :inter])
        _add(w, f"blk.{i}.ffn_up_exps.weight", gu[:, inter:])
        _add(w, f"blk.{i}.ffn_down_exps.weight", sd[f"{p}mlp.experts.down_proj"])
    return finish(w, out)


def write_mmproj(folder: Path, out: Path, qtype: str = "f32", meta: dict | None = None,
                 drop: tuple[str, ...] = (), split_qkv: bool = False) -> Path:
    """The vision tower as llama.cpp's ``Qwen3VLVisionModel`` writes it (``qtype`` f32 / f16 / q8_0 for
    the matrices; the patch embedding F16 or F32 as the converter forces it, the position embedding and
    vectors F32).  ``meta``
    replaces (None: removes) metadata keys, ``drop`` leaves tensors out; ``split_qkv`` writes
    ``attn_q`` / ``attn_k`` / ``attn_v`` instead of ``attn_qkv``."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    vc = cfg.vision_config
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update({k: v for k, v in load_file(f).items() if k.startswith("model.visual.")})
    keys: dict = {
        "clip.has_vision_encoder": ("bool", True),
        "clip.projector_type": ("str", "qwen3vl_merger"),
        "clip.vision.projection_dim": ("u32", cfg.text_config.hidden_size),
        "clip.vision.image_size": ("u32", int(vc.num_position_embeddings ** 0.5 * vc.patch_size)),
        "clip.vision.patch_size": ("u32", vc.patch_size),
        "clip.vision.embedding_length": ("u32", vc.hidden_size),
        "clip.vision.feed_forward_length": ("u32", vc.intermediate_size),
        "clip.vision.block_count": ("u32", vc.depth),
        "clip.vision.attention.head_count": ("u32", vc.num_heads),
        "clip.vision.image_mean": ("f32arr", [0.5, 0.5, 0.5]),
        "clip.vision.image_std": ("f32arr", [0.5, 0.5, 0.5]),
        "clip.use_gelu": ("bool", True),
        "clip.vision.spatial_merge_size": ("u32", vc.spatial_merge_size),
        "clip.vision.attention.layer_norm_epsilon": ("f32", cfg.text_config.rms_norm_eps),
        "clip.vision.is_deepstack_layers": ("boolarr", [i in vc.deepstack_visual_indexes for i in range(vc.depth)]),
        # the tiny processor's bounds (tiny_models.make_tiny_processor), which the release's files lack
        "clip.vision.image_min_pixels": ("u32", 32 * 32),
        "clip.vision.image_max_pixels": ("u32", 128 * 128),
    }
    w = mmproj_writer(out, keys, meta, qtype)
    V = "model.visual."
    tensors: list[tuple[str, torch.Tensor, str]] = []
    pe = sd[V + "patch_embed.proj.weight"]  # [C, 3, 2, p, p]: split along time, as the converter does
    pe_type = "f16" if qtype == "f16" else "f32"
    tensors += [("v.patch_embd.weight", pe[:, :, 0], pe_type), ("v.patch_embd.weight.1", pe[:, :, 1], pe_type),
                ("v.patch_embd.bias", sd[V + "patch_embed.proj.bias"], "f32"),
                ("v.position_embd.weight", sd[V + "pos_embed.weight"], "f32")]  # kept F32, as llama.cpp's
    leaves = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.linear_fc1": "ffn_up",
              "mlp.linear_fc2": "ffn_down"}
    for n in range(vc.depth):
        for s in ("weight", "bias"):
            qkv = sd[f"{V}blocks.{n}.attn.qkv.{s}"]
            if split_qkv:
                for x, part in zip("qkv", qkv.chunk(3, dim=0)):
                    tensors.append((f"v.blk.{n}.attn_{x}.{s}", part, qtype))
            else:
                tensors.append((f"v.blk.{n}.attn_qkv.{s}", qkv, qtype))
            for hf, g in leaves.items():
                tensors.append((f"v.blk.{n}.{g}.{s}", sd[f"{V}blocks.{n}.{hf}.{s}"], qtype))
    for s in ("weight", "bias"):
        tensors += [("v.post_ln." + s, sd[V + "merger.norm." + s], qtype),
                    ("mm.0." + s, sd[V + "merger.linear_fc1." + s], qtype),
                    ("mm.2." + s, sd[V + "merger.linear_fc2." + s], qtype)]
        for k, layer in enumerate(vc.deepstack_visual_indexes):
            for hf, g in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
                tensors.append((f"v.deepstack.{layer}.{g}.{s}", sd[f"{V}deepstack_merger_list.{k}.{hf}.{s}"], qtype))
    for name, t, q in tensors:
        if name not in drop:
            _add(w, name, t, q)
    return finish(w, out)


def mmproj_writer(out, keys: dict, meta: dict | None, qtype: str):
    """A gguf-py writer of an mmproj file at ``out`` with its header keys written: ``keys`` (name ->
    (kind, value); kinds str / bool / u32 / f32 / f32arr / boolarr, else a GGUFValueType) updated by
    ``meta`` (a value None drops the key), the file type of ``qtype`` (f32 / f16 / q8_0)."""
    import gguf

    keys = dict(keys)
    for k, v in (meta or {}).items():
        if v is None:
            keys.pop(k, None)
        else:
            keys[k] = v
    w = gguf.GGUFWriter(str(out), arch="clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    for k, (kind, v) in keys.items():
        if kind == "str":
            w.add_string(k, v)
        elif kind == "bool":
            w.add_bool(k, v)
        elif kind == "u32":
            w.add_uint32(k, v)
        elif kind == "f32":
            w.add_float32(k, v)
        elif kind == "f32arr":
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        elif kind == "boolarr":
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
        else:
            w.add_key_value(k, v, kind)
    return w
