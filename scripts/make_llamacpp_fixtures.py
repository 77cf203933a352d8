"""Write the llama.cpp-converted tiny GGUF fixtures in ``tests/fixtures/llamacpp/`` (run once; needs llama.cpp).

    python scripts/make_llamacpp_fixtures.py /path/to/llama.cpp [arch ...]

For every supported architecture: a tiny random HF model (``ktransformers.util.tiny_models``,
weights rounded to bfloat16 so a BF16 GGUF holds them exactly), its byte-level BPE tokenizer,
then **llama.cpp's own** ``convert_hf_to_gguf.py --outtype bf16`` (with the gguf-py it ships).
Beside each ``<arch>.gguf`` the HF fp32 logits for fixed token ids go into ``<arch>.json``.

Qwen3-Next and Qwen3.5-MoE are written ``--outtype f32 --no-mtp``: the AVX-512-BF16 tier's BF16 CPU
kernels take bf16 activations, which their random gated-DeltaNet layer amplifies to ~5e-2 of the logits (the F32
file holds the loader to 1e-4 through the shipped rules on every tier), and the tiny models have no
MTP block.  llama.cpp's
qwen3next has no dense-MLP layers, so its tiny model has none (``mlp_only_layers = []``).

Two things of llama.cpp's converter are replaced: its BPE pre-tokenizer lookup, which only knows
published tokenizers by the hash of their output (the tiny tokenizer gets llama.cpp's ``qwen2``
pre-tokenizer name); and DeepSeek-V3.2's ``set_vocab`` runs its body (``_set_vocab_gpt2``) without
its ``assert tokenizer.add_bos_token``, which transformers 5 never satisfies for a tokenizer with a
``tokenizer.json`` (it drops ``tokenizer_config.json``'s ``add_bos_token`` then); gguf-py still writes
the file's ``add_bos_token = true``.  Everything else (tensor names, shapes, types, metadata) is
llama.cpp's.

DeepSeek-V3.2 and GLM-5 are written ``--outtype f32`` as well, so their indexers' discrete top-k key
choices see the HF model's fp32 scores on every tier (the JSON records the smallest margin at the
top-k boundary, far above the loader's error).

DeepSeek-V4 (``--outtype f32``): llama.cpp's converter reads only the released checkpoint layout
(``layers.N.attn.wq_a.weight``, ``hc_attn_fn``, per-expert ``ffn.experts.E.w1`` ..., the config's
``compress_ratios`` / ``num_hash_layers``), and always writes the routed experts MXFP4 from the
release's packed FP4 codes + E8M0 group scales.  So the tiny model's experts are rounded onto the
MXFP4 grid first (its logits are those of the rounded model) and the folder is rewritten in the
release layout (``_release_checkpoint``: names inverse to transformers' own ``deepseek_v4`` weight
renaming, experts packed as the release packs them; ``save_pretrained``'s reverse renaming is not
that layout: it keeps ``model.``, ``embed_tokens`` and ``hc_head.*`` and writes ``attn.kv_norm`` as
``attn.norm``); the converter itself is unchanged.

gpt-oss's experts come out BF16 like the rest: llama.cpp's converter writes them MXFP4 only from a
checkpoint that is MXFP4 already (the published one), which the tiny model is not.

The tests never run this script or need llama.cpp; they read the committed files.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llamacpp"
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2", "llama", "qwen2", "qwen3",
         "gemma3_text", "qwen3_next", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "qwen3_5_moe_text",
         "glm4_moe", "minimax_m2", "gpt_oss")
TOKEN_IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 257, 200, 17]
#: output type and further converter options per architecture (see the module docstring)
OUTTYPE = {"qwen3_next": "f32", "deepseek_v32": "f32", "glm_moe_dsa": "f32", "deepseek_v4": "f32",
           "qwen3_5_moe_text": "f32"}
EXTRA_ARGS = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe_text": ["--no-mtp"]}
EXTRA_CONFIG = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                "deepseek_v2": {"scoring_func": "softmax"},
                # as the released config.json files: llama.cpp's deepseek32 loader requires the
                # expert_gating_func its converter writes from scoring_func
                "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                # GLM's config.json has no bos_token_id (the config class's default 0 would win over the
                # [gMASK] llama.cpp's GLM vocab writer makes the BOS)
                "glm_moe_dsa": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "bos_token_id": None},
                "glm4_moe": {"bos_token_id": None}}

# runs in a fresh interpreter: llama.cpp's converter with the two replacements of the module docstring
_RUN_CONVERTER = """
import runpy, sys
llama_dir = sys.argv[1]
sys.path[:0] = [llama_dir, llama_dir + '/gguf-py']
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'
import conversion.deepseek
conversion.deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = [llama_dir + '/convert_hf_to_gguf.py'] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def _llamacpp_tokenizer(arch: str, folder: Path) -> None:
    """What llama.cpp's vocab writers look for: DeepSeek-V3.2's a BOS added to every prompt (the tiny
    tokenizer's ``<|endoftext|>``), GLM-4-MoE's and GLM-5's GLM's ``[gMASK]``, ``<|user|>`` and ``<|observation|>``
    specials (new ids after the tiny tokenizer's, inside the 320-token vocabulary)."""
    from transformers import AutoTokenizer

    if arch == "deepseek_v32":
        path = folder / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(bos_token="<|endoftext|>", add_bos_token=True)
        path.write_text(json.dumps(cfg, indent=2))
    elif arch in ("glm_moe_dsa", "glm4_moe"):
        tok = AutoTokenizer.from_pretrained(folder)
        tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<|user|>", "<|observation|>"]},
                               replace_extra_special_tokens=False)
        tok.save_pretrained(folder)


def make_hf(arch: str, folder: Path) -> None:
    import torch

    from ktransformers.util.tiny_models import write_tiny_model

    from ktransformers.util.tiny_models import make_tiny_tokenizer

    overrides = {}
    if arch == "gemma3_text":
        # llama.cpp drops embedding rows beyond the tokenizer, and scales queries by 1/sqrt(head_dim)
        overrides = {"vocab_size": len(make_tiny_tokenizer()), "query_pre_attn_scalar": 16}
    elif arch == "qwen3_next":
        overrides = {"mlp_only_layers": []}  # llama.cpp's qwen3next has no dense-MLP layers
    model = write_tiny_model(arch, folder, seed=ARCHS.index(arch), **overrides)
    with torch.no_grad():  # bf16-representable fp32 weights: the BF16 GGUF is then exact
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(b.to(torch.bfloat16).float())
    if arch == "deepseek_v4":
        _release_checkpoint(model, folder)
    else:
        model.save_pretrained(folder)
    _llamacpp_tokenizer(arch, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(EXTRA_CONFIG.get(arch, {}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    with _indexer_scores(model) as scores, torch.no_grad():
        logits = model(torch.tensor([TOKEN_IDS])).logits[0].float()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    margin = _min_topk_margin(scores)
    extra = {"indexer_min_margin": margin} if margin is not None else {}
    (OUT / f"{arch}.json").write_text(json.dumps({
        "arch": arch, "token_ids": TOKEN_IDS, "hf_logits": [[round(float(x), 7) for x in row] for row in logits],
        "tokenizer_probe": {"text": "Hello <|im_start|>world", "ids": tok.encode("Hello <|im_start|>world")},
        "made_by": f"llama.cpp convert_hf_to_gguf.py --outtype {OUTTYPE.get(arch, 'bf16')} "
                   "(scripts/make_llamacpp_fixtures.py)", **extra,
    }))


#: DeepSeek-V4 leaves, transformers' name -> the release's (inverse of transformers' weight renaming)
_DSV4_RELEASE = {
    "self_attn.sinks": "attn.attn_sink", "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight", "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight", "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight", "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight", "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
}
_DSV4_RELEASE_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                     "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
                     "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _mxfp4_round(w):
    """``w`` [..., cols] rounded onto the MXFP4 grid: (the rounded values, the release's packed uint8
    codes [..., cols / 2] with element 2i in the low nibble, its E8M0 scales [..., cols / 32])."""
    import torch

    g = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    e = torch.ceil(torch.log2(amax / 6.0))  # every |value| / 2^e <= 6
    x = g / torch.exp2(e)
    grid = torch.tensor(_FP4)
    code = (x.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    code = code | ((x < 0) & (code > 0)).to(code.dtype) << 3
    val = grid[code & 7] * torch.where(code >= 8, -1.0, 1.0) * torch.exp2(e)
    c = code.reshape(*w.shape[:-1], -1).to(torch.uint8)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return val.reshape(w.shape), packed, (e.squeeze(-1) + 127).to(torch.uint8)


def _release_checkpoint(model, folder: Path) -> None:
    """Rewrite the tiny DeepSeek-V4 in the released checkpoint's layout (see the module docstring);
    its routed experts are first rounded onto the MXFP4 grid, in place."""
    import torch
    from safetensors.torch import save_file

    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "rotary_emb" in name:
                continue
            if name in _DSV4_RELEASE_TOP:
                out[_DSV4_RELEASE_TOP[name]] = t.contiguous()
                continue
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            if leaf in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                val, packed, scale = _mxfp4_round(t)
                t.copy_(val)
                i = cfg.moe_intermediate_size
                parts = ({"w1": (packed[:, :i], scale[:, :i]), "w3": (packed[:, i:], scale[:, i:])}
                         if leaf.endswith("gate_up_proj") else {"w2": (packed, scale)})
                for w, (p, s) in parts.items():
                    for e in range(t.shape[0]):
                        out[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = p[e].contiguous()
                        out[f"layers.{layer}.ffn.experts.{e}.{w}.scale"] = s[e].contiguous()
                continue
            out[f"layers.{layer}.{_DSV4_RELEASE[leaf]}"] = t.contiguous()
    model.config.save_pretrained(folder)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    rates = cfg.compress_rates
    raw.update(architectures=["DeepseekV4ForCausalLM"], qk_rope_head_dim=cfg.qk_rope_head_dim,
               num_hash_layers=cfg.mlp_layer_types.count("hash_moe"),
               compress_ratios=[rates.get(t, 0) for t in cfg.layer_types])
    (folder / "config.json").write_text(json.dumps(raw, indent=2))


@contextlib.contextmanager
def _indexer_scores(model):
    """Collect the sparse-attention indexers' key scores (the tensor each passes to ``topk``)."""
    import importlib

    import torch

    module = importlib.import_module(type(model).__module__)
    indexer = next((v for k, v in vars(module).items() if k.endswith("Indexer") and isinstance(v, type)), None)
    scores: list[tuple] = []
    if indexer is None:
        yield scores
        return
    forward, topk = indexer.forward, torch.Tensor.topk

    def spy(t, k, *args, **kwargs):
        scores.append((t.detach().clone(), k))
        return topk(t, k, *args, **kwargs)

    def spied_forward(self, *args, **kwargs):
        torch.Tensor.topk = spy
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk

    indexer.forward = spied_forward
    try:
        yield scores
    finally:
        indexer.forward = forward


def _min_topk_margin(scores) -> float | None:
    """Smallest gap between the k-th and (k+1)-th causal key score of any query, relative to that
    query's largest |score|: how far the fixture's key choices are from flipping (None: no query
    had more than k keys to choose from)."""
    import torch

    gaps = []
    for t, k in scores:
        for row in t.reshape(-1, t.shape[-1]):
            v = row[torch.isfinite(row)].sort(descending=True).values
            if v.numel() > k:
                gaps.append(float((v[k - 1] - v[k]) / v.abs().max()))
    return round(min(gaps), 6) if gaps else None


def main(argv: list[str]) -> int:
    if not argv or not (Path(argv[0]) / "convert_hf_to_gguf.py").is_file():
        print("usage: python scripts/make_llamacpp_fixtures.py LLAMA_CPP_DIR [arch ...]", file=sys.stderr)
        return 2
    llama_dir, archs = argv[0], argv[1:] or list(ARCHS)
    OUT.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        with tempfile.TemporaryDirectory() as tmp:
            hf = Path(tmp) / arch
            make_hf(arch, hf)
            subprocess.run([sys.executable, "-c", _RUN_CONVERTER, llama_dir, str(hf),
                            "--outtype", OUTTYPE.get(arch, "bf16"), *EXTRA_ARGS.get(arch, []),
                            "--outfile", str(OUT / f"{arch}.gguf")], check=True)
        print(f"{arch}: {(OUT / f'{arch}.gguf').stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
