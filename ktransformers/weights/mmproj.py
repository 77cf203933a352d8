"""llama.cpp ``mmproj`` GGUFs: the vision tower of Qwen3-VL-MoE or GLM-4.5V / GLM-4.6V beside its
language-model GGUF.

llama.cpp's converter writes a vision-language model as two files: the language model
(``general.architecture`` ``qwen3vlmoe``, the ``qwen3moe`` tensors) and, with ``--mmproj``, the
vision tower (``general.architecture`` ``clip``, ``clip.projector_type`` ``qwen3vl_merger``).
:class:`GGUFWithMmproj` reads the two as one source of transformers'
``Qwen3VLMoeForConditionalGeneration``: the language model's names under
``model.language_model.*`` (``lm_head`` as it is), the vision tower's under ``model.visual.*``,
and a ``Qwen3VLMoeConfig`` built from both files' metadata.

What the converter (``conversion/qwen3vl.py``, ``Qwen3VLVisionModel``) does, undone here:

=======================================================  =================================================
transformers (``model.visual.``)                          mmproj GGUF
=======================================================  =================================================
``patch_embed.proj.weight`` ``[C, 3, 2, p, p]``           ``v.patch_embd.weight`` + ``v.patch_embd.weight.1``
                                                          (the 3D conv split along time: ``[:, :, 0]``,
                                                          ``[:, :, 1]``; stacked back on dim 2)
``patch_embed.proj.bias``                                 ``v.patch_embd.bias``
``pos_embed.weight``                                      ``v.position_embd.weight``
``blocks.N.norm1`` / ``norm2``                            ``v.blk.N.ln1`` / ``ln2``
``blocks.N.attn.qkv`` / ``attn.proj``                     ``v.blk.N.attn_qkv`` / ``attn_out`` (or split
                                                          ``attn_q`` / ``attn_k`` / ``attn_v``, concatenated)
``blocks.N.mlp.linear_fc1`` / ``linear_fc2``              ``v.blk.N.ffn_up`` / ``ffn_down``
``merger.norm``                                           ``v.post_ln``
``merger.linear_fc1`` / ``linear_fc2``                    ``mm.0`` / ``mm.2``
``deepstack_merger_list.K.{norm,linear_fc1,linear_fc2}``  ``v.deepstack.L.{norm,fc1,fc2}`` (``L`` the vision
                                                          block the K-th DeepStack merger reads)
=======================================================  =================================================

Metadata read (``clip.vision.*``): ``embedding_length``, ``feed_forward_length``, ``block_count``,
``attention.head_count``, ``patch_size``, ``image_size`` (with the patch size: the learned position
grid, checked against ``v.position_embd``), ``projection_dim`` (the language model's width, checked
against its ``embedding_length``), ``spatial_merge_size``, ``is_deepstack_layers`` (checked against the
language model's ``n_deepstack_layers``), ``image_mean`` / ``image_std`` and, when present,
``image_min_pixels`` / ``image_max_pixels`` (the image processor; otherwise the Qwen3-VL release's
bounds).  Tensors of any type the project dequantizes (mmproj files hold F32, F16, BF16, Q8_0).

GLM-4.5V / GLM-4.6V (``glm4v_moe``): llama.cpp writes the language model as GLM-4.5-Air's
``glm4moe`` (with ``glm4moe.rope.dimension_sections``, the M-RoPE sections, which a text-only file
lacks) and the tower with ``clip.projector_type`` ``glm4v`` (``conversion/qwen3vl.py``,
``Glm4VVisionModel``; names from ``gguf-py/gguf/tensor_mapping.py``; graph ``tools/mtmd/models/glm4v.cpp``),
read as ``Glm4vMoeForConditionalGeneration``:

=======================================================  =================================================
transformers (``model.visual.``)                          mmproj GGUF
=======================================================  =================================================
``patch_embed.proj.weight`` / ``.bias``                   ``v.patch_embd.weight`` + ``.weight.1`` / ``.bias``
                                                          (split along time, as Qwen3-VL's)
``post_conv_layernorm``                                   ``v.norm_embd``
``embeddings.position_embedding``                         ``v.position_embd``
``blocks.N.norm1`` / ``norm2``                            ``v.blk.N.ln1`` / ``ln2``
``blocks.N.attn.qkv`` / ``attn.proj``                     ``v.blk.N.attn_qkv`` / ``attn_out``
``blocks.N.mlp.gate_proj`` / ``up_proj`` / ``down_proj``  ``v.blk.N.ffn_gate`` / ``ffn_up`` / ``ffn_down``
``post_layernorm``                                        ``v.post_ln``
``downsample``                                            ``mm.patch_merger``
``merger.proj`` / ``merger.post_projection_norm``         ``mm.model.fc`` / ``mm.post_norm``
``merger.gate_proj`` / ``up_proj`` / ``down_proj``        ``mm.gate`` / ``mm.up`` / ``mm.down``
=======================================================  =================================================

Metadata read: as Qwen3-VL's (no DeepStack; ``spatial_merge_size`` 2 where absent, as llama.cpp's
``clip.cpp``), ``feed_forward_length`` the merger's width, ``attention.layer_norm_epsilon`` the
RMSNorms' epsilon, ``use_silu`` / ``use_gelu`` the MLPs' activation; the qkv bias where the file holds
it; the pixel bounds where stored, else transformers' ``Glm4vImageProcessor`` defaults.

ERNIE-4.5-VL has no mmproj format in llama.cpp (no projector type, no converter): ``--mmproj`` with an
ERNIE model is refused in one line (:data:`NO_MMPROJ`); it loads from its safetensors folder.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import WeightError
from .gguf_source import GGUFSource, _Entry, _Plain

#: ``general.architecture`` of llama.cpp's multimodal projector files
MMPROJ_ARCH = "clip"
#: projector types this module reads, and the language-model architecture each pairs with
PROJECTORS = {"qwen3vl_merger": "qwen3vlmoe", "glm4v": "glm4moe"}
#: the family each projector type is, for messages
FAMILIES = {"qwen3vl_merger": "Qwen3-VL's", "glm4v": "GLM-4.5V / GLM-4.6V's"}
#: image-text families llama.cpp has no mmproj format for: their language models' GGUF
#: architectures and transformers model types (``--mmproj`` with one is refused in one line)
NO_MMPROJ = {"ernie4_5-moe": "ERNIE-4.5-VL", "ernie4_5": "ERNIE-4.5-VL", "ernie4_5_vl_moe": "ERNIE-4.5-VL-MoE"}
#: language-model GGUF architectures that take a vision tower from an mmproj file
VL_ARCHS = tuple(PROJECTORS.values())
#: the image processor's pixel bounds of the Qwen3-VL releases (``preprocessor_config.json``), used
#: where the mmproj file does not store ``clip.vision.image_min_pixels`` / ``image_max_pixels``
QWEN3VL_MIN_PIXELS = 65536
QWEN3VL_MAX_PIXELS = 16777216
#: the image tokens of the Qwen3-VL tokenizer, looked up in the language model's vocabulary
IMAGE_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
#: GLM-4.5V's image tokens (its tokenizer's added tokens)
GLM4V_IMAGE_TOKENS = {"image_token_id": "<|image|>", "image_start_token_id": "<|begin_of_image|>",
                      "image_end_token_id": "<|end_of_image|>", "video_token_id": "<|video|>",
                      "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>"}

_MAX_WIDTH = 1 << 16
_MAX_BLOCKS = 1024
_MAX_PATCH = 1024


def _fail(where: str, key: str, msg: str) -> WeightError:
    return WeightError(f"{where}: mmproj metadata '{key}' {msg}")


def _int(meta: Mapping[str, Any], where: str, key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise WeightError(f"{where}: mmproj metadata lacks '{key}'")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not v.is_integer():
        raise _fail(where, key, f"must be an integer, not {v!r}")
    if not lo <= int(v) <= hi:
        raise _fail(where, key, f"is {int(v)}; expected {lo}..{hi}")
    return int(v)


def _floats(meta: Mapping[str, Any], where: str, key: str, n: int, positive: bool = False) -> list[float]:
    v = meta.get(key)
    if v is None:
        raise WeightError(f"{where}: mmproj metadata lacks '{key}'")
    if not isinstance(v, (list, tuple)) or len(v) != n or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise _fail(where, key, f"must be {n} numbers, not {v!r}")
    if not all(math.isfinite(float(x)) and (float(x) > 0 if positive else True) for x in v):
        raise _fail(where, key, f"is {list(v)}; expected finite{' positive' if positive else ''} numbers")
    return [float(x) for x in v]


def vision_metadata(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: str) -> dict:
    """The vision tower's sizes from an mmproj file's metadata and tensor shapes (torch order):
    ``vision_config`` (``Qwen3VLMoeVisionConfig`` keyword arguments), ``processor`` (the image
    processor's), ``projector`` (its type).  A file for another architecture, or keys that do not
    describe a tower the tensors hold, raise a one-line :class:`WeightError`."""
    arch = meta.get("general.architecture")
    if arch != MMPROJ_ARCH:
        raise WeightError(f"{where}: not an mmproj file (general.architecture is {arch!r}, an mmproj's is "
                          f"'{MMPROJ_ARCH}')")
    if meta.get("clip.has_vision_encoder") is not True:
        raise WeightError(f"{where}: this mmproj has no vision encoder (clip.has_vision_encoder is not true)")
    proj = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if proj not in PROJECTORS:
        raise WeightError(f"{where}: mmproj projector type {proj!r} is not read here (supported: "
                          f"{', '.join(f'{k}, {v}' for k, v in FAMILIES.items())})")
    V = "clip.vision."
    width = _int(meta, where, V + "embedding_length", 1, _MAX_WIDTH)
    heads = _int(meta, where, V + "attention.head_count", 1, _MAX_WIDTH)
    if width % heads or (width // heads) % 2:
        raise _fail(where, V + "attention.head_count", f"is {heads}; it must divide embedding_length {width} "
                                                       "into heads of an even size")
    depth = _int(meta, where, V + "block_count", 1, _MAX_BLOCKS)
    ffn = _int(meta, where, V + "feed_forward_length", 1, _MAX_WIDTH)
    patch = _int(meta, where, V + "patch_size", 1, _MAX_PATCH)
    image = _int(meta, where, V + "image_size", patch, 1 << 16)
    if image % patch:
        raise _fail(where, V + "image_size", f"is {image}; it is not a whole number of {patch}-pixel patches")
    merge = _int(meta, where, V + "spatial_merge_size", 1, 64, default=2)
    out = _int(meta, where, V + "projection_dim", 1, 1 << 20)
    glm = proj == "glm4v"
    flags = [] if glm else meta.get(V + "is_deepstack_layers", [])
    if not isinstance(flags, (list, tuple)) or len(flags) not in (0, depth) or not all(
            isinstance(f, bool) for f in flags):
        raise _fail(where, V + "is_deepstack_layers", f"must be {depth} booleans (one a block), not {flags!r}")
    deepstack = [i for i, f in enumerate(flags) if f]
    mean = _floats(meta, where, V + "image_mean", 3)
    std = _floats(meta, where, V + "image_std", 3, positive=True)
    if glm and V + "image_min_pixels" not in meta and V + "image_max_pixels" not in meta:
        lo = hi = None  # transformers' Glm4vImageProcessor defaults
    else:
        lo = _int(meta, where, V + "image_min_pixels", 1, 1 << 40, default=None if glm else QWEN3VL_MIN_PIXELS)
        hi = _int(meta, where, V + "image_max_pixels", lo, 1 << 40,
                  default=None if glm else max(QWEN3VL_MAX_PIXELS, lo))

    pe = shapes.get("v.patch_embd.weight")
    if pe is None:
        raise WeightError(f"{where}: mmproj tensor 'v.patch_embd.weight' is missing")
    if len(pe) != 4 or pe[0] != width or pe[2] != patch or pe[3] != patch:
        raise WeightError(f"{where}: mmproj tensor 'v.patch_embd.weight' is {list(pe)}; the metadata says "
                          f"[{width}, channels, {patch}, {patch}]")
    # llama.cpp's converter takes Qwen3-VL's two-frame patches only, and writes the second frame's
    # kernel beside the first
    temporal = 2
    if "v.patch_embd.weight.1" not in shapes:
        raise WeightError(f"{where}: mmproj tensor 'v.patch_embd.weight.1' (model.visual.patch_embed.proj.weight, "
                          "its second frame) is missing")
    if "v.patch_embd.bias" not in shapes:
        raise WeightError(f"{where}: mmproj tensor 'v.patch_embd.bias' is missing")
    pos = shapes.get("v.position_embd.weight")
    n_pos = (image // patch) ** 2
    if pos is None:
        raise WeightError(f"{where}: mmproj tensor 'v.position_embd.weight' is missing")
    if tuple(pos) != (n_pos, width):
        raise WeightError(f"{where}: mmproj tensor 'v.position_embd.weight' is {list(pos)}; image_size {image} "
                          f"and patch_size {patch} give [{n_pos}, {width}]")
    vision = dict(depth=depth, hidden_size=width, intermediate_size=ffn, num_heads=heads, in_channels=int(pe[1]),
                  patch_size=patch, spatial_merge_size=merge, temporal_patch_size=temporal, out_hidden_size=out)
    if glm:
        eps = meta.get(V + "attention.layer_norm_epsilon", 1e-5)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < float(eps) < 1:
            raise _fail(where, V + "attention.layer_norm_epsilon", f"is {eps!r}; expected a number in (0, 1)")
        # the converter writes use_silu for silu, use_gelu for gelu (transformers' Glm4vVisionConfig)
        act = "silu" if meta.get("clip.use_silu") is True else "gelu" if meta.get("clip.use_gelu") is True else None
        if act is None:
            raise WeightError(f"{where}: mmproj metadata sets neither 'clip.use_silu' nor 'clip.use_gelu' (the "
                              "vision MLPs' activation)")
        vision.update(image_size=image, rms_norm_eps=float(eps), hidden_act=act,
                      attention_bias="v.blk.0.attn_qkv.bias" in shapes)
    else:
        vision.update(num_position_embeddings=n_pos, deepstack_visual_indexes=deepstack)
        if meta.get("clip.use_gelu") is False and meta.get("clip.use_silu") is True:
            vision["hidden_act"] = "silu"
    processor = dict(patch_size=patch, merge_size=merge, temporal_patch_size=temporal, image_mean=mean,
                     image_std=std)
    if lo is not None:
        processor["size"] = {"shortest_edge": lo, "longest_edge": hi}
    return {"vision_config": vision, "processor": processor, "projector": proj}


def check_mergers(shapes: Mapping[str, tuple[int, ...]], vision: Mapping[str, Any], where: str,
                  projector: str = "qwen3vl_merger") -> None:
    """The patch merger's and the DeepStack mergers' matrices against the sizes the metadata gives."""
    width, merge, out = vision["hidden_size"], vision["spatial_merge_size"], vision["out_hidden_size"]
    if projector == "glm4v":
        ffn = vision["intermediate_size"]
        want = {"mm.patch_merger.weight": ((out, width, merge, merge), "projection_dim, embedding_length and "
                                           "spatial_merge_size"),
                "mm.model.fc.weight": ((out, out), "projection_dim"),
                "mm.up.weight": ((ffn, out), "feed_forward_length and projection_dim"),
                "mm.gate.weight": ((ffn, out), "feed_forward_length and projection_dim"),
                "mm.down.weight": ((out, ffn), "projection_dim and feed_forward_length")}
        for n in range(vision["depth"]):  # the blocks' MLPs are projection_dim wide (Glm4vVisionMlp)
            for g, shape in (("ffn_up", (out, width)), ("ffn_gate", (out, width)), ("ffn_down", (width, out))):
                want[f"v.blk.{n}.{g}.weight"] = (shape, "projection_dim and embedding_length")
        for name, (shape, keys) in want.items():
            if name in shapes and tuple(shapes[name]) != shape:
                raise WeightError(f"{where}: mmproj tensor '{name}' is {list(shapes[name])}; {keys} give "
                                  f"{list(shape)}")
        return
    merged = width * merge * merge  # the merger's input: merge x merge patches side by side
    for name, shape in shapes.items():
        if re.fullmatch(r"(mm\.0|v\.deepstack\.\d+\.fc1)\.weight", name) and tuple(shape)[1:] != (merged,):
            raise WeightError(f"{where}: mmproj tensor '{name}' is {list(shape)}; embedding_length {width} and "
                              f"spatial_merge_size {merge} give {merged} inputs")
        if re.fullmatch(r"(mm\.2|v\.deepstack\.\d+\.fc2)\.weight", name) and shape[0] != out:
            raise WeightError(f"{where}: mmproj tensor '{name}' is {list(shape)}; projection_dim is {out}")


def glm4v_vision_names(vision: Mapping[str, Any]) -> dict[str, list[str]]:
    """GLM-4.5V's tower: transformers name (below ``model.visual.``) -> the mmproj tensors."""
    names: dict[str, list[str]] = {
        "patch_embed.proj.weight": ["v.patch_embd.weight", "v.patch_embd.weight.1"],
        "patch_embed.proj.bias": ["v.patch_embd.bias"],
        "post_conv_layernorm.weight": ["v.norm_embd.weight"],
        "embeddings.position_embedding.weight": ["v.position_embd.weight"],
        "post_layernorm.weight": ["v.post_ln.weight"],
        "downsample.weight": ["mm.patch_merger.weight"],
        "downsample.bias": ["mm.patch_merger.bias"],
        "merger.proj.weight": ["mm.model.fc.weight"],
        "merger.post_projection_norm.weight": ["mm.post_norm.weight"],
        "merger.post_projection_norm.bias": ["mm.post_norm.bias"],
    }
    for hf in ("gate_proj", "up_proj", "down_proj"):
        names[f"merger.{hf}.weight"] = [f"mm.{hf.removesuffix('_proj')}.weight"]
    leaves = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for n in range(vision["depth"]):
        for hf, g in leaves.items():
            names[f"blocks.{n}.{hf}.weight"] = [f"v.blk.{n}.{g}.weight"]
        if vision.get("attention_bias"):
            names[f"blocks.{n}.attn.qkv.bias"] = [f"v.blk.{n}.attn_qkv.bias"]
    return names


def vision_names(vision: Mapping[str, Any], projector: str = "qwen3vl_merger") -> dict[str, list[str]]:
    """transformers name (below ``model.visual.``) -> the mmproj tensors it is read from."""
    if projector == "glm4v":
        return glm4v_vision_names(vision)
    names: dict[str, list[str]] = {
        "patch_embed.proj.weight": ["v.patch_embd.weight", "v.patch_embd.weight.1"],
        "patch_embed.proj.bias": ["v.patch_embd.bias"],
        "pos_embed.weight": ["v.position_embd.weight"],
    }
    leaves = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
              "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
    for n in range(vision["depth"]):
        for hf, g in leaves.items():
            for s in ("weight", "bias"):
                names[f"blocks.{n}.{hf}.{s}"] = [f"v.blk.{n}.{g}.{s}"]
    for hf, g in (("merger.norm", "v.post_ln"), ("merger.linear_fc1", "mm.0"), ("merger.linear_fc2", "mm.2")):
        for s in ("weight", "bias"):
            names[f"{hf}.{s}"] = [f"{g}.{s}"]
    for k, layer in enumerate(vision["deepstack_visual_indexes"]):
        for hf, g in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
            for s in ("weight", "bias"):
                names[f"deepstack_merger_list.{k}.{hf}.{s}"] = [f"v.deepstack.{layer}.{g}.{s}"]
    return names


class _PatchEmbed(_Entry):
    """The 3D patch convolution, from the 2D halves llama.cpp's converter split it into."""

    def load(self, src, dtype, device):
        ts = [src._tensors[p] for p in self.parts]
        halves = [src._deq(t, t.data, t.shape, dtype, device) for t in ts]
        for t in ts[1:]:
            if t.shape != ts[0].shape:
                raise WeightError(f"{t.file}: mmproj tensor '{t.name}' is {list(t.shape)}, "
                                  f"'{ts[0].name}' {list(ts[0].shape)}; the halves of one convolution")
        return torch.stack(halves, dim=2)


class _Concat(_Entry):
    """Rows of split tensors concatenated (``attn_q`` + ``attn_k`` + ``attn_v`` -> ``qkv``)."""

    def load(self, src, dtype, device):
        ts = [src._tensors[p] for p in self.parts]
        return torch.cat([src._deq(t, t.data, t.shape, dtype, device) for t in ts], dim=0)


def _token_ids(meta: Mapping[str, Any], wanted: Mapping[str, str] = IMAGE_TOKENS) -> dict[str, int]:
    """The image tokens' ids from the language model's vocabulary (transformers' defaults, the
    release's ids, where the file carries no vocabulary)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return {}
    index = {}
    want = set(wanted.values())
    for i, t in enumerate(tokens):
        if t in want and t not in index:
            index[t] = i
    return {k: index[t] for k, t in wanted.items() if t in index}


def _gguf_arch(path: Path) -> Any:
    """``general.architecture`` of a GGUF file (the first shard of a folder), or None."""
    from .gguf_source import field_value, open_reader

    first = path if path.is_file() else next(iter(sorted(path.glob("*.gguf"))), None)
    if first is None:
        return None
    f = open_reader(first).fields.get("general.architecture")
    return None if f is None else field_value(f)


def no_mmproj_format(family: str, where: str) -> WeightError:
    """The one-line refusal of ``--mmproj`` for a family llama.cpp has no mmproj format for."""
    return WeightError(f"{where}: llama.cpp has no mmproj format for {family} (no projector type, no converter); "
                       f"load {family} from its safetensors folder, without --mmproj")


class GGUFWithMmproj(GGUFSource):
    """A Qwen3-VL-MoE language-model GGUF and its mmproj GGUF, as one source of the image-text model.

    The language model's tensors keep what :class:`GGUFSource` makes of them, under
    ``model.language_model.*``; the mmproj's are served under ``model.visual.*``."""

    def __init__(self, path: str | os.PathLike, mmproj: str | os.PathLike):
        mp = Path(mmproj)
        arch = _gguf_arch(Path(path))
        if arch in NO_MMPROJ:
            raise no_mmproj_format(NO_MMPROJ[arch], f"--mmproj {mp} with {path} ('{arch}')")
        super().__init__(path)
        lm_where = str(self.files[0])
        sections = self.metadata.get(f"{self.arch}.rope.dimension_sections")
        if self.arch not in VL_ARCHS or self.arch == "glm4moe" and not sections:
            why = (" (no glm4moe.rope.dimension_sections: GLM-4.5-Air's, not GLM-4.5V's)"
                   if self.arch == "glm4moe" else "")
            raise WeightError(f"--mmproj {mp}: {lm_where} is a text-only '{self.arch}' model{why}; an mmproj "
                              f"pairs with a vision-language model's GGUF ({', '.join(VL_ARCHS)})")
        if not mp.is_file():
            raise WeightError(f"--mmproj {mp}: no such file")
        if mp.suffix != ".gguf":
            raise WeightError(f"--mmproj {mp}: not a .gguf file")
        mm = GGUFSource(mp)  # header checks; its tensors keep their GGUF names there
        self.mmproj_path = str(mp)
        mm_where = str(mm.files[0])
        shapes = {n: t.shape for n, t in mm._tensors.items()}
        info = vision_metadata(mm.metadata, shapes, mm_where)
        proj = info["projector"]
        if PROJECTORS[proj] != self.arch:
            raise WeightError(f"{mm_where}: a '{proj}' mmproj ({FAMILIES[proj]} vision tower) pairs with a "
                              f"'{PROJECTORS[proj]}' language model, not {lm_where} ('{self.arch}')")
        vision = info["vision_config"]
        width = int(self.metadata.get(f"{self.arch}.embedding_length") or 0)
        if vision["out_hidden_size"] != width:
            raise WeightError(f"{mm_where}: the vision tower projects to width {vision['out_hidden_size']} "
                              f"(clip.vision.projection_dim) but the language model {lm_where} is {width} wide; "
                              f"this mmproj belongs to another model")
        n_ds = self.metadata.get(f"{self.arch}.n_deepstack_layers")
        if n_ds is not None and int(n_ds) != len(vision["deepstack_visual_indexes"]):
            raise WeightError(f"{mm_where}: the vision tower has {len(vision['deepstack_visual_indexes'])} DeepStack "
                              f"layers (clip.vision.is_deepstack_layers) but the language model {lm_where} takes "
                              f"{int(n_ds)} ({self.arch}.n_deepstack_layers)")
        check_mergers(shapes, vision, mm_where, proj)
        self.vision_info = info
        for g, t in mm._tensors.items():
            if g in self._tensors:
                raise WeightError(f"{mm_where}: tensor '{g}' also appears in {lm_where}")
            self._tensors[g] = t
        self.files = self.files + mm.files
        self._readers = self._readers + mm._readers
        renamed = {}
        for hf, e in self._entries.items():
            renamed[hf.replace("model.", "model.language_model.", 1) if hf.startswith("model.") else hf] = e
        self._entries = renamed
        for leaf, parts in vision_names(vision, proj).items():
            hf = f"model.visual.{leaf}"
            blk = re.match(r"^v\.blk\.(\d+)\.attn_qkv\.(weight|bias)$", parts[0])
            if blk and parts[0] not in mm._tensors:
                split = [f"v.blk.{blk.group(1)}.attn_{x}.{blk.group(2)}" for x in "qkv"]
                if all(p in mm._tensors for p in split):
                    shp = [mm._tensors[p].shape for p in split]
                    self._entries[hf] = _Concat(split, (sum(s[0] for s in shp), *shp[0][1:]))
                    continue
            missing = [p for p in parts if p not in mm._tensors]
            if missing:
                raise WeightError(f"{mm_where}: mmproj tensor '{missing[0]}' (model.visual.{leaf}) is missing")
            t = mm._tensors[parts[0]]
            if leaf == "patch_embed.proj.weight":
                s = t.shape
                self._entries[hf] = _PatchEmbed(parts, (s[0], s[1], len(parts), s[2], s[3]))
            else:
                self._entries[hf] = _Plain(parts, t.shape)
        self._vl_config = None

    def config(self, dtype: torch.dtype | str = torch.float32):
        """``Qwen3VLMoeConfig`` / ``Glm4vMoeConfig``: the text model from the language model's metadata,
        the vision tower from the mmproj's, the image tokens' ids from the vocabulary."""
        if self._vl_config is not None and dtype == torch.float32:
            return self._vl_config
        tcfg = super().config(dtype)
        cfg = self._glm4v_config(tcfg) if self.vision_info["projector"] == "glm4v" else self._qwen3vl_config(tcfg)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        cfg.dtype = dtype
        name = getattr(tcfg, "_name_or_path", None)
        if name:
            cfg._name_or_path = name
        if dtype == torch.float32:
            self._vl_config = cfg
        return cfg

    def _glm4v_config(self, tcfg):
        """GLM-4.5V: ``Glm4MoeConfig``'s fields as ``Glm4vMoeTextConfig``'s, M-RoPE sections from
        ``glm4moe.rope.dimension_sections``."""
        import transformers as tf

        if getattr(tcfg, "use_qk_norm", False):
            raise WeightError(f"{self.files[0]}: this glm4moe model norms q and k (blk.N.attn_q_norm), which "
                              "GLM-4.5V's text model does not; it is not GLM-4.5V's language model")
        text = {k: getattr(tcfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "attention_bias",
            "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts", "n_routed_experts",
            "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
            "head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
            if getattr(tcfg, k, None) is not None}
        rope = dict(tcfg.rope_parameters or {})
        sections = [int(x) for x in list(self.metadata[f"{self.arch}.rope.dimension_sections"])[:3]]
        rotary = int(text["head_dim"] * float(rope.get("partial_rotary_factor", 1.0)))
        if sum(sections) != rotary // 2:
            raise WeightError(f"{self.files[0]}: '{self.arch}.rope.dimension_sections' {sections} do not add up to "
                              f"half the rotary size {rotary} ({self.arch}.rope.dimension_count)")
        rope["mrope_section"] = sections
        text["rope_parameters"] = rope
        cfg = tf.Glm4vMoeConfig(text_config=text, vision_config=dict(self.vision_info["vision_config"]),
                                tie_word_embeddings=bool(text.get("tie_word_embeddings")),
                                **_token_ids(self.metadata, GLM4V_IMAGE_TOKENS))
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if text.get(k) is not None:
                setattr(cfg, k, text[k])
        cfg.architectures = ["Glm4vMoeForConditionalGeneration"]
        return cfg

    def _qwen3vl_config(self, tcfg):
        """Qwen3-VL-MoE: ``Qwen3MoeConfig``'s fields as its text config, interleaved M-RoPE."""
        import transformers as tf

        text = {k: getattr(tcfg, k, None) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "attention_bias",
            "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts",
            "mlp_only_layers", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id",
            "tie_word_embeddings", "rope_parameters", "_name_or_path")}
        rope = dict(text.get("rope_parameters") or {})
        sections = self.metadata.get(f"{self.arch}.rope.dimension_sections")
        if sections:
            rope["mrope_section"] = [int(s) for s in list(sections)[:3]]
        rope["mrope_interleaved"] = True
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        if sum(rope.get("mrope_section", [])) not in (0, head_dim // 2):
            raise WeightError(f"{self.files[0]}: '{self.arch}.rope.dimension_sections' {list(sections)} do not "
                              f"add up to half the head size {head_dim}")
        skip = ("tie_word_embeddings", "rope_parameters", "_name_or_path")
        text_kw = {k: v for k, v in text.items() if v is not None and k not in skip}
        text_kw["rope_parameters"] = rope
        cfg = tf.Qwen3VLMoeConfig(text_config=text_kw, vision_config=dict(self.vision_info["vision_config"]),
                                  tie_word_embeddings=bool(text.get("tie_word_embeddings")),
                                  **_token_ids(self.metadata))
        cfg.text_config.tie_word_embeddings = bool(text.get("tie_word_embeddings"))
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if text.get(k) is not None:
                setattr(cfg, k, text[k])
        cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
        return cfg

    def image_processor(self):
        """The image processor the mmproj's metadata describes (transformers' PIL backend of the
        Qwen2-VL image processor, which Qwen3-VL uses; of GLM-4V's for GLM-4.5V)."""
        import transformers as tf

        cls = tf.Glm4vImageProcessorPil if self.vision_info["projector"] == "glm4v" else tf.Qwen2VLImageProcessorPil
        return cls(**self.vision_info["processor"])

    def validate(self, config=None, model: torch.nn.Module | None = None) -> None:
        if model is None:
            import transformers as tf
            from accelerate import init_empty_weights

            cls = (tf.Glm4vMoeForConditionalGeneration if self.vision_info["projector"] == "glm4v"
                   else tf.Qwen3VLMoeForConditionalGeneration)
            with init_empty_weights():
                model = cls(config or self.config())
        super().validate(config, model)

    def __str__(self) -> str:  # what the loader's progress lines name
        return f"{self.files[0]} + {self.mmproj_path}"

    def describe(self) -> str:
        return f"GGUFWithMmproj({self.files[0]} + {self.mmproj_path}, arch={self.arch})"
