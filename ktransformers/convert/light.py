"""The light path: planning a folder without importing torch or transformers (which folders: see
:data:`LIGHT_MODEL_TYPES`); the file is the same either way."""

from __future__ import annotations

import re
from pathlib import Path

from ..weights import gguf_names as gn
from .checkpoint import Checkpoint, LightUnsupported
from .metadata import metadata_for
from .policy import PresetPolicy
from .tensor_plan import arch_of, plan


#: model types converted without importing torch or transformers (start-up in well under a second
#: instead of seconds): config.json read as written, the model's tensors listed from the safetensors
#: headers and checked against the layer structure below; anything else goes through transformers
LIGHT_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
#: config fields that are no attribute of these config classes (or whose absence means what the
#: converter assumes): a missing one reads as absent; any other missing field ends the light path
_ABSENT_MEANS_DEFAULT = ("head_dim", "num_experts", "num_local_experts", "n_routed_experts", "scoring_func",
                         "tie_word_embeddings", "_name_or_path", "attention_bias", "mlp_bias", "mlp_only_layers",
                         "decoder_sparse_step")
#: config attribute aliases of these classes (transformers' ``attribute_map``)
_CONFIG_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


class _ConfigView:
    """config.json as attributes, the way the converter reads a transformers config."""

    def __init__(self, raw: dict):
        self._raw = dict(raw)
        rp = raw.get("rope_parameters")
        if rp is None:
            if raw.get("rope_scaling") or "rope_theta" not in raw:
                raise LightUnsupported("rope parameters need transformers' standardization")
            rp = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
        self._raw["rope_parameters"] = rp

    def __getattr__(self, name: str):
        raw = self.__dict__["_raw"]
        if name in raw:
            return raw[name]
        if _CONFIG_ALIASES.get(name) in raw:
            return raw[_CONFIG_ALIASES[name]]
        if name in _ABSENT_MEANS_DEFAULT or name.startswith("__"):  # (dunders: copy/pickle protocol probes)
            raise AttributeError(name)
        raise LightUnsupported(f"config.json has no '{name}'")

    def get_text_config(self):
        return self


def _light_roles(cfg, arch: str, layer: int) -> set[str]:
    """The tensors layer ``layer`` must have (GGUF names after ``blk.N.``, ``.weight`` dropped)."""
    roles = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"}
    if arch in ("qwen2", "qwen2moe") or getattr(cfg, "attention_bias", False):
        roles |= {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
    if getattr(cfg, "attention_bias", False) and arch == "llama":
        roles.add("attn_output.bias")
    if arch in ("qwen3", "qwen3moe"):
        roles |= {"attn_q_norm", "attn_k_norm"}
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe = n_exp > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or []) and (layer + 1) % step == 0
    if moe:
        roles |= {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
        if arch == "qwen2moe":
            roles |= {"ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"}
    else:
        roles |= {"ffn_gate", "ffn_up", "ffn_down"}
        if getattr(cfg, "mlp_bias", False):
            raise LightUnsupported("MLP biases")
    return roles


def _checkpoint_params(cfg, ckpt: Checkpoint, arch: str) -> list[tuple[str, tuple[int, ...]]]:
    """The model's (name, shape) list read from the checkpoint's own keys (canonical transformers 5
    names, per-expert matrices stacked as the model stacks them), checked for completeness."""
    nmap = gn.name_map(arch)
    files = ckpt.files
    params: list[tuple[str, tuple[int, ...]]] = []
    experts: dict[str, dict[str, dict[int, tuple[int, ...]]]] = {}
    roles: dict[int, set[str]] = {}
    n_layer = cfg.num_hidden_layers
    per_expert = re.compile(r"(model\.layers\.(\d+)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
    for key in sorted(ckpt.keys):
        name = key.replace(".block_sparse_moe.", ".mlp.")
        m = per_expert.match(name)
        if m:
            proj = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}.get(m.group(4), m.group(4))
            experts.setdefault(m.group(1), {}).setdefault(proj, {})[int(m.group(3))] = files.shape(key)
            continue
        params.append((name, files.shape(key)))
    for base, projs in experts.items():
        shapes = [projs.get(p, {}) for p in ("gate_proj", "up_proj", "down_proj")]
        E = len(shapes[0])
        if any(sorted(sh) != list(range(E)) for sh in shapes) or len({sh[e] for sh in shapes[:2] for e in sh}) != 1:
            raise LightUnsupported(f"{base}: incomplete or uneven experts")
        (I, H), down = shapes[0][0], set(shapes[2].values())
        if down != {(H, I)}:
            raise LightUnsupported(f"{base}: down_proj shapes {down}")
        params += [(f"{base}.gate_up_proj", (E, 2 * I, H)), (f"{base}.down_proj", (E, H, I))]
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    top = set()
    for name, _ in params:
        base, leaf = name.rsplit(".", 1)
        if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
            g = ["ffn_gate_exps", "ffn_up_exps"] if leaf == "gate_up_proj" else ["ffn_down_exps"]
        else:
            gname = nmap.hf_to_gguf(name) if not (tied and name == "lm_head.weight") else "output.weight"
            if gname is None:
                raise LightUnsupported(f"no GGUF name for '{name}'")
            if not gname.startswith("blk."):
                top.add(gname)
                continue
            g = [gname.split(".", 2)[2].removesuffix(".weight")]
        layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
        roles.setdefault(layer, set()).update(g)
    if set(roles) != set(range(n_layer)):
        raise LightUnsupported(f"layers {sorted(roles)[:3]}... of {n_layer}")
    for layer, have in roles.items():
        if have != _light_roles(cfg, arch, layer):
            raise LightUnsupported(f"layer {layer} holds {sorted(have)}")
    if not {"token_embd.weight", "output_norm.weight"} <= top or (not tied and "output.weight" not in top):
        raise LightUnsupported(f"top-level tensors {sorted(top)}")
    return params


def plan_light(mp: Path, raw_cfg: dict, preset: str | None, policy):
    """(config, policy, arch, outs, metadata) planned without transformers, or None where the light
    path cannot vouch for the folder (then transformers plans it)."""
    try:
        cfg = _ConfigView(raw_cfg)
        arch = arch_of(cfg)
        ckpt = Checkpoint(mp, light=True)
        params = _checkpoint_params(cfg, ckpt, arch)
        if preset:
            policy = PresetPolicy.for_config(preset, cfg, arch)
        arch, outs = plan(cfg, ckpt, policy, params=params)
        md = metadata_for(cfg, arch, [o.name for o in outs])
    except LightUnsupported:
        return None
    return cfg, policy, arch, outs, md
