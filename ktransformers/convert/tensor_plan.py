"""The GGUF tensors a model becomes: llama.cpp's names, shapes and order, each with its type (from
the policy) and a producer that reads, transforms and quantizes it from the checkpoint when the
writer asks."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import ConfigError
from ..weights import gguf_names as gn
from ..weights.ggml_types import ggml_type_info
from ..weights.quantize import quantize
from .checkpoint import Checkpoint
from .policy import TypePolicy


@dataclass
class PlannedTensor:
    """One GGUF tensor to write; the writer calls ``produce`` when its turn comes near."""

    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: str
    produce: Callable[[], np.ndarray]  # -> flat uint8 bytes

    @property
    def nbytes(self) -> int:
        return ggml_type_info(self.ggml_type).nbytes(self.shape)


def _model_params(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the transformers model of ``config`` (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def _mtp_params(config, ckpt: Checkpoint, arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """The MTP layer's (name, shape) list where the checkpoint has one and the architecture's name
    table maps it (``model.layers.{n}.*``, n = ``num_hidden_layers``: a decoder layer as the model's
    own, and its own tensors as llama.cpp writes them: ``blk.{n}.nextn.*``); else none.  Its copies
    of the embedding and output head are left out (the drafter reads the model's)."""
    if arch not in gn.NEXTN_ARCHS:
        return []
    from ..generation.mtp import MTP_TENSORS, has_own_indexer, mtp_config

    n, H = int(config.num_hidden_layers), int(config.hidden_size)
    p = f"model.layers.{n}."
    if not ckpt.has(p + MTP_TENSORS[0]):
        return []
    own = {"eh_proj.weight": (H, 2 * H)}
    return [(k, s) for k, s in _model_params(mtp_config(config, has_own_indexer(ckpt.keys, n))) if k.startswith(p)] + [
        (p + t, own.get(t, (H,))) for t in MTP_TENSORS]


def arch_of(config) -> str:
    mt = config.model_type
    if mt == "gemma3":
        config = config.get_text_config()
        mt = config.model_type
    arch = gn.MODEL_TYPE_TO_ARCH.get(mt)
    if mt in gn.NOT_WRITTEN:
        raise ConfigError(f"cannot convert model_type '{mt}': {gn.NOT_WRITTEN[mt]}")
    if arch is None:
        raise ConfigError(f"cannot convert model_type '{mt}' (supported: {', '.join(sorted(gn.MODEL_TYPE_TO_ARCH))})")
    return arch


def plan(config, ckpt: Checkpoint, policy: TypePolicy, params=None) -> tuple[str, list[PlannedTensor]]:
    """The GGUF tensors to write for ``config``, each with a producer that reads the checkpoint.

    ``params``: the model's (name, shape) list; default: from the transformers model itself."""
    text_cfg = config.get_text_config() if config.model_type == "gemma3" else config
    arch = arch_of(config)
    nmap = gn.name_map(arch)
    if params is None:
        params = _model_params(text_cfg) + _mtp_params(text_cfg, ckpt, arch)
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False))
    outs: list[PlannedTensor] = []
    n_head = text_cfg.num_attention_heads
    n_kv = getattr(text_cfg, "num_key_value_heads", n_head)

    def ck_name(hf: str) -> str:
        if ckpt.has(hf):
            return hf
        if arch == "gemma3" and ckpt.has(hf.replace("model.", "model.language_model.", 1)):
            return hf.replace("model.", "model.language_model.", 1)
        return hf

    v_orders = gn.v_head_orders(text_cfg.linear_num_key_heads, text_cfg.linear_key_head_dim,
                                text_cfg.linear_num_value_heads, text_cfg.linear_value_head_dim) \
        if arch == "qwen35moe" else {}

    def read(src: str, hf: str):
        """The checkpoint's tensor, its V heads in llama.cpp's order (qwen35moe)."""
        w = ckpt.get(src)
        order = v_orders.get(hf.split(".", 3)[-1])
        return w if order is None else w.index_select(order[0], order[1].argsort())

    def add(gname: str, shape, fn):
        shape = tuple(int(s) for s in shape)
        t = policy.choose(gname, shape)
        outs.append(PlannedTensor(gname, shape, t, lambda fn=fn, t=t: quantize(fn(), t)))

    for hf, shape in params:
        if hf == "lm_head.weight" and tied:
            continue
        base, leaf = hf.rsplit(".", 1)
        if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            E = shape[0]
            projs = [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps")] if leaf == "gate_up_proj" else [
                ("down_proj", "ffn_down_exps")]
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            n_inter = shape[1] // 2 if leaf == "gate_up_proj" else shape[2]
            for proj, g in projs:
                eshape = (shape[1] // 2, shape[2]) if leaf == "gate_up_proj" else (shape[1], shape[2])
                gname = f"blk.{layer}.{g}.weight"
                t = policy.choose(gname, (E, *eshape))
                outs.append(PlannedTensor(gname, (E, *eshape), t, _expert_producer(ckpt, ck_name(base), proj, E, n_inter, t)))
            continue
        if arch in gn.MLA_ARCHS and hf.endswith("self_attn.kv_b_proj.weight"):
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            nope, v = text_cfg.qk_nope_head_dim, text_cfg.v_head_dim
            r = shape[1]
            src = ck_name(hf)
            add(f"blk.{layer}.attn_k_b.weight", (n_head, r, nope),
                lambda src=src: gn.split_kv_b(ckpt.get(src), n_head, nope, v)[0])
            add(f"blk.{layer}.attn_v_b.weight", (n_head, v, r),
                lambda src=src: gn.split_kv_b(ckpt.get(src), n_head, nope, v)[1])
            continue
        if arch == "qwen3next" and hf.endswith("linear_attn.in_proj_qkvz.weight"):
            layer = re.match(r"model\.layers\.(\d+)\.", hf).group(1)
            dims = (text_cfg.linear_num_key_heads, text_cfg.linear_key_head_dim,
                    text_cfg.linear_num_value_heads, text_cfg.linear_value_head_dim)
            n_qkv = gn.qwen3next_linear_dims(*dims)[2]
            src = ck_name(hf)
            add(f"blk.{layer}.attn_qkv.weight", (n_qkv, shape[1]),
                lambda src=src: gn.split_qkvz(ckpt.get(src), *dims)[0])
            add(f"blk.{layer}.attn_gate.weight", (shape[0] - n_qkv, shape[1]),
                lambda src=src: gn.split_qkvz(ckpt.get(src), *dims)[1])
            continue
        gname = nmap.hf_to_gguf(hf)
        if gname is None:
            raise ConfigError(f"{ckpt.path}: no GGUF name for parameter '{hf}' of a {arch} model")
        if arch == "deepseek4" and gname.endswith(".ffn_gate_tid2eid.weight"):  # the hash router's table: I32
            src = ck_name(hf)
            outs.append(PlannedTensor(gname, tuple(shape), "I32", lambda src=src: np.ascontiguousarray(
                np.asarray(ckpt.get(src)), dtype=np.int32).reshape(-1).view(np.uint8)))
            continue
        src = ck_name(hf)
        if arch == "llama" and re.search(r"\.attn_(q|k)\.(weight|bias)$", gname):
            kv = n_head if ".attn_q." in gname else n_kv
            add(gname, shape, lambda src=src, kv=kv: gn.permute_qk(ckpt.get(src), n_head, kv))
        elif gn.has_norm_offset(arch, gname):
            add(gname, shape, lambda src=src: ckpt.get(src) + 1.0)
        elif arch in gn.LINEAR_ATTN_ARCHS and gname.endswith(".ssm_a"):
            add(gname, shape, lambda src=src, hf=hf: -read(src, hf).exp())  # llama.cpp stores A = -exp(A_log)
        elif arch in gn.LINEAR_ATTN_ARCHS and gname.endswith(".ssm_conv1d.weight"):
            add(gname, (shape[0], shape[2]), lambda src=src, hf=hf, s=shape: read(src, hf).reshape(s[0], s[2]))
        else:
            add(gname, shape, lambda src=src, hf=hf: read(src, hf))
    outs.sort(key=lambda o: _file_order(o.name))
    return arch, outs


def _file_order(gguf_name: str) -> tuple:
    """Tensors in the file: token_embd, then layer by layer (names sorted within a layer), then the rest —
    the same order whichever way the model's tensors were listed."""
    m = re.match(r"blk\.(\d+)\.", gguf_name)
    if m:
        return (1, int(m.group(1)), gguf_name)
    return (0 if gguf_name.startswith("token_embd") else 2, 0, gguf_name)


def _expert_producer(ckpt: Checkpoint, base: str, proj: str, E: int, n_inter: int, t: str):
    def produce() -> np.ndarray:
        out = None
        for e in range(E):
            q = quantize(ckpt.expert(base, proj, e, n_inter), t)
            if out is None:
                out = np.empty(E * q.size, dtype=np.uint8)
            out[e * q.size:(e + 1) * q.size] = q
        return out

    return produce
