"""Write the llama.cpp-converted tiny GGUF fixtures in ``tests/fixtures/llamacpp/`` (run once; needs llama.cpp).

    python scripts/make_llamacpp_fixtures.py /path/to/llama.cpp [arch ...]

For every supported architecture: a tiny random HF model (``ktransformers.util.tiny_models``,
weights rounded to bfloat16 so a BF16 GGUF holds them exactly), its byte-level BPE tokenizer,
then **llama.cpp's own** ``convert_hf_to_gguf.py --outtype bf16`` (with the gguf-py it ships).
Beside each ``<arch>.gguf`` the HF fp32 logits for fixed token ids go into ``<arch>.json``.

Qwen3-Next is written ``--outtype f32 --no-mtp``: the AVX-512-BF16 tier's BF16 CPU kernels take
bf16 activations, which its random gated-DeltaNet layer amplifies to ~5e-2 of the logits (the F32
file holds the loader to 1e-4 through the shipped rules on every tier), and the tiny model has no
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
         "gemma3_text", "qwen3_next", "deepseek_v32", "glm_moe_dsa")
TOKEN_IDS = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 257, 200, 17]
#: output type and further converter options per architecture (see the module docstring)
OUTTYPE = {"qwen3_next": "f32", "deepseek_v32": "f32", "glm_moe_dsa": "f32"}
EXTRA_ARGS = {"qwen3_next": ["--no-mtp"]}
EXTRA_CONFIG = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                "deepseek_v2": {"scoring_func": "softmax"},
                # as the released config.json files: llama.cpp's deepseek32 loader requires the
                # expert_gating_func its converter writes from scoring_func
                "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
                # GLM's config.json has no bos_token_id (the config class's default 0 would win over the
                # [gMASK] llama.cpp's GLM vocab writer makes the BOS)
                "glm_moe_dsa": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "bos_token_id": None}}

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
    tokenizer's ``<|endoftext|>``), GLM-5's GLM's ``[gMASK]``, ``<|user|>`` and ``<|observation|>``
    specials (new ids after the tiny tokenizer's, inside the 320-token vocabulary)."""
    from transformers import AutoTokenizer

    if arch == "deepseek_v32":
        path = folder / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(bos_token="<|endoftext|>", add_bos_token=True)
        path.write_text(json.dumps(cfg, indent=2))
    elif arch == "glm_moe_dsa":
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
    model.save_pretrained(folder)
    _llamacpp_tokenizer(arch, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(EXTRA_CONFIG.get(arch, {}))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    with _indexer_scores(model) as scores, torch.no_grad():
        logits = model(torch.tensor([TOKEN_IDS])).logits[0].float()
    tok = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    extra = {"indexer_min_margin": _min_topk_margin(scores)} if scores else {}
    (OUT / f"{arch}.json").write_text(json.dumps({
        "arch": arch, "token_ids": TOKEN_IDS, "hf_logits": [[round(float(x), 7) for x in row] for row in logits],
        "tokenizer_probe": {"text": "Hello <|im_start|>world", "ids": tok.encode("Hello <|im_start|>world")},
        "made_by": f"llama.cpp convert_hf_to_gguf.py --outtype {OUTTYPE.get(arch, 'bf16')} "
                   "(scripts/make_llamacpp_fixtures.py)", **extra,
    }))


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


def _min_topk_margin(scores) -> float:
    """Smallest gap between the k-th and (k+1)-th causal key score of any query, relative to that
    query's largest |score|: how far the fixture's key choices are from flipping."""
    import torch

    gaps = []
    for t, k in scores:
        for row in t.reshape(-1, t.shape[-1]):
            v = row[torch.isfinite(row)].sort(descending=True).values
            if v.numel() > k:
                gaps.append(float((v[k - 1] - v[k]) / v.abs().max()))
    return round(min(gaps), 6)


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
